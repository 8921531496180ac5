"""Aborts, disconnects and isolation against the shared `vllm serve --kv-eviction snapkv`.

SnapKV with slots storage, over HTTP; aborts and isolation with head pages and
pooled layers (and slots again, through the engine's own abort) are in
test_preemption.py.

The test session runs every engine with ``KVEVICT_POISON_FREED_BLOCKS=1``
(see conftest): each block the plugin returns to vLLM's pool is filled with
NaN, and every attention output is checked for NaN. A request that read a
block it no longer owns, or one another request wrote, would show it.
"""

from __future__ import annotations

import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from helpers import needle_prompt

pytestmark = pytest.mark.e2e


def _stream_then_drop(server, payload: dict, read_events: int, before_first: float | None = None):
    """Start a streaming completion and close the connection early.

    ``read_events`` server-sent events are read first; with ``before_first``
    the connection is closed that many seconds after the request was sent,
    before any token (the prompt is still being prefilled in chunks).
    """
    response = requests.post(
        server.url + "/v1/completions", json={**payload, "stream": True}, stream=True,
        timeout=600,
    )
    assert response.status_code == 200
    if before_first is not None:
        time.sleep(before_first)
        response.close()
        return 0
    events = 0
    for line in response.iter_lines():
        if line.startswith(b"data: {"):
            events += 1
            if events >= read_events:
                break
    response.close()
    return events


def _complete(server, prompt, **options) -> dict:
    response = requests.post(
        server.url + "/v1/completions",
        json={"model": "smollm2", "prompt": prompt, "temperature": 0, **options},
        timeout=600,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_aborts_and_early_stops_free_every_block_and_row(snapkv_server, tokenizer):
    server = snapkv_server
    server.wait_idle()
    rng = random.Random()
    long_prompt = needle_prompt(tokenizer, rng.randint(10000, 99999), target_tokens=1600)
    prompt_len = len(tokenizer(long_prompt).input_ids)
    expected = _complete(server, long_prompt, max_tokens=40, ignore_eos=True)
    before = server.stats()

    # A client that disconnects mid-stream, past the prompt's eviction.
    assert _stream_then_drop(
        server, {"model": "smollm2", "prompt": long_prompt, "max_tokens": 400}, read_events=5
    ) == 5
    # Cancelled while its ~1.6k-token prompt is prefilled in 512-token chunks
    # (1-2 s of prefill per chunk here).
    _stream_then_drop(
        server, {"model": "smollm2", "prompt": needle_prompt(tokenizer, 4242, 1600),
                 "max_tokens": 50}, read_events=0, before_first=1.5,
    )
    # Several at once, dropped at random points.
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(
            lambda n: _stream_then_drop(
                server, {"model": "smollm2", "prompt": needle_prompt(tokenizer, n, 1500),
                         "max_tokens": 200, "ignore_eos": True}, read_events=rng.randint(1, 40),
            ),
            [11111, 22222, 33333, 44444],
        ))
    # max_tokens reached between two decode eviction points (interval 32), and
    # a stop string.
    short = _complete(server, long_prompt, max_tokens=45, ignore_eos=True)
    assert short["usage"]["completion_tokens"] == 45
    # (the stop string: a word from the middle of the known greedy answer)
    text = expected["choices"][0]["text"]
    words = [w for w in text.split() if len(w) >= 3]
    stop = words[len(words) // 2]
    stopped = _complete(server, long_prompt, max_tokens=100, stop=[stop])
    assert stopped["choices"][0]["finish_reason"] == "stop", (stop, text, stopped["choices"])
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]

    stats, (worker,) = server.wait_idle(timeout=60)
    assert stats["requests_admitted"] >= before["requests_admitted"] + 8
    assert worker["rows_in_use"] == 0
    assert worker["nan_outputs"] == 0
    # Nothing the aborted requests left behind changes a later answer.
    again = _complete(server, long_prompt, max_tokens=40, ignore_eos=True)
    assert again["choices"][0]["text"] == expected["choices"][0]["text"]
    assert prompt_len > 2 * 512  # the prompt was evicted, not held whole


def test_concurrent_requests_read_only_their_own_blocks(snapkv_server, tokenizer):
    """24 requests, 8 at a time, in a pool smaller than their prompts (8 of
    them hold ~7.8k tokens on average, the pool 5,120): every
    block goes through several owners. With freed blocks poisoned, no output
    has NaN, every sampled token's logprob is finite, and each answer equals
    the one the same request gets alone."""
    server = snapkv_server
    rng = random.Random()
    keys = [rng.randint(10000, 99999) for _ in range(24)]
    prompts = [
        needle_prompt(tokenizer, k, target_tokens=rng.choice([300, 700, 1200, 1700]),
                      depth=rng.random())
        for k in keys
    ]
    options = {"max_tokens": 24, "ignore_eos": True, "logprobs": 1}
    before = server.worker_stats()
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _complete(server, p, **options), prompts))
    alone = [_complete(server, p, **options) for p in prompts[:6]]

    stats, (worker,) = server.wait_idle(timeout=60)
    assert worker["nan_outputs"] == 0
    assert worker["blocks_poisoned"] > before["blocks_poisoned"]
    for response in together:
        logprobs = response["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == 24 and all(math.isfinite(x) for x in logprobs)
    for a, t in zip(alone, together):
        assert t["choices"][0]["text"] == a["choices"][0]["text"]
    found = sum(str(k) in r["choices"][0]["text"] for k, r in zip(keys, together))
    assert found >= len(keys) // 2, json.dumps([r["choices"][0]["text"] for r in together])
