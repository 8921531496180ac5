"""`--kv-eviction learned` through vLLM, in compiled mode (the gate's custom
op inside vLLM's torch.compile graph), with the gates shipped for the default
model, in the suite's NaN-poison mode:

* greedy tokens equal the transformers reference decoder applying the same
  gates and the same global top-B;
* one ranking over every layer and KV head: the layers keep different
  numbers of tokens, in whole pages that fit the blocks the request holds;
* blocks go back to vLLM's pool, and nothing reads a returned block;
* requests batched together all complete.

One offline engine for the module.
"""

from __future__ import annotations

import json
import os

import pytest

from helpers import needle_prompt
from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES

pytestmark = pytest.mark.e2e

EVICTION = {"policy": "learned", "budget": 256}
BLOCK = 32


@pytest.fixture(scope="module")
def learned_llm(model_dir, tmp_path_factory):
    from vllm import LLM

    stats_path = tmp_path_factory.mktemp("learned") / "stats.json"
    os.environ["KVEVICT_STATS_PATH"] = str(stats_path)  # inherited by the engine process
    llm = LLM(
        model_dir, dtype="float32", max_model_len=4096, block_size=BLOCK, enforce_eager=False,
        max_num_batched_tokens=512, max_num_seqs=4,
        kv_cache_memory_bytes=160 * DEFAULT_MODEL_BLOCK_BYTES + 4096,
        additional_config={"kv_eviction": EVICTION},
    )
    try:
        yield llm, stats_path
    finally:
        del os.environ["KVEVICT_STATS_PATH"]
        llm.llm_engine.engine_core.shutdown()


def _worker_stats(stats_path) -> dict:
    return json.loads(open(f"{stats_path}.worker0").read())


def test_greedy_output_equals_reference_and_layers_keep_different_lengths(
    learned_llm, model_dir, tokenizer
):
    from vllm import SamplingParams

    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    llm, stats_path = learned_llm
    prompt_ids = tokenizer(needle_prompt(tokenizer, 48213, target_tokens=1700)).input_ids
    out = llm.generate(
        [{"prompt_token_ids": prompt_ids}],
        SamplingParams(max_tokens=72, temperature=0, ignore_eos=True),
    )
    served = list(out[0].outputs[0].token_ids)
    reference = ReferenceEvictingDecoder(
        model_dir, build_config(EVICTION), block_size=BLOCK, chunk_size=512
    ).generate(prompt_ids, 72)
    assert served == reference

    worker = _worker_stats(stats_path)
    assert worker["nan_outputs"] == 0
    assert worker["blocks_poisoned"] > 0
    last = worker["recent_requests"][-1]
    lens = last["head_lens"]  # [layer][head] after the request's last eviction
    assert len(lens) == 30 and all(len(heads) == 3 for heads in lens)
    per_layer = [sum(heads) for heads in lens]
    assert len(set(per_layer)) > 3, per_layer
    point, frontier = last["point"], last["frontier"]
    held_pages = 30 * 3 * (point // BLOCK - frontier // BLOCK)
    pages = sum(-(-n // BLOCK) for heads in lens for n in heads)
    assert pages <= held_pages
    # The request keeps its whole budget (every page it holds but part of the last ones).
    assert sum(per_layer) >= 30 * 3 * EVICTION["budget"]

    engine = json.loads(stats_path.read_text())
    assert engine["blocks_freed_by_eviction"] > 0
    request = engine["recent_requests"][-1]
    assert request["peak_blocks"] <= engine["max_admission_blocks_per_request"]


def test_batched_requests_complete_without_reading_returned_blocks(learned_llm, tokenizer):
    from vllm import SamplingParams

    llm, stats_path = learned_llm
    prompts = [
        tokenizer(needle_prompt(tokenizer, secret, target_tokens=length)).input_ids
        for secret, length in ((11111, 900), (22222, 2600), (33333, 1500))
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [48, 48, 48]
    assert _worker_stats(stats_path)["nan_outputs"] == 0
    engine = json.loads(stats_path.read_text())
    assert engine["live_requests"] == 0
    assert engine["blocks_held"] == 0
