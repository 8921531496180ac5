"""The plugin's gate and the platform rules.

On a vLLM version, platform or set of internals the plugin was not made for,
``register()`` warns once and stays off: vLLM keeps working, and only a request
for eviction stops start-up with one line. On CUDA, eviction selects the
plugin's Triton backend, turns async scheduling off and picks the V1 model
runner. The rules are a pure function tested here with plain objects; the
registration and the refusals run in subprocesses (``register()`` changes
vLLM's classes for the whole process) with the version or the platform faked,
all started at once.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

import vllm_kvevict
from vllm_kvevict.config import KVEvictionConfigError
from vllm_kvevict.plugin.frontend import cli
from vllm_kvevict.plugin import compat
from vllm_kvevict.plugin.compat import VLLMContractError

OFF_WARNING = "vllm-kvevict is off and vLLM runs without KV-cache eviction"
CLI_ERROR = "vllm-kvevict: error: KV-cache eviction is unavailable:"

# --------------------------------------------------------------------------- the rules


def _args(backend=None, configured=None, per_kind=None, async_scheduling=None, watermark_config=None,
          enforce_eager=False, compilation_config=None):
    """The EngineArgs fields the rules read."""
    attention_config = SimpleNamespace(backend=configured, backend_per_kind=per_kind or {}, hisparse_config=None)
    return SimpleNamespace(
        attention_backend=backend, attention_config=attention_config,
        async_scheduling=async_scheduling, watermark_config=watermark_config,
        enforce_eager=enforce_eager, compilation_config=compilation_config,
    )


def _config(kernel="auto", policy="snapkv"):
    return SimpleNamespace(attention_kernel=kernel, policy=policy)


def _member(name):
    """Stands for an AttentionBackendEnum member (what LLM(attention_backend=...) may hold)."""
    return SimpleNamespace(name=name)


def test_cuda_selects_the_triton_backend_without_async_scheduling_on_the_v1_runner():
    changes = cli.eviction_platform_rules("cuda", _args(), _config(), {})
    assert changes.attention_backend == vllm_kvevict.GPU_BACKEND_NAME == "KVEVICT_TRITON"
    assert changes.async_scheduling_off
    assert changes.environ == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert "NVIDIA H200 with test models only" in changes.warning and "Status section" in changes.warning
    assert "\n" not in changes.warning


@pytest.mark.parametrize(
    "args,kernel,environ",
    [
        (_args(backend="auto"), "triton", {}),
        (_args(backend="kvevict_triton"), "auto", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        (_args(backend=_member("KVEVICT_TRITON"), async_scheduling=False), "auto", {}),
        (_args(per_kind={"full_attention": "KVEVICT_TRITON"}), "auto", {"VLLM_USE_V2_MODEL_RUNNER": ""}),
    ],
)
def test_cuda_accepts_what_agrees_with_the_rules(args, kernel, environ):
    changes = cli.eviction_platform_rules("cuda", args, _config(kernel), environ)
    assert changes.attention_backend == "KVEVICT_TRITON" and changes.async_scheduling_off


def test_cuda_runs_the_learned_policy_without_cuda_graphs():
    """Its retention gates run between layers, where CUDA graph replays skip
    them: refused with graphs, accepted without (eager, or graphs off)."""
    with pytest.raises(KVEvictionConfigError) as info:
        cli.eviction_platform_rules("cuda", _args(), _config(policy="learned"), {})
    assert "add --enforce-eager or -cc.cudagraph_mode=NONE" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(KVEvictionConfigError):
        cli.eviction_platform_rules("cuda", _args(compilation_config={"cudagraph_mode": "PIECEWISE"}),
                                    _config(policy="learned"), {})
    for args in (_args(enforce_eager=True), _args(compilation_config={"cudagraph_mode": "NONE"}),
                 _args(compilation_config=SimpleNamespace(cudagraph_mode=_member("NONE")))):
        assert cli.eviction_platform_rules("cuda", args, _config(policy="learned"), {}).async_scheduling_off
    assert cli.eviction_platform_rules("cpu", _args(), _config(policy="learned"), {}) == cli.PlatformChanges()
    assert cli.eviction_platform_rules("cuda", _args(), _config(policy="snapkv"), {}).async_scheduling_off


def test_cuda_backend_chosen_in_attention_config_is_kept_there():
    # vLLM refuses --attention-backend and --attention-config's backend together.
    changes = cli.eviction_platform_rules("cuda", _args(configured=_member("KVEVICT_TRITON")), _config(), {})
    assert changes.attention_backend is None and changes.async_scheduling_off


@pytest.mark.parametrize(
    "args,kernel,environ,fix",
    [
        (_args(backend="FLASH_ATTN"), "auto", {}, "drop --attention-backend FLASH_ATTN"),
        (_args(backend=_member("TRITON_ATTN")), "auto", {}, "drop --attention-backend TRITON_ATTN"),
        (_args(configured=_member("FLASHINFER")), "auto", {}, "drop --attention-config's backend FLASHINFER"),
        (_args(per_kind={"full_attention": _member("FLASH_ATTN")}), "auto", {}, "drop backend_per_kind"),
        (_args(async_scheduling=True), "auto", {}, "drop --async-scheduling"),
        (_args(), "auto", {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "unset VLLM_USE_V2_MODEL_RUNNER"),
        (_args(), "native", {}, "use 'auto' or 'triton' on CUDA"),
        (_args(), "torch", {}, "native and torch are CPU kernels"),
        (_args(watermark_config={"type": "x"}), "auto", {}, "drop --watermark-config"),
    ],
)
def test_cuda_refuses_what_conflicts_in_one_line(args, kernel, environ, fix):
    with pytest.raises(KVEvictionConfigError) as info:
        cli.eviction_platform_rules("cuda", args, _config(kernel), environ)
    message = str(info.value)
    assert fix in message and "\n" not in message


def test_cuda_rules_read_the_real_config():
    from vllm_kvevict.config import EvictionConfig, build_config

    if "attention_kernel" not in EvictionConfig.model_fields:
        pytest.skip("EvictionConfig has no attention_kernel yet")
    cli.eviction_platform_rules("cuda", _args(), build_config({"policy": "snapkv"}), {})
    with pytest.raises(KVEvictionConfigError, match="CPU kernels"):
        cli.eviction_platform_rules(
            "cuda", _args(), build_config({"policy": "snapkv", "attention_kernel": "native"}), {})


@pytest.mark.parametrize("platform,shown", [("rocm", "ROCm"), ("xpu", "XPU"), ("tpu", "TPU"), ("oot", "out-of-tree")])
def test_other_platforms_refused_in_one_line(platform, shown):
    with pytest.raises(KVEvictionConfigError) as info:
        cli.eviction_platform_rules(platform, _args(), _config(), {})
    message = str(info.value)
    assert shown in message and "CPU and CUDA" in message and "\n" not in message


def test_cpu_changes_nothing_and_runs_triton_only_under_the_interpreter(monkeypatch):
    assert cli.eviction_platform_rules("cpu", _args(), _config(), {}) == cli.PlatformChanges()
    assert cli.eviction_platform_rules("cpu", _args(), _config("native"), {}) == cli.PlatformChanges()
    for environ in ({}, {"TRITON_INTERPRET": "0"}):
        with pytest.raises(KVEvictionConfigError) as info:
            cli.eviction_platform_rules("cpu", _args(), _config("triton"), environ)
        message = str(info.value)
        assert "start vLLM with TRITON_INTERPRET=1" in message and "\n" not in message
    assert cli.eviction_platform_rules("cpu", _args(), _config("triton"), {"TRITON_INTERPRET": "1"}) == cli.PlatformChanges()
    monkeypatch.setattr(cli, "_triton_importable", lambda: False)
    with pytest.raises(KVEvictionConfigError, match="need Triton; pip install triton"):
        cli.eviction_platform_rules("cpu", _args(), _config("triton"), {"TRITON_INTERPRET": "1"})
    with pytest.raises(KVEvictionConfigError, match="need Triton"):
        cli.eviction_platform_rules("cuda", _args(), _config(), {})


def test_changes_applied_to_engine_args_and_environment(monkeypatch, caplog):
    from vllm import envs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # restored after the test
    monkeypatch.setattr(cli, "_warned_cuda", False)
    envs.enable_envs_cache()  # as after an engine started in this process
    try:
        assert envs.VLLM_USE_V2_MODEL_RUNNER is True
        args = _args(async_scheduling=None)
        changes = cli.eviction_platform_rules("cuda", args, _config(), {})
        with caplog.at_level(logging.WARNING, logger="vllm_kvevict"):
            cli.apply_platform_changes(args, changes)
            cli.apply_platform_changes(args, changes)
        assert args.attention_backend == "KVEVICT_TRITON" and args.async_scheduling is False
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        assert envs.VLLM_USE_V2_MODEL_RUNNER is False  # the cached value is gone
        assert [r.getMessage() for r in caplog.records] == [changes.warning]
    finally:
        envs.disable_envs_cache()


# --------------------------------------------------------------------------- the gate


def test_installed_vllm_is_supported():
    assert compat.platform_name() == "cpu"
    assert compat.unsupported_reason() is None


def test_unsupported_version_platform_or_contract_keeps_the_plugin_off(monkeypatch):
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.40.0")
    reason = compat.unsupported_reason()
    assert "found vLLM 0.40.0" in reason and "0.32" in reason and "install" in reason
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.32.0+cpu")
    monkeypatch.setattr(compat, "platform_name", lambda: "rocm")
    assert "found ROCm" in compat.unsupported_reason()
    monkeypatch.setattr(compat, "platform_name", lambda: "cuda")
    monkeypatch.setitem(compat.COMPILED_OPS, "cuda", "vllm._custom_ops")  # stands for ops that load
    assert compat.unsupported_reason() is None

    def changed():
        raise VLLMContractError("vLLM changed: EngineArgs.add_cli_args is gone; vllm-kvevict needs it")

    monkeypatch.setattr(compat, "check_core_contract", changed)
    assert compat.unsupported_reason() == "vLLM changed: EngineArgs.add_cli_args is gone; vllm-kvevict needs it"

    def moved():
        raise ImportError("No module named 'vllm.v1.kv_cache_spec_registry'")

    monkeypatch.setattr(compat, "check_core_contract", moved)
    reason = compat.unsupported_reason()
    assert reason.startswith("vLLM changed: ImportError") and "kv_cache_spec_registry" in reason
    assert "\n" not in reason


def test_compiled_ops_that_do_not_load_are_named_with_the_fix(monkeypatch):
    """vLLM's CUDA ops built for another torch (or missing): the gate names
    them and the fix, whether their import fails or an op is missing later."""
    import torch

    monkeypatch.setattr(compat, "platform_name", lambda: "cuda")
    monkeypatch.setitem(compat.COMPILED_OPS, "cuda", "vllm_kvevict_no_such_compiled_ops")
    reason = compat.unsupported_reason()
    assert reason.startswith("vLLM's compiled ops did not load: ModuleNotFoundError")
    assert "vllm_kvevict_no_such_compiled_ops" in reason
    assert f"install vLLM's CUDA wheel for your torch ({torch.__version__})" in reason

    monkeypatch.setitem(compat.COMPILED_OPS, "cuda", "vllm._custom_ops")

    def op_missing():
        raise AttributeError("'_OpNamespace' '_C' object has no attribute 'cutlass_scaled_mm_supports_block_fp8'")

    monkeypatch.setattr(compat, "check_core_contract", op_missing)
    reason = compat.unsupported_reason()
    assert reason.startswith("vLLM's compiled ops did not load: AttributeError")
    assert "cutlass_scaled_mm_supports_block_fp8" in reason and "install vLLM's CUDA wheel" in reason
    assert "\n" not in reason
    monkeypatch.setattr(compat, "platform_name", lambda: "cpu")  # the CPU platform loads no CUDA ops
    monkeypatch.setattr(compat, "check_core_contract", lambda: None)
    assert compat.unsupported_reason() is None


def test_platform_name_when_vllm_cannot_tell(monkeypatch):
    from vllm.platforms import current_platform

    def broken():
        raise RuntimeError("Failed to infer device type")

    monkeypatch.setattr(current_platform, "is_cpu", broken)
    assert compat.platform_name() == "unknown"


# Each script fakes the version or the platform, then does what a user would.
_FAKE = """
import sys
from vllm_kvevict.plugin import compat
fake, value = sys.argv[1], sys.argv[2]
if fake == "version":
    compat.installed_vllm_version = lambda: value
