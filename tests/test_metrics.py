"""Prometheus series: exported from the engine core and workers, served by the API server.

The end-to-end test runs a known workload through the shared
`vllm serve --kv-eviction snapkv` (budget 512, blocks of 32, evict every 32
decode steps, end_of_prompt) and checks each series against values computed
here from the storage rule, independently of the plugin's code.
"""

from __future__ import annotations

import random
import time

import pytest
import requests
from helpers import kvevict_samples, needle_prompt
from vllm_kvevict.metrics import METRIC_NAMES, ENGINE_METRICS, ExportedMetricsCollector, ProcessMetrics

BUDGET, BLOCK, INTERVAL = 512, 32, 32
NUM_LAYERS, NUM_KV_HEADS = 30, 3


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """All kvevict_ samples of /metrics, keyed by (name, sorted labels)."""
    return kvevict_samples(requests.get(url + "/metrics", timeout=10).text)


def total(samples: dict, name: str, **where: str) -> float:
    return sum(
        v for (n, labels), v in samples.items()
        if n == name and all(dict(labels).get(k) == w for k, w in where.items())
    )


def frontier(n: int, prompt_len: int) -> int:
    """end_of_prompt storage rule, written out: last point P, F = floor((P - B) / bs) * bs."""
    if n < prompt_len:
        return 0
    point = prompt_len + (n - prompt_len) // INTERVAL * INTERVAL
    return max(0, (point - BUDGET) // BLOCK) * BLOCK


def expected_request(prompt_len: int, max_tokens: int) -> tuple[int, int]:
    """(blocks freed while it ran, evictions that dropped tokens) for one request alone.

    The last sampled token is never fed back, so the request processes
    prompt_len + max_tokens - 1 tokens; the scheduler frees blocks when it
    schedules a step, so the last frees follow the step before the last.
    """
    processed = prompt_len + max_tokens - 1
    freed = frontier(processed - 1, prompt_len) // BLOCK
    events, previous = 0, 0
    for point in range(prompt_len, processed + 1, INTERVAL):
        now = max(0, (point - BUDGET) // BLOCK) * BLOCK
        events += now > previous
        previous = now
    return freed, events


def run_known_workload(server, tokenizer, workload, rng) -> tuple[int, int]:
    """Send (prompt tokens, max_tokens) requests one at a time; return the
    expected (blocks freed, eviction events) summed over them."""
    expected_freed = expected_events = 0
    for target, max_tokens in workload:
        prompt = needle_prompt(tokenizer, rng.randint(10000, 99999), target, rng.random())
        response = requests.post(
            server.url + "/v1/completions",
            json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                  "temperature": 0, "ignore_eos": True},
            timeout=600,
        ).json()
        freed, events = expected_request(response["usage"]["prompt_tokens"], max_tokens)
        expected_freed += freed
        expected_events += events
    return expected_freed, expected_events


def test_exported_files_merge_into_one_family_per_name(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_METRICS_DIR", str(tmp_path))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    engines = [
        ProcessMetrics(f"engine{i}", ENGINE_METRICS, {"model_name": "m", "engine": str(i), "policy": "p"})
        for i in range(2)
    ]
    freed = [random.randint(1, 1000) for _ in engines]
    for metrics, n in zip(engines, freed):
        metrics.get("kvevict_blocks_freed").inc(n)
        metrics.get("kvevict_logical_tokens").set(3 * n)
        metrics.export(force=True)
    families = {f.name: f for f in ExportedMetricsCollector(str(tmp_path)).collect()}
    assert families["kvevict_blocks_freed"].type == "counter"
    values = {s.labels["engine"]: s.value for s in families["kvevict_blocks_freed"].samples}
    assert values == {"0": freed[0], "1": freed[1]}
    assert {s.value for s in families["kvevict_logical_tokens"].samples} == {3 * n for n in freed}
    assert all(name.startswith("kvevict_") for name in METRIC_NAMES)


def test_a_metrics_or_stats_file_that_cannot_be_written_does_not_raise(tmp_path, monkeypatch, caplog):
    """A removed directory (or a full disk): one warning, no exception, and the
    next write succeeds once the directory is back."""
    import shutil

    from vllm_kvevict.plugin.snapshot import SnapshotWriter

    directory = tmp_path / "metrics"
    directory.mkdir()
    monkeypatch.setenv("KVEVICT_METRICS_DIR", str(directory))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = ProcessMetrics("engine0", ENGINE_METRICS, {"model_name": "m", "engine": "0", "policy": "p"})
    stats = SnapshotWriter(str(directory / "stats.json"))
    shutil.rmtree(directory)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            metrics.export(force=True)
            stats.write(lambda: {"steps": 1}, force=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "cannot write" in warnings[0] and "cannot write" in warnings[1]
    directory.mkdir()
    metrics.export(force=True)
    stats.write(lambda: {"steps": 2}, force=True)
    assert (directory / "engine0.prom").is_file() and (directory / "stats.json").is_file()


@pytest.mark.e2e
def test_served_series_equal_independent_counts(snapkv_server, tokenizer):
    server = snapkv_server
    server.wait_idle()
    time.sleep(0.5)
    before = scrape(server.url)
    rng = random.Random()
    workload = [(rng.choice([1200, 2000, 2900]), rng.randint(20, 90)) for _ in range(3)]
    expected_freed, expected_events = run_known_workload(server, tokenizer, workload, rng)

    server.wait_idle()
    time.sleep(0.5)
    after = scrape(server.url)

    def delta(name):
        return total(after, name) - total(before, name)

    assert delta("kvevict_blocks_freed_total") == expected_freed
    # slots storage: the frontier is whole blocks, each freed block 32 tokens dropped
    assert delta("kvevict_tokens_evicted_total") == expected_freed * BLOCK
    assert delta("kvevict_requests_admitted_total") == len(workload)
    assert total(after, "kvevict_requests_by_setting_total", setting="server") - total(
        before, "kvevict_requests_by_setting_total", setting="server") == len(workload)
    assert delta("kvevict_requests_admitted_beyond_memory_total") == 0  # end_of_prompt holds it
    assert delta("kvevict_eviction_events_total") == expected_events
    # One step per eviction here (requests ran alone), each timed once; every
    # eviction kept a count for each (layer, KV head).
    assert delta("kvevict_eviction_seconds_count") == expected_events
    assert delta("kvevict_eviction_seconds_sum") > 0
    assert delta("kvevict_head_retained_tokens_count") == expected_events * NUM_LAYERS * NUM_KV_HEADS
    # Idle: nothing held, nothing retained.
    for name in ("kvevict_logical_tokens", "kvevict_retained_tokens", "kvevict_blocks_held",
                 "kvevict_blocks_held_without_eviction", "kvevict_layer_retained_tokens"):
        assert total(after, name) == 0, name
    assert total(after, "kvevict_compression_ratio") == 1.0
    labels = {dict(labels)["model_name"] for _, labels in after}
    assert labels == {"smollm2"}
    side = total(after, "kvevict_side_buffer_bytes", rank="0")
    assert side == server.worker_stats()["side_buffer_bytes"] > 0
    # slots storage with the native kernel: vLLM's own attention kernel serves.
    assert total(after, "kvevict_attention_kernel_info", rank="0", kernel="vllm") == 1
    assert total(after, "kvevict_eviction_fallbacks_total") == 0


@pytest.mark.e2e
def test_occupancy_mid_request(snapkv_server, tokenizer):
    """While a long request decodes, logical/retained follow the storage rule."""
    server = snapkv_server
    server.wait_idle()
    prompt = needle_prompt(tokenizer, 55555, 1500)
    with requests.post(
        server.url + "/v1/completions",
        json={"model": "smollm2", "prompt": prompt, "max_tokens": 400, "temperature": 0,
              "ignore_eos": True, "stream": True},
        stream=True, timeout=600,
    ) as response:
        seen = []
        for i, line in enumerate(response.iter_lines()):
            # Events 10, 30, 50, 70 of 400: the request is still running even
            # though each scrape makes this reader fall further behind the server.
            if line.startswith(b"data: {") and i % 40 == 20 and i <= 140:
                time.sleep(0.4)  # past the export throttle
                samples = scrape(server.url)
                seen.append((total(samples, "kvevict_logical_tokens"),
                             total(samples, "kvevict_retained_tokens"),
                             total(samples, "kvevict_compression_ratio"),
                             total(samples, "kvevict_blocks_held")))
            if i > 140:
                break  # the client goes: the server aborts the rest
    server.wait_idle()
    prompt_len = len(tokenizer(prompt).input_ids)
    assert len(seen) >= 3
    for logical, retained, ratio, held in seen:
        assert logical >= prompt_len, seen
        assert retained == logical - frontier(logical, prompt_len)
        assert BUDGET <= retained < BUDGET + BLOCK + INTERVAL
        assert ratio == pytest.approx(logical / retained)
        # blocks cover [frontier, next step's end); the gauge is set when the
        # step's block is allocated, just after the token counts
        expected_held = -(-(logical + 1) // BLOCK) - frontier(logical, prompt_len) // BLOCK
        assert expected_held - 1 <= held <= expected_held


@pytest.mark.e2e
def test_series_with_several_api_servers(model_dir, tokenizer, tmp_path):
    """--api-server-count 2: vLLM serves metrics from its multiprocess registry;
    the engine core's and workers' series reach it through the same mmap files
    as vLLM's own, and either API server reports the same values."""
    from helpers import VllmServer
    from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES

    server = VllmServer(
        model_dir,
        ["--kv-eviction", "snapkv", "--kv-eviction-config", '{"budget": 512}',
         "--api-server-count", "2", "--dtype", "float32", "--max-model-len", "4096",
         "--block-size", "32", "--max-num-batched-tokens", "512", "--max-num-seqs", "4",
         "--enforce-eager", "--kv-cache-memory-bytes", str(160 * DEFAULT_MODEL_BLOCK_BYTES + 4096)],
        stats_path=tmp_path / "stats.json", log_path=tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        expected_freed, expected_events = run_known_workload(
            server, tokenizer, [(2900, 70), (1500, 40)], random.Random()
        )
        server.wait_idle()
        time.sleep(1.0)
        for _ in range(4):  # connections land on either API server
            samples = scrape(server.url)
            assert total(samples, "kvevict_blocks_freed_total") == expected_freed
            assert total(samples, "kvevict_eviction_events_total") == expected_events
            assert total(samples, "kvevict_requests_admitted_total") == 2
            assert total(samples, "kvevict_logical_tokens") == 0
            assert total(samples, "kvevict_side_buffer_bytes") > 0
    finally:
        server.stop()
