"""`kvevict bench` without vLLM: settings, pool and budget arithmetic, statistics,
metric parsing, tables and plots against values worked out here. The HTTP side
runs against a real `vllm serve` in test_eval_bench_e2e.py."""

from __future__ import annotations

import csv
import io
import json
import random

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES
from vllm_kvevict.evaluation import serving_bench as sb
from vllm_kvevict.evaluation.serving_bench import (
    BenchResult,
    MetricSample,
    RequestRecord,
    ResultStore,
    blocks_per_request,
    default_pool_blocks,
    distribute_tokens,
    dtype_bytes,
    flag_value,
    info_labels,
    inter_token_latencies,
    kv_block_bytes,
    kv_cache_memory_bytes,
    markdown_table,
    percentile,
    plan_managed,
    plan_pool,
    plot_bench,
    plot_timeline,
    pool_blocks_from_exposition,
    ratios_vs_full,
    results_csv,
    sample_from_values,
    summarize_run,
    summarize_samples,
)
from vllm_kvevict.evaluation.server import parse_metrics
from vllm_kvevict.evaluation.settings import FULL, parse_setting

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# SmolLM2-135M (the default model): 30 layers, 9 query / 3 KV heads of 64, fp32.
SMOLLM2_CONFIG = {
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_size": 576, "dtype": "float32",
}


# ---------------------------------------------------------------- arithmetic


def test_pool_and_budget_arithmetic_for_the_default_model() -> None:
    # One 32-token block: 2 (K, V) x 30 layers x 3 KV heads x 32 x 64 x 4 bytes.
    block = kv_block_bytes(SMOLLM2_CONFIG, 32, dtype_bytes("float32"))
    assert block == 1_474_560 == DEFAULT_MODEL_BLOCK_BYTES
    # head_dim from hidden_size / heads when config.json has none; nested text_config.
    no_head_dim = {k: v for k, v in SMOLLM2_CONFIG.items() if k != "head_dim"}
    assert kv_block_bytes({"text_config": no_head_dim}, 32, 4) == block
    assert kv_block_bytes(SMOLLM2_CONFIG, 32, dtype_bytes("bfloat16")) == block // 2
    assert kv_block_bytes(SMOLLM2_CONFIG, 16, 4) == block // 2
    assert dtype_bytes("bfloat16", "fp8_e4m3") == 1 and dtype_bytes("float32", "auto") == 4
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        dtype_bytes("auto")
    # (4000 + 128) / 32 = 129 blocks a request; 4 of them + the null block.
    assert blocks_per_request(4000, 128) == 129
    assert blocks_per_request(4000, 96) == 128  # exactly 4096 tokens
    assert default_pool_blocks(4000, 128) == 4 * 129 + 1 == 517
    assert default_pool_blocks(4000, 128, full_requests=2) == 259
    assert kv_cache_memory_bytes(517, block) == 517 * 1_474_560 + 4096 == 762_351_616


def test_plan_pool_reads_the_effective_flags() -> None:
    args = ["--dtype", "float32", "--block-size", "32"]
    assert plan_pool(SMOLLM2_CONFIG, args, 4000, 128) == (517, 762_351_616)
    assert plan_pool(SMOLLM2_CONFIG, args, 4000, 128, pool_blocks=100) == (100, 100 * 1_474_560 + 4096)
    # --server-args come after ours and win, as in vllm serve's parser.
    half = plan_pool(SMOLLM2_CONFIG, [*args, "--dtype=bfloat16"], 4000, 128, pool_blocks=100)
    assert half == (100, 100 * 737_280 + 4096)
    # An explicit memory size: the pool is what it buys.
    assert plan_pool(SMOLLM2_CONFIG, [*args, "--kv-cache-memory-bytes", str(10 * 1_474_560 + 5)],
                     4000, 128) == (10, 10 * 1_474_560 + 5)
    assert plan_pool(None, args, 4000, 128, memory_bytes=12345) == (None, 12345)
    with pytest.raises(ValueError, match="config.json"):
        plan_pool(None, args, 4000, 128)
    assert flag_value(["--a", "1", "--b=2", "--a", "3"], "--a") == "3"
    assert flag_value(["--a", "1", "--b=2"], "--b") == "2" and flag_value(["--a"], "--a") is None