else:
    compat.platform_name = lambda: value
    compat.COMPILED_OPS[value] = "vllm._custom_ops"  # the CPU build has no CUDA ops: a module that loads
"""

_SCRIPTS = {
    # `vllm ARGS...` with the version or platform faked.
    "vllm": _FAKE + """
sys.argv = ["vllm", *sys.argv[3:]]
from vllm.entrypoints.cli.main import main
main()
""",
    # Off: nothing registered, plain vLLM parses and configures, eviction refused,
    # a child process (as vLLM's engine) does not warn again, `vllm serve --help` works.
    "python_api": _FAKE + """
import os, subprocess
model = sys.argv[3]
import vllm_kvevict
vllm_kvevict.register()
vllm_kvevict.register()
from vllm.v1.attention.backends import registry
assert vllm_kvevict.off_reason and not registry._ATTN_OVERRIDES, registry._ATTN_OVERRIDES
assert vllm_kvevict.GPU_BACKEND_NAME not in registry.AttentionBackendEnum.__members__
assert "vllm_kvevict.plugin.scheduler.manager" not in sys.modules
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
args = parser.parse_args(["--model", model, "--max-model-len", "512", "--block-size", "32"])
config = EngineArgs.from_cli_args(args).create_engine_config()
print("PLAIN", config.model_config.max_model_len, flush=True)
from vllm_kvevict.config import KVEvictionConfigError
try:
    EngineArgs(model=model, additional_config={"kv_eviction": {"policy": "snapkv"}}).create_engine_config()
