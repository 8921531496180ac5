"""Every policy beyond the two with their own suites, through vLLM: greedy
tokens equal the transformers reference decoder applying the same policy
(prefill chunks of 512, the policy's default prefill mode, decode evictions
every 32 steps), on the default model, in the suite's NaN-poison mode.

One offline engine per policy, one after the other in this process.
"""

from __future__ import annotations

import pytest

from helpers import needle_prompt
from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES

pytestmark = pytest.mark.e2e

CASES = {
    "keydiff": {"policy": "keydiff", "budget": 512},
    "keydiff-adaptive": {"policy": "keydiff", "budget": 512, "head_budget": "adaptive"},
    "knorm": {"policy": "knorm", "budget": 512},
    "tova": {"policy": "tova", "budget": 512},
    "momentkv": {"policy": "momentkv", "budget": 256, "head_budget": "adaptive"},
    "momentkv-diagonal": {
        "policy": "momentkv", "budget": 256, "head_budget": "adaptive", "moment_covariance": "diagonal",
    },
    "momentkv-zeroth-order": {"policy": "momentkv", "budget": 256, "moment_covariance": "none"},
    # Needs the layer's rotary frequencies (read from vLLM's rotary_emb).
    "expected_attention": {"policy": "expected_attention", "budget": 512},
    # Needs the layer's output projection (read through o_proj's quant method)
    # and, on its default base (Expected Attention), the rotary frequencies.
    "criticalkv-adaptive": {"policy": "criticalkv", "budget": 512, "head_budget": "adaptive"},
    "h2o": {"policy": "h2o", "budget": 512},
    # Layer budgets falling with depth: every layer ranked after the last one,
    # in the pool of every layer's blocks, with each layer's own queries (at
    # the prompt's end and at the decode evictions; per_chunk: also mid-prompt,
    # the window partly from earlier steps).
    "pyramidkv": {"policy": "pyramidkv", "budget": 256},
    "pyramidkv-per-chunk": {"policy": "pyramidkv", "budget": 256, "prefill_mode": "per_chunk"},
    "random": {"policy": "random", "budget": 512},
    # Gates shipped for the default model; one ranking over every layer and
    # head (eager here, compiled in test_learned_e2e.py).
    "learned": {"policy": "learned", "budget": 256},
}


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(needle_prompt(tokenizer, 55555, target_tokens=1700)).input_ids


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_reference_decoder(case, model_dir, prompt_ids):
    from vllm import LLM, SamplingParams

    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    eviction = CASES[case]
    llm = LLM(
        model_dir, dtype="float32", max_model_len=4096, block_size=32, enforce_eager=True,
        max_num_batched_tokens=512, max_num_seqs=4,
        kv_cache_memory_bytes=160 * DEFAULT_MODEL_BLOCK_BYTES + 4096,
        additional_config={"kv_eviction": eviction},
    )
    try:
        out = llm.generate(
            [{"prompt_token_ids": prompt_ids}],
            SamplingParams(max_tokens=72, temperature=0, ignore_eos=True),
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    served = list(out[0].outputs[0].token_ids)
    reference = ReferenceEvictingDecoder(
        model_dir, build_config(eviction), block_size=32, chunk_size=512
    ).generate(prompt_ids, 72)
    assert served[:32] == reference[:32]
    assert served == reference