def test_managed_servers_share_flags_and_differ_in_eviction(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    args = sb.build_parser().parse_args(
        ["--max-tokens", "128", "--server-args", "--max-num-seqs 7 --seed 3"])
    settings = [parse_setting("full"), parse_setting("snapkv@0.25")]
    plans = plan_managed(args, settings, str(tmp_path), {"w": 1}, [3990, 4000])
    full, snap = plans
    assert full.pool_blocks == snap.pool_blocks == 517 and full.budget is None
    assert snap.budget == 992  # 0.25 x the mean prompt (3995) -> 998 -> blocks of 32
    for plan in plans:
        assert flag_value(plan.server_args, "--kv-cache-memory-bytes") == "762351616"
        assert flag_value(plan.server_args, "--max-num-seqs") == "7"  # extra args win
        assert plan.server_args[-4:] == ["--max-num-seqs", "7", "--seed", "3"]
        assert "--no-enable-prefix-caching" in plan.server_args
        # The longest prompt + output + 64, rounded up to blocks: 4192 = 131 x 32.
        assert flag_value(plan.server_args, "--max-model-len") == "4192"
    assert "--kv-eviction" not in full.server_args
    assert flag_value(snap.server_args, "--kv-eviction") == "snapkv"
    assert json.loads(flag_value(snap.server_args, "--kv-eviction-config")) == {
        **settings[1].eviction, "budget": 992}
    small = sb.build_parser().parse_args(["--pool-blocks", "100"])
    with pytest.raises(ValueError, match="cannot hold one full request"):
        plan_managed(small, settings, str(tmp_path), {}, [4000])
    # Eviction alone may run in a pool smaller than one request.
    assert plan_managed(small, settings[1:], str(tmp_path), {}, [4000])[0].pool_blocks == 100


# ---------------------------------------------------------------- statistics


def test_percentiles_and_inter_token_latencies_match_numpy() -> None:
    rng = np.random.default_rng(7)
    values = rng.exponential(0.05, size=501)
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    for _ in range(20):
        chunks = int(rng.integers(1, 40))
        times = np.cumsum(rng.exponential(0.03, size=chunks))
        tokens = rng.integers(1, 4, size=chunks)
        itl = inter_token_latencies(list(times), list(tokens))
        expected = np.repeat(np.diff(times) / tokens[1:], tokens[1:])
        assert len(itl) == tokens[1:].sum()
        np.testing.assert_allclose(itl, expected)
    # One token per chunk: the plain arrival differences.
    np.testing.assert_allclose(inter_token_latencies([1.0, 1.5, 1.75], [1, 1, 1]), [0.5, 0.25])


def test_tokens_spread_evenly_when_chunks_do_not_say() -> None:
    assert distribute_tokens(8, 4) == [2, 2, 2, 2]
    assert distribute_tokens(10, 4) == [2, 2, 3, 3]
    assert distribute_tokens(3, 0) == []
    for _ in range(50):
        total, chunks = random.randint(0, 500), random.randint(1, 60)
        spread = distribute_tokens(total, chunks)
        assert sum(spread) == total and max(spread) - min(spread) <= 1


def test_concurrency_and_usage_count_only_while_requests_are_outstanding() -> None:
    # Requests outstanding over [1, 4] and [3, 6]; samples every 0.5 s from 0 to 8.
    times = np.arange(0, 8.01, 0.5)
    running = [9.0 if t < 1 or t > 6 else float(int(t)) for t in times]  # 9: someone else's load
    samples = [MetricSample(t, r, 2.0 if 2 <= t <= 3 else 0.0, r / 10, 5.0, 40 * r)
               for t, r in zip(times, running)]
    summary = summarize_samples(samples, [(1.0, 4.0), (3.0, 6.0)], pool_blocks=517)
    inside = [r for t, r in zip(times, running) if 1 <= t <= 6]
    assert summary.samples == len(inside) == 11
    assert summary.max_running == 6.0 and summary.mean_running == pytest.approx(np.mean(inside))
    assert summary.max_waiting == 2.0
    assert summary.kv_usage_peak == pytest.approx(0.6)
    assert summary.kv_blocks_peak == pytest.approx(0.6 * 516)  # usage is of pool - null block
    assert summary.kv_blocks_mean == pytest.approx(np.mean(inside) / 10 * 516)
    assert summary.blocks_held_peak == 240.0
    # Without a pool: usage only; without the plugin's series: no blocks held.
    bare = summarize_samples([MetricSample(1.0, 3.0, 0.0, 0.5)], [(0.0, 2.0)])
    assert bare.kv_blocks_peak is None and bare.kv_usage_peak == 0.5 and bare.blocks_held_peak is None
    assert summarize_samples([], [(0.0, 1.0)]).max_running is None


def _record(index: int, send: float, chunk_times: list[float], tokens: list[int],
            prompt: int = 100, error: str | None = None) -> RequestRecord:
    return RequestRecord(index, send, chunk_times[0] if chunk_times else None,
                         chunk_times[-1] if chunk_times else send + 1, chunk_times, tokens,
                         True, prompt, sum(tokens), error)


def test_a_run_summary_from_records_and_samples() -> None:
    records = [
        _record(0, 0.0, [1.0, 1.1, 1.3, 1.6], [1, 1, 1, 1]),
        _record(1, 0.0, [2.0, 2.5, 2.7], [2, 1, 1]),
        _record(2, 0.5, [], [], error="HTTP 500: boom"),
    ]
    samples = [MetricSample(t, 2.0, 1.0, 0.25, None) for t in (0.1, 1.0, 2.0)]
    result = summarize_run("snapkv@0.25", 0.25, 992, records, samples, 3.0, 517)
    assert (result.requests, result.completed, result.failed) == (3, 2, 1)
    assert result.wall_s == pytest.approx(2.7)
    assert result.completion_tokens == 8 and result.prompt_tokens == 200
    assert result.output_throughput == pytest.approx(8 / 2.7)
    assert result.total_throughput == pytest.approx(208 / 2.7)
    ttft = [1.0, 2.0]
    itl = [0.1, 0.2, 0.3, 0.5, 0.2]
    assert result.ttft_p50_ms == pytest.approx(np.percentile(ttft, 50) * 1000)
    assert result.ttft_p99_ms == pytest.approx(np.percentile(ttft, 99) * 1000)
    assert result.itl_p50_ms == pytest.approx(np.percentile(itl, 50) * 1000)
    assert result.itl_p99_ms == pytest.approx(np.percentile(itl, 99) * 1000)
    assert result.max_running == 2.0 and result.preemptions == 3.0
    assert result.kv_blocks_peak == pytest.approx(0.25 * 516) and result.blocks_held_peak is None
    assert result.errors == ["request 2: HTTP 500: boom"]


# ---------------------------------------------------------------- metrics


def _exposition() -> str:
    """vLLM's and the plugin's series as prometheus_client writes them."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "running", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "usage", labels, registry=registry)
    preempted = Counter("vllm:num_preemptions", "preemptions", labels, registry=registry)
    info = Gauge("vllm:cache_config_info", "cache config",
                 ["block_size", "num_gpu_blocks", "engine"], registry=registry)
    held = Gauge("kvevict_blocks_held", "held", [*labels, "policy"], registry=registry)
    kept = Histogram("kvevict_head_retained_tokens", "kept", [*labels, "policy", "rank"],
                     buckets=(256, 1024), registry=registry)
    running.labels("smollm2", "0").set(3)
    running.labels("smollm2", "1").set(2)  # a second engine (data parallel): summed
    waiting.labels("smollm2", "0").set(7)
    usage.labels("smollm2", "0").set(0.625)
    preempted.labels("smollm2", "0").inc(4)
    preempted.labels("smollm2", "1").inc(1)
    info.labels("32", "517", "0").set(1)
    held.labels("smollm2", "0", "snapkv").set(321)
    for value in (100, 300, 2000):
        kept.labels("smollm2", "0", "snapkv", "0").observe(value)
    return generate_latest(registry).decode()


def test_metric_parsing_sums_label_sets_and_names_counters_with_total() -> None:
    text = _exposition()
    assert "vllm:num_preemptions_total{" in text  # what a scrape really holds
    values = parse_metrics(text)
    assert values["vllm:num_requests_running"] == 5.0
    assert values["vllm:num_requests_waiting"] == 7.0
    assert values["vllm:kv_cache_usage_perc"] == 0.625
    assert values["vllm:num_preemptions_total"] == 5.0
    assert values["kvevict_blocks_held"] == 321.0
    assert values["kvevict_head_retained_tokens_count"] == 3.0
    assert values["kvevict_head_retained_tokens_sum"] == 2400.0
    assert not any(name.endswith(("_created", "_bucket")) for name in values)
    sample = sample_from_values(values, 1.5)
    assert sample == MetricSample(1.5, 5.0, 7.0, 0.625, 5.0, 321.0)
    assert sample_from_values({}, 0.0) == MetricSample(0.0)
    # Preemptions: end - start; a label set born during the run started at 0.
    assert sb.counter_delta(2.0, 5.0) == 3.0 and sb.counter_delta(None, 3.0) == 3.0
    assert sb.counter_delta(2.0, None) is None
    assert info_labels(text, "vllm:cache_config_info")["block_size"] == "32"
    assert pool_blocks_from_exposition(text) == 517
    assert pool_blocks_from_exposition("# nothing\n") is None
    # The names the tool reads are vLLM 0.32's.
    assert (sb.RUNNING, sb.WAITING, sb.KV_USAGE, sb.PREEMPTIONS) == (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total")


# ---------------------------------------------------------------- rendering


def _result(name: str, fraction: float | None, out_tps: float, max_running: float,
            pool: int | None = 517, **kw) -> BenchResult:
    values = dict(
        name=name, kept_fraction=fraction, budget=None if fraction is None else 992, requests=16,
        completed=16, failed=0, wall_s=100.0, prompt_tokens=16 * 4000, completion_tokens=2048,
        output_throughput=out_tps, total_throughput=out_tps * 10, max_running=max_running,
        mean_running=max_running - 0.5, max_waiting=12.0, preemptions=0.0, ttft_p50_ms=1234.5,
        ttft_p99_ms=5678.9, itl_p50_ms=45.25, itl_p99_ms=99.5, kv_usage_peak=0.98,
        kv_usage_mean=0.75, kv_blocks_peak=0.98 * 516 if pool else None,
        kv_blocks_mean=0.75 * 516 if pool else None, blocks_held_peak=None, pool_blocks=pool,
    )
    values.update(kw)
    return BenchResult(**values)


def test_table_and_csv_hold_the_numbers_and_ratios() -> None:
    results = [_result(FULL, None, 20.0, 4.0),
               _result("snapkv@0.25", 0.25, 50.0, 10.0, blocks_held_peak=480.0, preemptions=2.0)]
    ratios = ratios_vs_full(results)
    assert ratios["snapkv@0.25"]["max_running"] == 2.5
    assert ratios["snapkv@0.25"]["output_throughput"] == 2.5
    assert ratios["snapkv@0.25"]["mean_running"] == pytest.approx(9.5 / 3.5)
    assert ratios_vs_full(results[1:]) == {}

    table = markdown_table(results)
    lines = table.splitlines()
    assert lines[0].startswith("| setting | kept | budget |") and "tok/s x full" in lines[0]
    assert len(lines) == 4
    full_row = [c.strip() for c in lines[2].strip("|").split("|")]
    snap_row = [c.strip() for c in lines[3].strip("|").split("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    snap = dict(zip(header, snap_row))
    assert dict(zip(header, full_row))["kept"] == "100%" and dict(zip(header, full_row))["budget"] == "-"
    assert snap["kept"] == "25%" and snap["budget"] == "992" and snap["done/sent"] == "16/16"
    assert snap["out tok/s"] == "50.0" and snap["total tok/s"] == "500.0"
    assert snap["max running"] == "10" and snap["mean running"] == "9.5"
    assert snap["preempt"] == "2" and snap["TTFT p50 ms"] == "1234" and snap["ITL p50 ms"] == "45.2"
    assert snap["KV blocks peak"] == "506" and snap["KV blocks mean"] == "387"
    assert snap["held peak"] == "480" and snap["pool"] == "517"
    assert snap["running x full"] == "2.50x" and snap["tok/s x full"] == "2.50x"
    # A server with an unknown pool shows vLLM's usage in %.
    unknown = markdown_table([_result("gpu", None, 1.0, 1.0, pool=None)])
    assert "| 98% | 75% |" in unknown

    rows = list(csv.DictReader(io.StringIO(results_csv(results))))
    assert [r["name"] for r in rows] == [FULL, "snapkv@0.25"]
    assert rows[0]["kept_fraction"] == "" and rows[1]["kept_fraction"] == "0.25"
    assert float(rows[1]["output_throughput"]) == 50.0 and float(rows[1]["itl_p99_ms"]) == 99.5
    assert float(rows[1]["max_running_x_full"]) == 2.5 and float(rows[0]["output_throughput_x_full"]) == 1.0
    assert rows[0]["blocks_held_peak"] == "" and rows[1]["pool_blocks"] == "517"


def test_plots_are_png_files(tmp_path) -> None:
    results = [_result(FULL, None, 20.0, 4.0), _result("snapkv@0.25", 0.25, 50.0, 10.0),
               _result("gpu", None, 1.0, 1.0, pool=None, mean_running=None, ttft_p50_ms=None)]
    plot_bench(results, tmp_path / "bench.png")
    timelines = {r.name: [MetricSample(t, t % 5, 0.0, t / 20) for t in np.arange(0, 10, 0.25)]
                 for r in results}
    timelines["empty"] = []
    plot_timeline(timelines, tmp_path / "timeline.png", {FULL: 517})
    for name in ("bench.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_results_store_resumes_same_parameters_only(tmp_path) -> None:
    store = ResultStore(tmp_path / "results.json")
    load = sb.LoadRun([_record(0, 0.0, [1.0, 2.0], [1, 1])], [MetricSample(0.5, 1.0)], 0.0, 517)
    params = {"workload": {"requests": 1, "seed": (0, 1)}, "server_args": ["--x", "1"]}
    store.put(FULL, params, _result(FULL, None, 2.0, 1.0), load)
    again = ResultStore(tmp_path / "results.json")
    run = again.get(FULL, params)
    assert run is not None and run["requests"][0]["chunk_times"] == [1.0, 2.0]
    assert sb.result_from_json(run["result"]) == _result(FULL, None, 2.0, 1.0)
    assert sb.samples_from_json(run["samples"]) == [MetricSample(0.5, 1.0)]
    assert again.get(FULL, {**params, "server_args": ["--x", "2"]}) is None
    assert again.get("other", params) is None
    assert [r["name"] for r in again.matching({"requests": 1, "seed": [0, 1]})] == [FULL]
    assert again.matching({"requests": 2}) == []