except KVEvictionConfigError as exc:
    print("REFUSED", exc, flush=True)
child = "from vllm_kvevict.plugin import compat; compat.installed_vllm_version = lambda: '0.40.0'; import vllm_kvevict; vllm_kvevict.register(); print('CHILD', bool(vllm_kvevict.off_reason))"
subprocess.run([sys.executable, "-c", child], check=True)
sys.argv = ["vllm", "serve", "--help=kv-eviction"]
from vllm.entrypoints.cli.main import main
try:
    main()
except SystemExit as exc:
    print("HELP_EXIT", exc.code, flush=True)
""",
    # CUDA faked on the CPU build: registration, the engine config with eviction,
    # and the backend member unpickled in a process that never ran register().
    "cuda": _FAKE + """
import importlib.util, os, pickle, subprocess
model = sys.argv[3]
import vllm_kvevict
vllm_kvevict.register()
from vllm.v1.attention.backends.registry import AttentionBackendEnum
member = AttentionBackendEnum[vllm_kvevict.GPU_BACKEND_NAME]
assert member.get_path() == vllm_kvevict.GPU_BACKEND
assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
assert "vllm_kvevict.plugin.scheduler.manager" in sys.modules
os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
from vllm.engine.arg_utils import EngineArgs
config = EngineArgs(model=model, max_model_len=512, block_size=32, dtype="float32",
                    additional_config={"kv_eviction": {"policy": "snapkv"}}).create_engine_config()
