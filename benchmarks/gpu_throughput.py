"""Offline throughput on a GPU: the full cache against eviction, on a
random-weight model of a real shape.

Four engines, each an offline ``vllm.LLM`` in a process of its own, compiled
(CUDA graphs) as users run them, bf16 (``--dtype``):

* ``full-unbounded``: the full cache, a KV pool that holds every request at
  once (vLLM's own attention backend: FLASH_ATTN where it runs);
* ``full-pool``: the full cache, a pool of ``--pool-requests`` requests'
  full length;
* ``snapkv``, ``momentkv``: eviction at ``--kept`` of the prompt (budget per
  KV head), the same pool as ``full-pool``.

The engines start side by side (loading, compiling, capturing graphs; each
warms up with one request that evicts at its prompt's end and while
decoding, so every kernel is compiled before it is timed), then the timed runs
go one at a time, each alone on the GPU: ``--requests`` prompts of
``--prompt-tokens`` random token ids, ``--max-tokens`` greedy tokens each
(``ignore_eos``). ``--wait-for FILE`` holds the timed runs until FILE exists
(another job sharing the GPU has finished).

The model: ``build_tiny_llama`` of ``tests/tiny_model.py`` with
Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query heads, 8 KV heads of
64, MLP 8192) and the default model's tokenizer (vocabulary 49,152 instead of
128,256), seeded random weights. Output tokens are meaningless; the work per
token is a 1B model's.

    python benchmarks/gpu_throughput.py --tokenizer-dir DIR --work DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The model is built by the tests' builder (tests/tiny_model.py).
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

LLAMA_1B_SHAPE = {
    "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "intermediate_size": 8192, "max_position_embeddings": 8192,
}
BLOCK_SIZE = 32
ROWS = ("full-unbounded", "full-pool", "snapkv", "momentkv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--work", required=True, help="the model, the engines' logs and results")
    parser.add_argument("--tokenizer-dir", help="tokenizer files for the model (default: the default model's)")
    parser.add_argument("--model", help="serve this model folder instead of building the random 1B one")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--pool-requests", type=int, default=4, help="the limited pool: this many full requests")
    parser.add_argument("--kept", type=float, default=0.25, help="eviction's budget as a share of the prompt")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.03,
                        help="each engine's start-up share (the KV pool is set in bytes)")
    parser.add_argument("--wait-for", metavar="FILE", help="start the timed runs once FILE exists")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole benchmark")
    parser.add_argument("--json", help="write the results here (default WORK/gpu-throughput.json)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # one row, in a subprocess
    return parser.parse_args(argv)


def row_settings(name: str, args: argparse.Namespace, block_bytes: int) -> dict:
    full = args.prompt_tokens + args.max_tokens
    pool_tokens = (args.requests if name == "full-unbounded" else args.pool_requests) * full
    pool_blocks = -(-pool_tokens // BLOCK_SIZE) + 1  # vLLM keeps one null block
    settings = {"name": name, "kv_cache_memory_bytes": pool_blocks * block_bytes, "pool_tokens": pool_tokens}
    if name in ("snapkv", "momentkv"):
        settings["kv_eviction"] = {"policy": name, "budget": int(args.kept * args.prompt_tokens)}
    return settings


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def run_engine(request: dict) -> None:
    """One row: start, warm up, say ready, wait for the go, run, report."""
    from vllm import LLM, SamplingParams

    work = Path(request["work"])
    name = request["name"]
    start = time.monotonic()
    kwargs = {"additional_config": {"kv_eviction": request["kv_eviction"]}} if "kv_eviction" in request else {}
    llm = LLM(
        request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"], block_size=BLOCK_SIZE,
        max_num_seqs=request["requests"], gpu_memory_utilization=request["gpu_memory_utilization"],
        kv_cache_memory_bytes=request["kv_cache_memory_bytes"], seed=0, **kwargs,
    )
    started = time.monotonic() - start
    greedy = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True)
    warm = prompts(1, request["prompt_tokens"], request["vocab"], seed=1)
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    (work / f"ready-{name}").touch()
    go = work / f"go-{name}"
    while not go.exists():
        time.sleep(0.2)
    timed = prompts(request["requests"], request["prompt_tokens"], request["vocab"], seed=2)
    t0 = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": p} for p in timed], greedy, use_tqdm=False)
    wall = time.monotonic() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    time.sleep(1.0)  # the scheduler publishes its counters once it has seen the requests finish
    stats_path = os.environ.get("KVEVICT_STATS_PATH")
    stats = json.loads(Path(stats_path).read_text()) if stats_path and Path(stats_path).is_file() else None
    result = {
        "row": name, "startup_s": started, "wall_s": wall, "requests": len(outputs), "output_tokens": generated,
        "output_tok_s": generated / wall, "total_tok_s": (generated + len(timed) * len(timed[0])) / wall,
        "pool_tokens": request["pool_tokens"], "kv_eviction": request.get("kv_eviction"),
        "blocks_freed_by_eviction": (stats or {}).get("blocks_freed_by_eviction"),
    }
    (work / f"result-{name}.json").write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()


def attention_backend(log: Path) -> str:
    import re

    text = log.read_text(errors="replace") if log.is_file() else ""
    found = re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend", text)
    return found[-1] if found else "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine:
        run_engine(json.loads(Path(args.engine).read_text()))
        return 0
    deadline = time.monotonic() + args.timeout
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for stale in [*work.glob("ready-*"), *work.glob("go-*"), *work.glob("result-*")]:
        stale.unlink()
    names = [n for n in args.rows.split(",") if n]
    unknown = set(names) - set(ROWS)
    if unknown:
        raise SystemExit(f"gpu_throughput: unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")
    if args.model:
        model = Path(args.model)
    else:
        from tiny_model import build_tiny_llama

        t0 = time.monotonic()
        tokenizer = Path(args.tokenizer_dir) if args.tokenizer_dir else None
        model = build_tiny_llama(work / "llama-1b-shape", 0, tokenizer_dir=tokenizer, **LLAMA_1B_SHAPE)
        print(f"built {model} in {time.monotonic() - t0:.0f}s", flush=True)
    config = json.loads((model / "config.json").read_text())
    element = 4 if args.dtype == "float32" else 2
    block_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * BLOCK_SIZE * config["head_dim"] * element
    procs = {}
    for name in names:
        request = {**row_settings(name, args, block_bytes), "model": str(model), "work": str(work),
                   "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                   "max_model_len": args.prompt_tokens + args.max_tokens, "vocab": config["vocab_size"],
                   "gpu_memory_utilization": args.gpu_memory_utilization, "dtype": args.dtype}
        path = work / f"request-{name}.json"
        path.write_text(json.dumps(request))
        env = {**os.environ, "KVEVICT_STATS_PATH": str(work / f"stats-{name}.json"), "PYTHONUNBUFFERED": "1"}
        with open(work / f"engine-{name}.log", "w") as log:
            procs[name] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--work", str(work),
                                            "--engine", str(path)], stdout=log, stderr=subprocess.STDOUT, env=env)
    results, failures = {}, {}

    def alive_or_fail(name: str) -> bool:
        if procs[name].poll() is not None and not (work / f"result-{name}.json").exists():
            failures[name] = f"engine exited with {procs[name].returncode} (engine-{name}.log)"
            return False
        return time.monotonic() < deadline or not failures.setdefault(name, "timed out")

    while any(alive_or_fail(n) and not (work / f"ready-{n}").exists() for n in names if n not in failures):
        time.sleep(0.5)
    if args.wait_for:
        while not Path(args.wait_for).exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    for name in names:  # one at a time, alone on the GPU
        if name in failures:
            continue
        (work / f"go-{name}").touch()
        while alive_or_fail(name) and not (work / f"result-{name}.json").exists():
            time.sleep(0.2)
        if (work / f"result-{name}.json").exists():
            results[name] = json.loads((work / f"result-{name}.json").read_text())
            results[name]["attention_backend"] = attention_backend(work / f"engine-{name}.log")
    for proc in procs.values():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    summary = {"device": device, "date": time.strftime("%Y-%m-%d"), "model": str(model),
               "shape": {k: config[k] for k in (*LLAMA_1B_SHAPE, "vocab_size") if k in config},
               "workload": {k: getattr(args, k) for k in ("requests", "prompt_tokens", "max_tokens", "pool_requests",
                                                          "kept")},
               "results": results, "failures": failures}
    out = Path(args.json) if args.json else work / "gpu-throughput.json"
    out.write_text(json.dumps(summary, indent=1))
    base = results.get("full-pool", {}).get("output_tok_s")
    print(f"{device}; {args.requests} requests of {args.prompt_tokens} prompt + {args.max_tokens} output tokens")
    print("| row | backend | pool tokens | wall s | output tok/s | x full-pool | blocks freed | start s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        r = results.get(name)
        if r is None:
            print(f"| {name} | failed: {failures.get(name)} |||||||")
            continue
        ratio = f"{r['output_tok_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['attention_backend']} | {r['pool_tokens']:,} | {r['wall_s']:.1f} | "
              f"{r['output_tok_s']:,.0f} | {ratio} | {r['blocks_freed_by_eviction'] or '-'} | {r['startup_s']:.0f} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
