"""Tensor parallelism: ``tensor_parallel_size=2`` with eviction gives TP=1's tokens.

At TP=2 each worker holds half of the KV heads and evicts them on its own
(heads choose independently, so the split must not change what is kept). The
model is the tiny random Llama (head_dim 32, 8 query / 4 KV heads: SmolLM2's 3
KV heads do not split in two). Greedy fp32 outputs of a few prompts, short to
~2.9k tokens with budget 256 and decode_interval 16, so that blocks are freed
during prefill and every 32 decode steps, must be the same token ids at TP=1
and TP=2, for StreamingLLM (per-chunk prefill eviction) and SnapKV
(end-of-prompt). A third case uses the model's multi-query variant (1 KV head),
which vLLM replicates on both ranks: each replica sees only half of the query
heads that share it, and SnapKV, which scores with all of them, must still keep
the same tokens on both ranks and the same as at TP=1.
A fourth case runs SnapKV on per-head page tables with the MomentKV correction
(uniform head budgets: AdaKV's split across heads is per rank, as each rank's
pages hold only its own heads).

The two engines run one after the other, each in its own process (this file,
run as a script), because CPU tensor parallelism binds one core per rank
(under pytest-xdist both ranks bind to the worker's own core).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 32
POOL_BLOCKS = 256
MAX_TOKENS = 64
PROMPT_TOKENS = (24, 400, 1500, 2200, 2900)
EVICTION = {"budget": 256, "decode_interval": 16}
# case: (KV heads of the tiny model, eviction settings)
CASES = {
    "streamingllm": (4, {"policy": "streamingllm", **EVICTION}),
    "snapkv": (4, {"policy": "snapkv", **EVICTION}),
    "snapkv-replicated-kv": (1, {"policy": "snapkv", **EVICTION}),
    # Per-head page tables and the MomentKV correction: each rank compacts its
    # own heads into its own head-pages of the same blocks.
    "snapkv-head-pages": (
        4, {"policy": "snapkv", **EVICTION, "storage": "head_pages", "moment_correction": True}
    ),
}
ENGINE_TIMEOUT_S = 600


def _page_bytes(model_dir: str, tp: int) -> int:
    """One block of one rank: K and V, all layers, this rank's KV heads, fp32."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    kv_heads = max(1, config["num_key_value_heads"] // tp)  # replicated below one per rank
    return 2 * config["num_hidden_layers"] * kv_heads * BLOCK_SIZE * config["head_dim"] * 4


def run_engine(model_dirs: dict[str, str], tp: int, prompts: list[list[int]], out_dir: str) -> dict:
    """One engine per case, in turn; greedy token ids, top-2 logprob gaps, stats."""
    from vllm import LLM, SamplingParams

    results = {}
    for name, (_, eviction) in CASES.items():
        model_dir = model_dirs[name]
        stats_path = Path(out_dir) / f"stats-{name}-tp{tp}.json"
        os.environ["KVEVICT_STATS_PATH"] = str(stats_path)  # inherited by the engine core
        start = time.monotonic()
        llm = LLM(
            model_dir,
            tensor_parallel_size=tp,
            # TP=2: each rank in a process of its own, bound to its core there;
            # TP=1: the worker in this process (no third import of vLLM), bound
            # to the worker's core by vLLM's CPU worker as it starts.
            distributed_executor_backend="mp" if tp > 1 else "uni",
            dtype="float32",
            max_model_len=4096,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=512,
            max_num_seqs=8,
            enforce_eager=True,
            seed=0,
            # The same number of blocks per rank at either TP: identical scheduling.
            kv_cache_memory_bytes=POOL_BLOCKS * _page_bytes(model_dir, tp) + 4096,
            additional_config={"kv_eviction": eviction},
        )
        started = time.monotonic()
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2),
        )
        generated = time.monotonic()
        time.sleep(1.0)  # the workers publish once they have seen the requests finish
        from prometheus_client import REGISTRY, generate_latest

        exposition = generate_latest(REGISTRY).decode()
        llm.llm_engine.engine_core.shutdown()
        del llm
        tokens, gaps = [], []
        for out in outputs:
            completion = out.outputs[0]
            tokens.append(list(completion.token_ids))
            gaps.append([])
            for logprobs in completion.logprobs:
                ranked = sorted(logprobs.values(), key=lambda lp: lp.rank)
                gaps[-1].append(ranked[0].logprob - ranked[1].logprob)
        results[name] = {
            "tokens": tokens,
            "top2_gaps": gaps,
            "stats": json.loads(stats_path.read_text()),
            "metrics": exposition,
            "startup_s": started - start,
            "generate_s": generated - started,
        }
    return results