print("BACKEND", config.attention_config.backend is member, flush=True)
print("ASYNC", config.scheduler_config.async_scheduling, flush=True)
print("RUNNER", os.environ.get("VLLM_USE_V2_MODEL_RUNNER"), config.use_v2_model_runner, flush=True)
if importlib.util.find_spec("vllm_kvevict.plugin.backends.triton.backend") is not None:
    print("GET_NAME", member.get_class().get_name(), flush=True)
child = "import pickle, sys; c = pickle.load(sys.stdin.buffer); print('CHILD', c.backend.name, c.backend.get_path())"
out = subprocess.run([sys.executable, "-c", child], input=pickle.dumps(config.attention_config),
                     capture_output=True, check=True, env=dict(os.environ, VLLM_PLUGINS=""))
print(out.stdout.decode().strip(), flush=True)
""",
}


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """Every subprocess case, started together; name -> (returncode, stdout, stderr)."""
    folder = tmp_path_factory.mktemp("gate")
    for name, text in _SCRIPTS.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    cases = {
        "serve_old_vllm": ("vllm", "version", "0.40.0", "serve", model_dir, "--kv-eviction", "snapkv", "--port", "1"),
        "serve_rocm": ("vllm", "platform", "rocm", "serve", model_dir, "--kv-eviction-config", '{"policy": "snapkv"}',
                       "--port", "1"),
        "python_api": ("python_api", "version", "0.40.0", model_dir),
        "cuda": ("cuda", "platform", "cuda", model_dir),
    }
    env = {k: v for k, v in os.environ.items() if k != vllm_kvevict._OFF_WARNED_ENV}
    env["PYTHONSAFEPATH"] = "1"
    procs = {
        name: subprocess.Popen([sys.executable, str(folder / f"{script}.py"), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name, (script, *args) in cases.items()
    }
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = (proc.returncode, out, err)
    return results


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("name,found", [("serve_old_vllm", "found vLLM 0.40.0"), ("serve_rocm", "found ROCm")])
def test_eviction_request_on_the_command_line_exits_with_one_line(runs, name, found):
    code, out, err = runs[name]
    assert code == 2, (out + err)[-3000:]
    errors = _lines(err, "vllm-kvevict: error:")
    assert len(errors) == 1 and errors[0].startswith(CLI_ERROR) and found in errors[0], err[-3000:]
    assert "Traceback" not in err
    assert err.count(OFF_WARNING) == 1


def test_off_warns_once_leaves_vllm_working_and_refuses_eviction_in_python(runs):
    code, out, err = runs["python_api"]
    assert code == 0, (out + err)[-3000:]
    assert _lines(out, "PLAIN") == ["PLAIN 512"]
    refused = _lines(out, "REFUSED")
    assert len(refused) == 1 and "KV-cache eviction is unavailable" in refused[0] and "0.40.0" in refused[0]
    assert _lines(out, "CHILD") == ["CHILD True"]
    assert err.count(OFF_WARNING) == 1, err[-3000:]  # main process and child together
    # `vllm serve --help`: the flags are listed as refused, with the reason
    assert _lines(out, "HELP_EXIT") == ["HELP_EXIT 0"]
    assert "--kv-eviction-config" in out and "Refused. KV-cache eviction is unavailable" in " ".join(out.split())


def test_cuda_registers_the_triton_backend_and_applies_the_rules(runs):
    code, out, err = runs["cuda"]
    assert code == 0, (out + err)[-3000:]
    assert _lines(out, "BACKEND") == ["BACKEND True"]
    assert _lines(out, "ASYNC") == ["ASYNC False"]
    assert _lines(out, "RUNNER") == ["RUNNER 0 False"]
    assert err.count("served so far on an NVIDIA H200 with test models only") == 1
    assert _lines(out, "CHILD") == [f"CHILD {vllm_kvevict.GPU_BACKEND_NAME} {vllm_kvevict.GPU_BACKEND}"]
    names = _lines(out, "GET_NAME")
    if not names:
        pytest.skip("plugin/backends/triton/backend.py is not there yet")
    assert names == [f"GET_NAME {vllm_kvevict.GPU_BACKEND_NAME}"]  # Attention looks the member up by it
