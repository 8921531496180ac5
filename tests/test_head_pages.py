"""Per-head page tables through a real `vllm serve`: AdaKV budgets + SnapKV
scores + the MomentKV correction, on the default model.

One server (budget 512, head_budget adaptive, moment_correction on, in the
suite's poison mode) shared by the tests here.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from helpers import HEAD_PAGES_SERVER_CONFIG, needle_prompt

pytestmark = pytest.mark.e2e

HEAD_PAGES_CONFIG = HEAD_PAGES_SERVER_CONFIG  # the shared head_pages_server's (conftest.py)
POOL_BLOCKS = 160  # the shared server's pool (conftest.SERVER_POOL_BLOCKS)
BLOCK = 32


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600)


def _complete(server, prompt, max_tokens: int) -> list[int]:
    reply = _client(server).completions.create(
        model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(reply.choices[0].token_ids)


def test_greedy_output_equals_reference_decoder(head_pages_server, model_dir, tokenizer):
    """Served tokens equal the transformers reference applying the same
    per-head allocation and the MomentKV correction (computed there from the
    evicted tokens themselves), across the end-of-prompt eviction and decode
    evictions."""
    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    prompt_ids = tokenizer(needle_prompt(tokenizer, 55555, target_tokens=1700)).input_ids
    served = _complete(head_pages_server, prompt_ids, 72)
    reference = ReferenceEvictingDecoder(
        model_dir, build_config(HEAD_PAGES_CONFIG), block_size=BLOCK, chunk_size=512
    ).generate(prompt_ids, 72)
    assert served[:32] == reference[:32]
    assert served == reference


def test_heads_hold_different_lengths_and_blocks_follow_their_sum(head_pages_server, tokenizer):
    """After its last compaction, the heads of one layer hold different
    numbers of tokens, whole pages that together fill exactly the blocks
    between the frontier and the eviction point; the blocks the scheduler
    counts for the request equal those pages over H plus its standard region."""
    prompt = needle_prompt(tokenizer, 31415, target_tokens=2900)
    prompt_len = len(tokenizer(prompt).input_ids)
    max_tokens = 48  # the last step (token 47 of decode) crosses no eviction point
    _complete(head_pages_server, prompt, max_tokens)
    time.sleep(0.5)
    worker = head_pages_server.worker_stats()
    record = worker["recent_requests"][-1]
    manager = head_pages_server.stats()["recent_requests"][-1]
    assert manager["prompt_len"] == prompt_len
    point, frontier, tokens = record["point"], record["frontier"], record["tokens"]
    assert tokens == prompt_len + max_tokens - 1
    assert point == prompt_len + 32  # the decode eviction after 32 steps
    compacted_blocks = point // BLOCK - frontier // BLOCK
    head_lens = record["head_lens"]
    num_heads = len(head_lens[0])
    differing_layers = 0
    for lens in head_lens:
        pages = [-(-n // BLOCK) for n in lens]
        assert all(n % BLOCK == 0 for n in lens), lens
        assert sum(pages) == num_heads * compacted_blocks, (lens, compacted_blocks)
        # AdaKV's floor (20% of an equal share), rounded up to whole pages
        floor = int(compacted_blocks * BLOCK * 0.2)
        assert min(lens) >= -(-floor // BLOCK) * BLOCK, lens
        differing_layers += len(set(lens)) > 1
    assert differing_layers >= len(head_lens) // 2, head_lens
    standard_blocks = -(-tokens // BLOCK) - point // BLOCK
    assert manager["blocks"] == compacted_blocks + standard_blocks


def test_concurrent_requests_read_no_freed_page_and_leak_nothing(head_pages_server, tokenizer):
    """Six ~1.5k-token prompts (more than the pool) at once, with freed blocks
    and unreferenced head-pages filled with NaN: every request finds its
    needle or at least completes, no attention output reads NaN, and the pool
    and side-buffer rows return to idle."""
    keys = [13579, 24680, 31415, 27182, 16180, 14142]
    prompts = [needle_prompt(tokenizer, k, 1500, 0.2 + 0.1 * i) for i, k in enumerate(keys)]
    assert sum(len(tokenizer(p).input_ids) for p in prompts) > POOL_BLOCKS * BLOCK
    api = _client(head_pages_server)

    def run(prompt: str) -> str:
        reply = api.completions.create(
            model="smollm2", prompt=prompt, max_tokens=40, temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(run, prompts))
    assert sum(str(k) in t for k, t in zip(keys, texts)) >= 5, texts
    stats, workers = head_pages_server.wait_idle()
    assert stats["blocks_held"] == 0
    assert workers[0]["rows_in_use"] == 0
    assert workers[0]["nan_outputs"] == 0
    assert workers[0]["blocks_poisoned"] > 0
