"""End to end through the offline ``LLM(..., additional_config={"kv_eviction": ...})``.

StreamingLLM evicting after every prefill chunk, with a KV pool of 64 blocks
(2,048 tokens): smaller than one ~2.9k-token prompt, which must be served anyway.
"""

from __future__ import annotations

import os

import pytest

from helpers import kvevict_samples, needle_prompt
from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES

pytestmark = pytest.mark.e2e

POOL_BLOCKS = 64


@pytest.fixture(scope="module")
def streaming_llm(model_dir, tmp_path_factory):
    from vllm import LLM

    stats_path = tmp_path_factory.mktemp("offline") / "stats.json"
    os.environ["KVEVICT_STATS_PATH"] = str(stats_path)  # inherited by the engine process
    llm = LLM(
        model_dir,
        dtype="float32",
        max_model_len=4096,
        block_size=32,
        max_num_batched_tokens=512,
        max_num_seqs=4,
        enforce_eager=True,
        kv_cache_memory_bytes=POOL_BLOCKS * DEFAULT_MODEL_BLOCK_BYTES + 4096,
        additional_config={"kv_eviction": {"policy": "streamingllm", "budget": 512}},
    )
    yield llm, stats_path
    del os.environ["KVEVICT_STATS_PATH"]
    llm.llm_engine.engine_core.shutdown()


def _stats(stats_path) -> dict:
    import json

    return json.loads(stats_path.read_text())


def test_prompt_longer_than_kv_pool_is_served(streaming_llm, tokenizer):
    from vllm import SamplingParams

    llm, stats_path = streaming_llm
    admitted_beyond = _exported("kvevict_requests_admitted_beyond_memory_total")
    prompt = needle_prompt(tokenizer, 71432)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    num_tokens = len(out[0].prompt_token_ids) + 16
    stats = _stats(stats_path)
    assert num_tokens > stats["num_blocks"] * 32  # the full context does not fit
    assert len(out[0].outputs[0].token_ids) == 16
    assert stats["blocks_freed_by_eviction"] >= (num_tokens - 512 - 2 * 512) // 32
    assert stats["blocks_held"] == 0
    assert stats["free_blocks"] == stats["num_blocks"] - 1
    # Its prompt alone (~2.9k tokens, 91 blocks) exceeds the 63 free blocks:
    # without eviction vLLM would never have admitted it.
    assert _exported("kvevict_requests_admitted_beyond_memory_total") == admitted_beyond + 1


def _exported(name: str) -> float:
    """A kvevict_ series as this process's Prometheus registry serves it."""
    from prometheus_client import REGISTRY, generate_latest

    samples = kvevict_samples(generate_latest(REGISTRY).decode())
    return sum(value for (sample, _), value in samples.items() if sample == name)


def test_snapkv_finds_needle_streamingllm_does_not(streaming_llm, snapkv_server, tokenizer):
    """At a 512-token budget, SnapKV (served) retrieves a mid-prompt needle in
    ~2k tokens; StreamingLLM (sinks + recent tokens) cannot have kept it."""
    from openai import OpenAI
    from vllm import SamplingParams

    llm, _ = streaming_llm
    keys = [71432, 28415, 90357]
    prompts = [needle_prompt(tokenizer, k, 2000, d) for k, d in zip(keys, (0.4, 0.5, 0.6))]
    streaming = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    api = OpenAI(base_url=snapkv_server.url + "/v1", api_key="unused", timeout=600)
    snapkv = [
        api.completions.create(model="smollm2", prompt=p, max_tokens=8, temperature=0)
        .choices[0].text
        for p in prompts
    ]
    assert all(str(k) in t for k, t in zip(keys, snapkv)), snapkv
    assert not any(str(k) in o.outputs[0].text for k, o in zip(keys, streaming))


def test_greedy_output_equals_reference_decoder_per_chunk(streaming_llm, model_dir, tokenizer):
    """Evicting after each of four 512-token prefill chunks and every 32 decode
    steps, vLLM's greedy tokens equal the transformers reference's."""
    from vllm import SamplingParams

    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    llm, _ = streaming_llm
    prompt_ids = tokenizer(needle_prompt(tokenizer, 12345, target_tokens=2000)).input_ids
    out = llm.generate(
        [{"prompt_token_ids": prompt_ids}],
        SamplingParams(max_tokens=72, temperature=0, ignore_eos=True),
    )
    served = list(out[0].outputs[0].token_ids)
    reference = ReferenceEvictingDecoder(
        model_dir, build_config({"policy": "streamingllm", "budget": 512}),
        block_size=32, chunk_size=512,
    ).generate(prompt_ids, 72)
    assert served[:32] == reference[:32]
    assert served == reference


def test_prefill_modes_hold_different_memory_and_evict_where_promised(
    streaming_llm, snapkv_server, tokenizer
):
    """Same prompt, 512-token chunks, budget 512: per_chunk (offline engine)
    frees blocks at every chunk end once past the budget and never holds more
    than its admission cap; end_of_prompt (server) frees nothing before the
    prompt is complete, having held all of it."""
    from openai import OpenAI
    from vllm import SamplingParams

    llm, stats_path = streaming_llm
    prompt = needle_prompt(tokenizer, 24680, target_tokens=2900)
    prompt_len = len(tokenizer(prompt).input_ids)
    prompt_blocks = -(-prompt_len // 32)
    chunk_ends = list(range(512, prompt_len, 512)) + [prompt_len]

    llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stats = _stats(stats_path)
    per_chunk = stats["recent_requests"][-1]
    assert per_chunk["prompt_len"] == prompt_len
    prefill_frees = [n for n in per_chunk["free_points"] if n <= prompt_len]
    assert prefill_frees == [n for n in chunk_ends if n >= 1024]
    assert per_chunk["free_points"][len(prefill_frees):] == [prompt_len + 32]
    assert per_chunk["peak_blocks"] <= stats["max_admission_blocks_per_request"] < prompt_blocks

    api = OpenAI(base_url=snapkv_server.url + "/v1", api_key="unused", timeout=600)
    api.completions.create(
        model="smollm2", prompt=prompt, max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True},
    )
    end_of_prompt = [
        r for r in snapkv_server.stats()["recent_requests"] if r["prompt_len"] == prompt_len
    ][-1]
    assert end_of_prompt["free_points"] == [prompt_len, prompt_len + 32]
    assert end_of_prompt["peak_blocks"] >= prompt_blocks
    assert per_chunk["peak_blocks"] < end_of_prompt["peak_blocks"] / 2


def test_readme_offline_snippet_runs_as_printed(tmp_path):
    """The README's offline example, saved as a script and run as it stands:
    vLLM's engine processes re-import it, it sizes the CPU's KV pool, the
    plugin serves its settings (the scheduler's stats record the request)."""
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    after = readme[readme.index("Offline, the same settings go through `additional_config`"):]
    snippet = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    script = tmp_path / "offline.py"
    script.write_text(snippet)
    stats = tmp_path / "stats.json"
    env = dict(os.environ, PYTHONSAFEPATH="1", KVEVICT_STATS_PATH=str(stats))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the script's one print (vLLM's own log lines on stdout follow it)
    assert any(line.lstrip().startswith("Paris") for line in proc.stdout.splitlines()), proc.stdout[-2000:]
    assert json.loads(stats.read_text())["requests_admitted"] == 1