def _run_in_subprocess(
    model_dirs: dict[str, str], tp: int, prompts: list[list[int]], work: Path
) -> dict:
    request = work / f"request-tp{tp}.json"
    result = work / f"result-tp{tp}.json"
    request.write_text(json.dumps({"model_dirs": model_dirs, "tp": tp, "prompts": prompts,
                                   "out_dir": str(work), "result": str(result)}))
    env = dict(
        os.environ,
        PYTHONSAFEPATH="1",  # the repo's triton_kernels/ must not shadow vLLM's
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core in this process: one import less
    )
    if tp > 1:
        from helpers import ranks_binding

        env["VLLM_CPU_OMP_THREADS_BIND"] = ranks_binding(tp)
    log = work / f"engine-tp{tp}.log"
    with open(log, "w") as handle:
        proc = subprocess.run([sys.executable, __file__, str(request)], env=env,
                              stdout=handle, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-60:])
        pytest.fail(f"TP={tp} engine exited with {proc.returncode}; log tail:\n{tail}")
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_kvevict.evaluation.tasks import needle_prompt
    from tiny_model import fetch_tiny_model

    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism 2 on CPU needs two cores")
    model_dirs = {
        name: str(fetch_tiny_model(num_key_value_heads=kv_heads))
        for name, (kv_heads, _) in CASES.items()
    }
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["snapkv"])
    prompts = [
        tokenizer(needle_prompt(tokenizer, 31337 + n, target_tokens=n)).input_ids
        for n in PROMPT_TOKENS
    ]
    work = tmp_path_factory.mktemp("tensor_parallel")
    runs = {tp: _run_in_subprocess(model_dirs, tp, prompts, work) for tp in (1, 2)}
    for tp, run in runs.items():
        for name, result in run.items():
            print(f"\nTP={tp} {name}: startup {result['startup_s']:.1f}s, "
                  f"generate {result['generate_s']:.1f}s")
    return prompts, runs


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_tokens_equal_tp1(tp_runs, case):
    prompts, runs = tp_runs
    tp1, tp2 = runs[1][case], runs[2][case]

    for tp, run in ((1, tp1), (2, tp2)):
        # NaN logits: some rank read a block it had given back (poisoned by the
        # session's KVEVICT_POISON_FREED_BLOCKS=1) or uninitialised memory.
        assert all(math.isfinite(g) for request in run["top2_gaps"] for g in request), (
            f"{case}: NaN/inf logits at TP={tp}"
        )
    gaps = [g for request in tp1["top2_gaps"] for g in request]
    # How far TP=2's logits moved from TP=1's (while the tokens agree): the
    # reduction-order noise the gaps above must stay clear of.
    drift = 0.0
    for t1, t2, r1, r2 in zip(tp1["tokens"], tp2["tokens"], tp1["top2_gaps"], tp2["top2_gaps"]):
        for a, b, g1, g2 in zip(t1, t2, r1, r2):
            if a != b:
                break
            drift = max(drift, abs(g1 - g2))
    print(f"\n{case}: TP=1 top1-top2 logit gap over {len(gaps)} generated tokens: median "
          f"{statistics.median(gaps):.3f}, min {min(gaps):.4f}; largest |gap TP=1 - gap TP=2| "
          f"{drift:.2e}")

    for i, (ids1, ids2) in enumerate(zip(tp1["tokens"], tp2["tokens"])):
        assert len(ids1) == len(ids2) == MAX_TOKENS
        if ids1 != ids2:
            first = next(k for k, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
            pytest.fail(
                f"{case}, prompt of {len(prompts[i])} tokens: TP=2 diverges from TP=1 at "
                f"output token {first} (TP=1 top1-top2 gap there "
                f"{tp1['top2_gaps'][i][first]:.4f}): {ids1[first:first + 8]} vs "
                f"{ids2[first:first + 8]}"
            )


@pytest.mark.parametrize("case", list(CASES))
def test_metrics_at_both_tp(tp_runs, case):
    """Each rank reports its side buffers; evictions are counted once, as at TP=1."""
    from helpers import kvevict_samples  # not at the top: this file also runs as a script

    _, runs = tp_runs
    by_tp = {tp: kvevict_samples(runs[tp][case]["metrics"]) for tp in (1, 2)}
    for tp, samples in by_tp.items():
        ranks = {dict(labels).get("rank") for name, labels in samples
                 if name == "kvevict_side_buffer_bytes"}
        assert ranks == {str(r) for r in range(tp)}, (tp, ranks)

    def value(samples, name):
        return sum(v for (n, _), v in samples.items() if n == name)

    for name in ("kvevict_eviction_events_total", "kvevict_blocks_freed_total"):
        assert value(by_tp[1], name) == value(by_tp[2], name) > 0, name
    # Each rank observes its own heads: all of them, or each a replica of one.
    kv_heads = CASES[case][0]
    per_rank = max(1, kv_heads // 2)
    assert value(by_tp[2], "kvevict_head_retained_tokens_count") == (
        value(by_tp[1], "kvevict_head_retained_tokens_count") * 2 * per_rank // kv_heads
    )


@pytest.mark.parametrize("case", list(CASES))
def test_eviction_happened_at_both_tp(tp_runs, case):
    """Blocks were freed during prefill and during decode, on the same schedule."""
    prompts, runs = tp_runs
    traces = {}
    for tp in (1, 2):
        stats = runs[tp][case]["stats"]
        assert stats["num_blocks"] == POOL_BLOCKS
        assert stats["blocks_freed_by_eviction"] > 0
        assert stats["blocks_held"] == 0
        traces[tp] = sorted(
            (r["prompt_len"], r["free_points"]) for r in stats["recent_requests"]
        )
    assert traces[1] == traces[2]
    longest = max(len(p) for p in prompts)
    prompt_len, free_points = traces[1][-1]
    assert prompt_len == longest
    assert any(n <= prompt_len for n in free_points), free_points  # prefill
    assert any(n > prompt_len for n in free_points), free_points  # decode


def _main(request_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    result = run_engine(request["model_dirs"], request["tp"], request["prompts"],
                        request["out_dir"])
    Path(request["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
