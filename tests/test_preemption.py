"""Preemption and load independence, end to end through the offline ``LLM``.

vLLM admits a request only when the blocks it may still need are free, and an
evicting request never holds more than its admission cap, so a request admitted
with its whole prompt and cap reserved is never preempted. Requests with short
prompts and long outputs are admitted on their (small) prompts and then grow
to the eviction budget while decoding: six of them in a pool of 36 blocks run
out of blocks and vLLM preempts (recompute mode: all blocks freed, the request
restarts from token 0 with its generated tokens as part of the recomputed
prefix). The recomputed request
must evict exactly as before, so its greedy output equals the output of the
same request run alone, which in turn equals the transformers reference.

A recomputed prefix, and a prompt chunk that shares the scheduler's 256-token
step budget with other requests, cross several eviction points in one step:
the worker evicts inside the pass and recomputes the attention of the tokens
after each point.
"""

from __future__ import annotations

import json
import os

import pytest

from helpers import needle_prompt
from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES

pytestmark = pytest.mark.e2e

POOL_BLOCKS = 36  # 1,152 tokens; each request holds ~10 blocks while decoding
CHUNK = 256
EVICTION = {
    "policy": "snapkv",
    "budget": 256,
    "decode_interval": 16,
    "prefill_mode": "per_chunk",
    "prefill_interval": CHUNK,
    "policy_options": {"kernel_size": 15},
}
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def small_pool_llm(model_dir, tmp_path_factory):
    from vllm import LLM

    stats_path = tmp_path_factory.mktemp("preemption") / "stats.json"
    os.environ["KVEVICT_STATS_PATH"] = str(stats_path)
    llm = LLM(
        model_dir,
        dtype="float32",
        max_model_len=4096,
        block_size=32,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        enforce_eager=True,
        disable_log_stats=False,
        kv_cache_memory_bytes=POOL_BLOCKS * DEFAULT_MODEL_BLOCK_BYTES + 4096,
        additional_config={"kv_eviction": EVICTION},
    )
    yield llm, stats_path
    del os.environ["KVEVICT_STATS_PATH"]
    llm.llm_engine.engine_core.shutdown()


def _preemptions(llm) -> int:
    return int(
        sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    )


def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_preempted_requests_evict_as_before(small_pool_llm, tokenizer, model_dir):
    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    llm, stats_path = small_pool_llm
    import random

    rng = random.Random()
    prompts = [
        tokenizer(
            needle_prompt(tokenizer, rng.randint(10000, 99999), target_tokens=t, depth=rng.random())
        ).input_ids
        for t in (120, 200, 350, 520, 650, 180)
    ]

    alone = []
    for prompt in prompts:
        before = _preemptions(llm)
        alone.extend(_generate(llm, [prompt]))
        assert _preemptions(llm) == before, "a request alone must fit the pool"

    before = _preemptions(llm)
    together = _generate(llm, prompts)
    assert _preemptions(llm) > before, "the load was meant to force preemption"
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t == a, f"request {i}: output changed under preemption"

    stats = json.loads(stats_path.read_text())
    assert stats["live_requests"] == 0
    assert stats["free_blocks"] == stats["num_blocks"] - 1, "blocks leaked"
    assert stats["blocks_freed_by_eviction"] > 0

    # The run alone is itself right: the independent reference decoder, cutting
    # its steps at the same eviction points, produces the same tokens.
    reference = ReferenceEvictingDecoder(model_dir, build_config(EVICTION), block_size=32)
    assert reference.generate(prompts[0], MAX_TOKENS) == alone[0]
