"""Eviction with prefix caching (``prefix_caching: shared``) through a real
`vllm serve`: requests that share a system prompt find it in vLLM's prefix
cache, hold it once, and evict only what follows it.

Two servers with a protected prefix of up to 1,024 tokens, in the suite's
poison mode (every block returned to the pool filled with NaN): the head_pages
tests' settings (budget 512, AdaKV + SnapKV, the MomentKV correction; our
kernel reads the prefix from the block table), and the slots tests' (SnapKV;
vLLM's kernel reads the prefix and the retained tokens through a block table
without the freed blocks between them).
Requests run one at a time where their tokens are compared with the
reference decoder, which applies the same protection to the whole prompt
(it has no prefix cache): the cache's copy of the prefix must be the one the
reference computes, and the protected tokens must never be evicted.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import _shared_server
from helpers import HEAD_PAGES_SERVER_CONFIG, SNAPKV_SERVER_CONFIG, needle_prompt

pytestmark = pytest.mark.e2e

PREFIX_OPTIONS = {"prefix_caching": "shared", "max_protected_prefix_tokens": 1024}
PREFIX_CONFIG = {**HEAD_PAGES_SERVER_CONFIG, **PREFIX_OPTIONS}
SLOTS_PREFIX_CONFIG = {**SNAPKV_SERVER_CONFIG, **PREFIX_OPTIONS}
PREFIX = 1024  # tokens of the shared system prompt, all protected (whole blocks)
BLOCK = 32
MAX_TOKENS = 40
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def prefix_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    yield from _shared_server(model_dir, tmp_path_factory, "prefix_server", PREFIX_CONFIG)


@pytest.fixture(scope="module")
def slots_prefix_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    yield from _shared_server(model_dir, tmp_path_factory, "slots_prefix_server", SLOTS_PREFIX_CONFIG)


def _reference(model_dir: str, config: dict):
    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    return ReferenceEvictingDecoder(model_dir, build_config(config), block_size=BLOCK, chunk_size=512)


@pytest.fixture(scope="module")
def reference(model_dir: str):
    return _reference(model_dir, PREFIX_CONFIG)


@pytest.fixture(scope="module")
def system_prompt(tokenizer) -> list[int]:
    text = (
        "You are a meticulous archivist. Every document below comes from the same archive; "
        "answer questions about it exactly, quoting numbers digit by digit. "
    ) + " ".join(f"Shelf {i} holds the ledgers of year {1700 + i}, bound in {['red', 'green', 'blue'][i % 3]} leather." for i in range(200))
    ids = tokenizer(text).input_ids
    assert len(ids) >= PREFIX
    return ids[:PREFIX]


def _document(tokenizer, key: int) -> list[int]:
    return tokenizer(needle_prompt(tokenizer, key, target_tokens=1000)).input_ids


def _complete(server, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    reply = requests.post(
        server.url + "/v1/completions",
        json={
            "model": "smollm2", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
        },
        timeout=600,
    )
    assert reply.status_code == 200, reply.text
    return list(reply.json()["choices"][0]["token_ids"])


@pytest.mark.parametrize("server_name", ["prefix_server", "slots_prefix_server"])
def test_shared_prefix_is_hit_protected_and_unaltered(server_name, request, model_dir, system_prompt, tokenizer):
    """Two requests with the same 1,024-token system prompt and different
    ~1k-token documents: the second finds the prompt in the cache (vLLM's
    hit counter rises by exactly its 1,024 tokens); both equal the reference
    decoder with the same protection. A third request, the first's again
    after both finished, still hits and repeats the first's tokens: neither
    request's compaction wrote into the cached prefix."""
    prefix_server = request.getfixturevalue(server_name)
    reference = (
        request.getfixturevalue("reference") if server_name == "prefix_server"
        else _reference(model_dir, SLOTS_PREFIX_CONFIG)
    )
    first = system_prompt + _document(tokenizer, 40961)
    second = system_prompt + _document(tokenizer, 73313)
    assert reference.schedule.protected_prefix(len(first)) == PREFIX

    hits = [prefix_server.metric(HITS)]
    admitted = prefix_server.stats()["requests_admitted"]
    served_first = _complete(prefix_server, first)
    hits.append(prefix_server.metric(HITS))
    served_second = _complete(prefix_server, second)
    hits.append(prefix_server.metric(HITS))
    served_again = _complete(prefix_server, first)
    hits.append(prefix_server.metric(HITS))

    assert [b - a for a, b in zip(hits, hits[1:])] == [0, PREFIX, PREFIX]
    assert served_first == reference.generate(first, MAX_TOKENS)
    assert served_second == reference.generate(second, MAX_TOKENS)
    assert served_again == served_first
    stats, workers = prefix_server.wait_idle()
    assert stats["requests_admitted"] == admitted + 3  # those that found the prefix too
    assert stats["blocks_freed_by_eviction"] > 0
    assert workers[0]["nan_outputs"] == 0 and workers[0]["blocks_poisoned"] > 0


def test_concurrent_requests_hold_the_prefix_once(prefix_server, reference, system_prompt, tokenizer):
    """Four requests sharing the system prompt at once, one of them dropped
    by its client mid-decode: while they run the scheduler counts the
    prefix's 32 blocks once and each request keeps at most its prefix plus
    its own budget; afterwards every block is back in the pool, nothing read
    NaN, and a later request on the same prefix still equals the reference.
    (Preemption with a cached prefix: test_preemption.py, head_pages_prefix.)"""
    keys = (11117, 22229, 33331, 44449)
    prompts = [system_prompt + _document(tokenizer, key) for key in keys]
    admitted = prefix_server.stats()["requests_admitted"]
    samples: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                samples.append(prefix_server.stats())
            except (OSError, ValueError):
                pass
            time.sleep(0.2)

    def drop_mid_decode(prompt_ids: list[int]) -> None:
        response = requests.post(
            prefix_server.url + "/v1/completions",
            json={"model": "smollm2", "prompt": prompt_ids, "max_tokens": 200, "temperature": 0,
                  "ignore_eos": True, "stream": True},
            stream=True, timeout=600,
        )
        events = 0
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                events += 1
                if events >= 20:
                    break
        response.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=_complete, args=(prefix_server, p, 80)) for p in prompts[:-1]]
    threads.append(threading.Thread(target=drop_mid_decode, args=(prompts[-1],)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()

    together = [s for s in samples if s["live_requests"] >= 2]
    assert together, "the requests never ran at the same time"
    assert max(s["protected_prefix_blocks"] for s in together) == PREFIX // BLOCK
    stats, workers = prefix_server.wait_idle()
    assert stats["blocks_held"] == 0 and stats["protected_prefix_blocks"] == 0
    assert stats["requests_admitted"] == admitted + len(prompts)
    # After its last eviction a request keeps the prefix and, after it, its
    # budget plus less than a block and a decode interval.
    finished = [t for t in stats["recent_requests"] if t["tokens"] > t["prompt_len"]][-len(prompts):]
    assert all(t["retained"] <= PREFIX + 512 + 2 * BLOCK for t in finished), finished
    assert workers[0]["nan_outputs"] == 0
    later = system_prompt + _document(tokenizer, 88883)
    assert _complete(prefix_server, later) == reference.generate(later, MAX_TOKENS)
