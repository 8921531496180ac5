"""End to end through a real `vllm serve --kv-eviction snapkv` (budget 512).

The server's KV pool holds 160 blocks (5,120 tokens); each prompt here is
~2,900 tokens, so a few concurrent requests exceed the pool.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from helpers import SNAPKV_SERVER_CONFIG, engine_cores, kvevict_samples, needle_prompt

pytestmark = pytest.mark.e2e


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600)


def steady_sample(server, tries: int = 20) -> tuple[dict, float] | None:
    """The manager's counters and vLLM's kv_cache_usage gauge taken together.

    The two come from different processes and the client may lag the server,
    so read gauge, counters, gauge, and keep the sample only when the gauge did
    not move in between and the request is still live.
    """
    for _ in range(tries):
        time.sleep(0.05)  # let vLLM's stat logger publish the current step
        before = server.metric("vllm:kv_cache_usage_perc")
        stats = server.stats()
        after = server.metric("vllm:kv_cache_usage_perc")
        if before == after and stats["live_requests"] == 1:
            return stats, after
    return None


def test_completions_find_needle_and_free_blocks_while_running(snapkv_server, tokenizer):
    """A ~2.9k-token needle prompt is answered, and the request's blocks go
    back to the pool while it still streams (manager counters and vLLM's own
    kv_cache_usage gauge)."""
    api = client(snapkv_server)
    before = snapkv_server.stats()["blocks_freed_by_eviction"]
    prompt = needle_prompt(tokenizer, 71432)
    prompt_blocks = -(-len(tokenizer(prompt).input_ids) // 32)
    stream = api.completions.create(
        model="smollm2", prompt=prompt, max_tokens=160, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    text, mid_stream = "", None
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text
        if i == 24 and mid_stream is None:
            mid_stream = steady_sample(snapkv_server)
    assert "71432" in text
    assert mid_stream is not None, "no steady sample of the gauge while the request ran"
    stats, usage = mid_stream
    assert stats["live_requests"] == 1
    assert stats["blocks_freed_by_eviction"] > before
    # Held blocks mid-decode: budget + decode interval + one chunk, far below
    # the prompt's own size; vLLM's gauge agrees with the manager.
    assert stats["blocks_held"] < prompt_blocks / 2
    assert usage * (stats["num_blocks"] - 1) == pytest.approx(stats["blocks_held"], abs=1)

    completion = api.completions.create(
        model="smollm2", prompt=needle_prompt(tokenizer, 28415, depth=0.3), max_tokens=8,
        temperature=0,
    )
    assert "28415" in completion.choices[0].text


def test_chat_streaming_and_not(snapkv_server, tokenizer):
    api = client(snapkv_server)
    for key, stream in ((46208, False), (90357, True)):
        prompt = needle_prompt(tokenizer, key, target_tokens=1500)
        messages = [{"role": "user", "content": prompt.removesuffix(" The pass key is")}]
        if stream:
            chunks = api.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = api.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=24, temperature=0
            )
            text = reply.choices[0].message.content
        assert str(key) in text, text


def test_concurrent_requests_beyond_pool_complete_without_leak(snapkv_server, tokenizer):
    """Six ~1.5k-token requests (9k tokens of full context, pool 5,120 tokens)
    run concurrently; all complete and the pool returns to idle."""
    api = client(snapkv_server)
    keys = [13579, 24680, 31415, 27182, 16180, 14142]
    prompts = [needle_prompt(tokenizer, k, 1500, 0.2 + 0.1 * i) for i, k in enumerate(keys)]
    total_tokens = sum(len(tokenizer(p).input_ids) for p in prompts)
    assert total_tokens > snapkv_server.stats()["num_blocks"] * 32

    def run(prompt: str) -> str:
        reply = api.completions.create(
            model="smollm2", prompt=prompt, max_tokens=40, temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(run, prompts))
    assert all(len(t) > 0 for t in texts)
    assert sum(str(k) in t for k, t in zip(keys, texts)) >= 5
    time.sleep(1.0)
    stats = snapkv_server.stats()
    assert stats["live_requests"] == 0
    assert stats["blocks_held"] == 0
    assert stats["free_blocks"] == stats["num_blocks"] - 1
    assert snapkv_server.metric("vllm:kv_cache_usage_perc") == 0.0


def test_greedy_output_equals_reference_decoder(snapkv_server, model_dir, tokenizer):
    """vLLM with the plugin vs the transformers reference applying the same
    policy outside vLLM: same greedy tokens, across the end-of-prompt eviction
    and two decode-time evictions, with chunked prefill (512)."""
    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    prompt_ids = tokenizer(needle_prompt(tokenizer, 55555, target_tokens=1700)).input_ids
    api = client(snapkv_server)
    reply = api.completions.create(
        model="smollm2", prompt=prompt_ids, max_tokens=72, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    served = list(reply.choices[0].token_ids)
    reference = ReferenceEvictingDecoder(
        model_dir, build_config(SNAPKV_SERVER_CONFIG), block_size=32, chunk_size=512
    ).generate(prompt_ids, 72)
    assert served[:32] == reference[:32]
    assert served == reference


def test_engine_runs_on_the_workers_core(snapkv_server):
    """Under pytest-xdist the engine's compute (vLLM's worker process, every
    thread of it) runs on the core this worker's engines are given, not on the
    core vLLM picks for every engine of the machine by default."""
    import psutil

    cores = engine_cores()
    if cores is None:
        pytest.skip("run alone: vLLM binds its engine to the cores it chooses")
    workers = [p for p in psutil.Process(snapkv_server.process.pid).children(recursive=True)
               if p.name().startswith("VLLM::Worker")]
    assert len(workers) == 1, [(p.pid, p.name()) for p in workers]
    threads = {thread.id: os.sched_getaffinity(thread.id) for thread in workers[0].threads()}
    assert threads and all(allowed == cores for allowed in threads.values()), (cores, threads)


def test_start_up_log_names_the_settings_served(snapkv_server):
    """The worker logs, once, the settings it serves (the config's defaults
    resolved, the attention kernel chosen) in vLLM's log format; the kernel
    named there is the one kvevict_attention_kernel_info reports, and
    kvevict_config_info carries the same settings as labels."""
    from vllm_kvevict.config import build_config
    from vllm_kvevict.evaluation.server import scrape

    lines = [line for line in snapkv_server.log_path.read_text().splitlines() if "KV eviction: policy" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("(Worker pid=") and " INFO " in lines[0], lines[0]
    samples = kvevict_samples(scrape(snapkv_server.url))
    kernels = [dict(labels)["kernel"] for (name, labels), value in samples.items()
               if name == "kvevict_attention_kernel_info" and value == 1]
    assert kernels == ["vllm"], kernels
    config = build_config(SNAPKV_SERVER_CONFIG)
    assert lines[0].endswith("KV eviction: " + config.summary("vllm")), lines[0]
    # kvevict_config_info: the same settings as labels, once.
    infos = [(dict(labels), value) for (name, labels), value in samples.items() if name == "kvevict_config_info"]
    assert len(infos) == 1 and infos[0][1] == 1, infos
    labels = infos[0][0]
    assert {k: labels[k] for k in config.info_labels("vllm")} == config.info_labels("vllm")
    assert labels["policy"] == "snapkv" and labels["storage"] == "slots" and labels["budget"] == "512"
