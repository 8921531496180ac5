"""`kvevict bench` without vLLM: settings, pool and budget arithmetic, statistics,
metric parsing, tables and plots against values worked out here. The HTTP side
runs against a real `vllm serve` in test_eval_bench_e2e.py."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES
from vllm_kvevict.evaluation import serving_bench as sb
from vllm_kvevict.evaluation.server import parse_metrics
from vllm_kvevict.evaluation.serving_bench import (
    BenchResult,
    HistogramDelta,
    MetricSample,
    ResultStore,
    blocks_per_request,
    default_pool_blocks,
    dtype_bytes,
    flag_value,
    histogram_delta,
    histogram_from_exposition,
    histogram_quantile,
    info_labels,
    kv_block_bytes,
    kv_cache_memory_bytes,
    markdown_table,
    plan_managed,
    plan_pool,
    plot_timeline,
    pool_blocks_from_exposition,
    ratios_vs_full,
    ratios_vs_unbounded,
    request_records,
    results_csv,
    sample_from_values,
    summarize_run,
    summarize_samples,
    unbounded_pool_blocks,
)
from vllm_kvevict.evaluation.settings import (
    FULL,
    FULL_UNBOUNDED,
    ServingSetting,
    eviction_config,
    parse_setting,
    parse_settings,
)
from vllm_kvevict.metrics import LATENCY_BUCKETS

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
    # "+prefix": vLLM's prefix caching on, for eviction with prefix_caching shared.
    shared = [parse_setting("full+prefix"), parse_setting("snapkv+prefix@0.25")]
    full_prefix, snap_prefix = plan_managed(args, shared, str(tmp_path), {"w": 1}, [3990, 4000])
    for plan in (full_prefix, snap_prefix):
        assert "--enable-prefix-caching" in plan.server_args
        assert "--no-enable-prefix-caching" not in plan.server_args
    assert "--kv-eviction" not in full_prefix.server_args and shared[1].name == "snapkv+prefix@0.25"
    assert json.loads(flag_value(snap_prefix.server_args, "--kv-eviction-config"))["prefix_caching"] == "shared"
    small = sb.build_parser().parse_args(["--pool-blocks", "100"])
    with pytest.raises(ValueError, match="cannot hold one full request"):
        plan_managed(small, settings, str(tmp_path), {}, [4000])
    # Eviction alone may run in a pool smaller than one request.
    assert plan_managed(small, settings[1:], str(tmp_path), {}, [4000])[0].pool_blocks == 100


def test_the_unbounded_pool_holds_every_request_in_full() -> None:
    # 16 requests of (4000 + 128) / 32 = 129 blocks, + the null block.
    assert unbounded_pool_blocks(4000, 128, 16) == 16 * 129 + 1 == 2065
    assert unbounded_pool_blocks(4000, 128, 16) == default_pool_blocks(4000, 128, full_requests=16)
    assert unbounded_pool_blocks(4000, 96, 3, block_size=16) == 3 * 256 + 1
    assert unbounded_pool_blocks(10, 1, 1) == 2  # one block and the null block


def test_full_unbounded_is_the_full_cache_in_its_own_pool(tmp_path, capsys) -> None:
    setting = parse_setting(" full-unbounded ")
    assert setting == ServingSetting(FULL_UNBOUNDED, unbounded=True)
    assert setting.managed and setting.policy is None and eviction_config(setting, 4000) is None
    assert not parse_setting("full").unbounded
    assert parse_setting(f"{FULL_UNBOUNDED}=http://h:1").unbounded is False  # a running server

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    args = sb.build_parser().parse_args(["--requests", "16", "--max-tokens", "128",
                                         "--server-args", "--seed 3"])
    settings = [parse_setting(FULL_UNBOUNDED), parse_setting(FULL), parse_setting("snapkv@0.25")]
    unbounded, full, snap = plan_managed(args, settings, str(tmp_path), {"w": 1}, [3990, 4000])
    assert unbounded.pool_blocks == 2065 and full.pool_blocks == snap.pool_blocks == 517
    assert flag_value(unbounded.server_args, "--kv-cache-memory-bytes") == str(2065 * 1_474_560 + 4096)
    assert flag_value(full.server_args, "--kv-cache-memory-bytes") == "762351616"
    assert unbounded.budget is None and "--kv-eviction" not in unbounded.server_args
    # Apart from the pool, the same flags as the full cache's.
    pool_flag = unbounded.server_args.index("--kv-cache-memory-bytes")
    assert (unbounded.server_args[:pool_flag] + unbounded.server_args[pool_flag + 2:]
            == full.server_args[:pool_flag] + full.server_args[pool_flag + 2:])
    assert unbounded.params != full.params
    # Resumed like the others: same parameters, no rerun.
    store = ResultStore(tmp_path / "results.json")
    load = _load([(0.0, 1.0, [1.0], 100, 2, None)], pool=2065)
    store.put(FULL_UNBOUNDED, unbounded.params, _result(FULL_UNBOUNDED, None, 2.0, 1.0, 2065), load)
    assert ResultStore(tmp_path / "results.json").get(FULL_UNBOUNDED, unbounded.params) is not None
    assert ResultStore(tmp_path / "results.json").get(FULL_UNBOUNDED, full.params) is None
    # A bounded pool below one request refuses 'full' only, never full-unbounded.
    small = sb.build_parser().parse_args(["--pool-blocks", "100", "--requests", "4"])
    wide, snap_small = plan_managed(small, [settings[0], settings[2]], str(tmp_path), {}, [4000])
    assert wide.pool_blocks == 4 * 129 + 1 and snap_small.pool_blocks == 100
    # A memory size for every server would override the unbounded pool.
    fixed = sb.build_parser().parse_args(["--server-args", "--kv-cache-memory-bytes 5000000"])
    with pytest.raises(ValueError, match="sizes its own pool"):
        plan_managed(fixed, settings[:1], str(tmp_path), {}, [4000])
    assert plan_managed(fixed, settings[2:], str(tmp_path), {}, [4000])[0].pool_blocks == 3

    # bench takes it; commands that size no pool per request refuse it in one line.
    parser = sb.build_parser()
    assert parse_settings(parser, [FULL_UNBOUNDED, FULL], None, unbounded=True)[0].unbounded
    with pytest.raises(SystemExit):
        parse_settings(parser, [FULL_UNBOUNDED], None)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "full-unbounded is a `kvevict bench` setting" in error and "give 'full'" in error
    with pytest.raises(SystemExit):
        parse_settings(parser, [FULL_UNBOUNDED, FULL_UNBOUNDED], None, unbounded=True)
    assert "distinct names" in capsys.readouterr().err


# ---------------------------------------------------------------- statistics


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


def _load(requests: list[tuple[float, float, list[float], int, int, str | None]],
          samples=(), preemptions: float | None = 0.0, pool: int | None = 517, clock0: float = 0.0,
          max_tokens: int | list[int] = 4, **figures) -> sb.LoadRun:
    """A load as vLLM's benchmark() reports it, per request (start time, TTFT,
    inter-chunk gaps, prompt tokens, completion tokens, error); the end of a
    request is its last chunk's arrival. ``max_tokens``: what each request
    asked for (one number: all of them)."""
    lists = {
        "start_times": [r[0] for r in requests], "ttfts": [r[1] for r in requests],
        "itls": [r[2] for r in requests], "latencies": [r[1] + sum(r[2]) for r in requests],
        "input_lens": [r[3] for r in requests], "output_lens": [r[4] for r in requests],
        "errors": [r[5] or "" for r in requests],
    }
    figures.setdefault("duration", max([r[0] + r[1] + sum(r[2]) for r in requests], default=0.0))
    asked = [max_tokens] * len(requests) if isinstance(max_tokens, int) else max_tokens
    return sb.LoadRun(request_records(lists, asked, clock0), figures, list(samples), preemptions, pool)


def test_a_run_summary_from_vllms_benchmark_and_samples() -> None:
    traceback = "Traceback (most recent call last):\n  ...\naiohttp.ClientPayloadError: Response payload is not completed\n"
    load = _load([
        (10.0, 1.0, [0.1, 0.2, 0.3], 100, 4, None),
        (10.0, 2.0, [0.5, 0.2], 100, 4, None),  # two tokens in one chunk
        (10.5, 0.0, [], 100, 0, traceback),
        (10.5, 1.5, [0.1], 120, 2, None),  # stopped short of max_tokens
    ], samples=[MetricSample(t, 2.0, 1.0, 0.25, None) for t in (0.1, 1.0, 2.0)], preemptions=3.0,
        clock0=10.0, duration=2.75, p50_ttft_ms=1500.0, p99_ttft_ms=1990.0, p50_itl_ms=200.0,
        p99_itl_ms=496.0)
    first, _, failed, short = load.requests
    assert (first["send_s"], first["first_token_s"], first["end_s"]) == (0.0, 1.0, pytest.approx(1.6))
    assert first["itl"] == [0.1, 0.2, 0.3] and first["error"] is None
    assert failed["error"] == "aiohttp.ClientPayloadError: Response payload is not completed"
    assert failed["first_token_s"] is None
    assert short["error"] == "2 completion tokens, asked 4"
    result = summarize_run("snapkv@0.25", 0.25, 992, load, 517)
    assert (result.requests, result.completed, result.failed) == (4, 2, 2)
    assert result.wall_s == 2.75
    assert result.completion_tokens == 8 and result.prompt_tokens == 200
    assert result.output_throughput == pytest.approx(8 / 2.75)
    assert result.total_throughput == pytest.approx(208 / 2.75)
    assert result.request_throughput == pytest.approx(2 / 2.75)  # completed requests only
    # Latency percentiles are vLLM's benchmark's own.
    assert (result.ttft_p50_ms, result.ttft_p99_ms, result.itl_p50_ms, result.itl_p99_ms) == (
        1500.0, 1990.0, 200.0, 496.0)
    assert result.max_running == 2.0 and result.preemptions == 3.0
    assert result.kv_blocks_peak == pytest.approx(0.25 * 516) and result.blocks_held_peak is None
    assert result.errors == ["request 2: aiohttp.ClientPayloadError: Response payload is not completed",
                             "request 3: 2 completion tokens, asked 4"]
    # No request completed: no latency figure (vLLM's would read 0).
    nothing = summarize_run(FULL, None, None, _load([(0.0, 0.0, [], 10, 0, "boom")], p50_ttft_ms=0.0), 517)
    assert nothing.ttft_p50_ms is None and nothing.completed == 0
    # Each request is held to its own max_tokens.
    mixed = _load([(0.0, 1.0, [0.1], 10, 2, None), (0.0, 1.0, [0.1], 10, 2, None)], max_tokens=[2, 3])
    assert [r["error"] for r in mixed.requests] == [None, "2 completion tokens, asked 3"]


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


def _bucketed(values, bounds=LATENCY_BUCKETS) -> list[tuple[float, float]]:
    """Cumulative counts of ``values`` in buckets ``le`` = bounds and +Inf."""
    data = np.asarray(values, dtype=float)
    return [(b, float((data <= b).sum())) for b in (*bounds, float("inf"))]


def _spread_quantile(q: float, values: np.ndarray, bounds=LATENCY_BUCKETS) -> float:
    """Brute force from the observations themselves: the CDF that spreads each
    bucket's observations evenly over it, F(x) = #(values <= lower) + #(values
    in the bucket) x (x - lower) / (upper - lower), and the smallest x with
    F(x) >= q x n, found by bisection (the observations below the top bound)."""
    edges = np.asarray([0.0, *bounds])

    def cdf(x: float) -> float:
        i = int(np.searchsorted(edges, x, side="left"))  # x in (edges[i - 1], edges[i]]
        lower, upper = edges[max(i - 1, 0)], edges[max(i, 1)]
        inside = ((values > lower) & (values <= upper)).sum()
        return float((values <= lower).sum() + inside * (x - lower) / (upper - lower))

    rank, lo, hi = q * len(values), 0.0, float(edges[-1])
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cdf(mid) >= rank else (mid, hi)
    return hi


def test_histogram_quantile_by_hand() -> None:
    inf = float("inf")
    # 10 observations: 4 in (0, 1], 6 in (1, 3]; p50 is rank 5, the first of
    # (1, 3]'s six: 1 + 2 x 1/6.
    buckets = [(1.0, 4.0), (3.0, 10.0), (inf, 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(1 + 2 / 6)
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.5)  # rank 2 of 4 in (0, 1]
    assert histogram_quantile(0.4, buckets) == pytest.approx(1.0)  # rank 4: the bucket's top
    assert histogram_quantile(1.0, buckets) == pytest.approx(3.0)
    assert histogram_quantile(0.0, buckets) == 0.0
    # Bounds in any order; an empty middle bucket is skipped.
    assert histogram_quantile(0.75, [(inf, 4.0), (4.0, 4.0), (2.0, 2.0), (1.0, 2.0)]) == pytest.approx(3.0)
    assert histogram_quantile(0.0, [(1.0, 0.0), (2.0, 2.0), (inf, 2.0)]) == 1.0  # the lowest non-empty
    # Ranks in +Inf: the highest finite bound, as Prometheus answers.
    assert histogram_quantile(0.99, [(1.0, 1.0), (2.0, 2.0), (inf, 10.0)]) == 2.0
    assert histogram_quantile(0.5, [(1.0, 0.0), (inf, 0.0)]) is None  # no observations
    with pytest.raises(ValueError, match="Inf"):
        histogram_quantile(0.5, [(1.0, 3.0)])
    with pytest.raises(ValueError, match="outside"):
        histogram_quantile(1.5, buckets)


def test_histogram_quantile_matches_brute_force_on_bucketed_observations() -> None:
    rng = np.random.default_rng(3)
    for trial in range(60):
        n = int(rng.integers(1, 400))
        # Eviction-like seconds: log-normal around 1-50 ms, below the top bound 2.5 s.
        values = np.minimum(rng.lognormal(np.log(rng.uniform(0.001, 0.05)), 1.0, size=n), 2.4)
        buckets = _bucketed(values)
        for q in (0.01, 0.25, 0.5, 0.9, 0.99, 1.0, float(rng.uniform())):
            estimate = histogram_quantile(q, buckets)
            assert estimate == pytest.approx(_spread_quantile(q, values), rel=1e-9, abs=1e-12), (trial, q)
            # The estimate lies in the bucket of the observation at rank ceil(q n).
            true = np.sort(values)[max(int(np.ceil(q * n)) - 1, 0)]
            upper = next(b for b in LATENCY_BUCKETS if true <= b)
            lower = max([0.0, *(b for b in LATENCY_BUCKETS if b < true)])
            assert lower - 1e-12 <= estimate <= upper + 1e-12, (trial, q)


def test_eviction_histogram_over_a_run_from_two_scrapes() -> None:
    """kvevict_eviction_seconds as the plugin exposes it, read before and after."""
    registry = CollectorRegistry()
    seconds = Histogram("kvevict_eviction_seconds", "eviction", ["model_name", "engine", "policy"],
                        buckets=LATENCY_BUCKETS, registry=registry)
    earlier = [0.0004, 0.3, 0.3]  # before the load: not counted
    during = [0.002, 0.003, 0.004, 0.012, 0.02, 0.03, 0.04, 0.6, 7.0]
    for value in earlier:
        seconds.labels("smollm2", "0", "snapkv").observe(value)
    before = histogram_from_exposition(generate_latest(registry).decode(), "kvevict_eviction_seconds")
    for i, value in enumerate(during):
        seconds.labels("smollm2", str(i % 2), "snapkv").observe(value)  # two engines: summed
    after = histogram_from_exposition(generate_latest(registry).decode(), "kvevict_eviction_seconds")
    run = histogram_delta(before, after)
    assert run.buckets == _bucketed(during)
    assert run.count == 9 and run.sum == pytest.approx(sum(during))
    # p50: rank 4.5 of 9; 3 observations up to 0.01, 2 in (0.01, 0.02]: 0.01 + 0.01 x 1.5 / 2.
    assert histogram_quantile(0.5, run.buckets) == pytest.approx(0.0175)
    assert histogram_quantile(0.99, run.buckets) == LATENCY_BUCKETS[-1]  # rank 8.91 lies in +Inf
    one = _load([(0.0, 1.0, [1.0], 100, 2, None)])
    one.eviction = run
    summary = summarize_run("snapkv@0.25", 0.25, 992, one, 517)
    assert summary.eviction_steps == 9 and summary.eviction_seconds == pytest.approx(sum(during))
    assert summary.eviction_p50_ms == pytest.approx(17.5) and summary.eviction_p99_ms == LATENCY_BUCKETS[-1] * 1000
    assert summarize_run(FULL, None, None, _load([]), None).eviction_p50_ms is None
    # Born during the run: from 0. Absent at the end, or gone down (a restart): unknown.
    assert histogram_delta(None, after) == after and histogram_delta(before, None) is None
    assert histogram_delta(after, before) is None
    assert histogram_delta(HistogramDelta([(1.0, 0.0), (float("inf"), 0.0)], 0.0), after) is None
    assert histogram_from_exposition(_exposition(), "kvevict_eviction_seconds") is None
    kept = histogram_from_exposition(_exposition(), "kvevict_head_retained_tokens")
    assert kept.buckets == [(256.0, 1.0), (1024.0, 2.0), (float("inf"), 3.0)] and kept.sum == 2400.0


def test_the_histogram_after_the_run_is_read_once_it_stops_changing(monkeypatch) -> None:
    registry = CollectorRegistry()
    seconds = Histogram("kvevict_eviction_seconds", "eviction", ["engine"], buckets=(0.01, 0.1),
                        registry=registry)
    texts = []
    for value in (0.005, 0.05, None, None):  # a worker's last export lands after the first scrape
        if value is not None:
            seconds.labels("0").observe(value)
        texts.append(generate_latest(registry).decode())
    scrapes = iter(texts)
    monkeypatch.setattr(sb, "scrape", lambda url: next(scrapes))
    settled = sb.settled_histogram("http://h", "kvevict_eviction_seconds", pause=0)
    assert settled.count == 2 and settled.sum == pytest.approx(0.055)
    assert next(scrapes) == texts[3]  # three scrapes: 1, 2, 2 observations
    monkeypatch.setattr(sb, "scrape", lambda url: "# none\n")
    assert sb.settled_histogram("http://h", "kvevict_eviction_seconds", pause=0) is None


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
        request_throughput=0.16,
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


def test_fractions_of_the_unbounded_row_and_eviction_columns() -> None:
    unbounded = _result(FULL_UNBOUNDED, None, 40.0, 16.0, pool=2065, request_throughput=0.32)
    full = _result(FULL, None, 20.0, 4.0, request_throughput=0.16, eviction_steps=0.0)
    snap = _result("snapkv@0.25", 0.25, 30.0, 13.0, request_throughput=0.24, eviction_steps=16.0,
                   eviction_seconds=0.4, eviction_p50_ms=21.25, eviction_p99_ms=48.5)
    results = [full, snap, unbounded]
    wide = ratios_vs_unbounded(results)
    assert wide["snapkv@0.25"] == {"output_throughput": 0.75, "request_throughput": pytest.approx(0.75)}
    assert wide[FULL] == {"output_throughput": 0.5, "request_throughput": 0.5}
    assert wide[FULL_UNBOUNDED] == {"output_throughput": 1.0, "request_throughput": 1.0}
    assert ratios_vs_unbounded([full, snap]) == {}
    # The x full ratios keep their reference: the bounded full cache.
    assert ratios_vs_full(results)[FULL_UNBOUNDED]["output_throughput"] == 2.0

    lines = markdown_table(results).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {cells[0]: dict(zip(header, cells))
            for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert header.index("evict p50 ms") == header.index("ITL p99 ms") + 1
    assert rows["snapkv@0.25"]["tok/s x unbounded"] == "0.75x"
    assert rows["snapkv@0.25"]["req/s x unbounded"] == "0.75x"
    assert rows["snapkv@0.25"]["tok/s x full"] == "1.50x"
    assert rows[FULL]["tok/s x unbounded"] == "0.50x" and rows[FULL_UNBOUNDED]["req/s x unbounded"] == "1.00x"
    assert rows[FULL_UNBOUNDED]["pool"] == "2065" and rows[FULL_UNBOUNDED]["kept"] == "100%"
    assert rows["snapkv@0.25"]["evict p50 ms"] == "21.25" and rows["snapkv@0.25"]["evict p99 ms"] == "48.50"
    assert rows["snapkv@0.25"]["evict steps"] == "16" and rows["snapkv@0.25"]["ITL p50 ms"] == "45.2"
    assert rows[FULL]["evict steps"] == "0" and rows[FULL]["evict p50 ms"] == "-"
    assert rows[FULL_UNBOUNDED]["evict steps"] == "-"  # no histogram exposed
    bare = markdown_table([full, snap]).splitlines()[3]
    assert bare.endswith("| - | - |")  # no unbounded row: no fraction

    csv_rows = {r["name"]: r for r in csv.DictReader(io.StringIO(results_csv(results)))}
    assert float(csv_rows["snapkv@0.25"]["output_throughput_x_unbounded"]) == 0.75
    assert float(csv_rows["snapkv@0.25"]["request_throughput_x_unbounded"]) == 0.75
    assert float(csv_rows["snapkv@0.25"]["request_throughput"]) == 0.24
    assert float(csv_rows["snapkv@0.25"]["eviction_p99_ms"]) == 48.5
    assert float(csv_rows["snapkv@0.25"]["eviction_seconds"]) == 0.4
    assert csv_rows[FULL_UNBOUNDED]["eviction_p50_ms"] == ""
    no_wide = list(csv.DictReader(io.StringIO(results_csv([full, snap]))))
    assert no_wide[1]["output_throughput_x_unbounded"] == ""


def test_requests_per_second_for_results_stored_without_it() -> None:
    stored = {k: v for k, v in vars(_result(FULL, None, 20.0, 4.0)).items()
              if k not in ("request_throughput", "eviction_p50_ms")}
    result = sb.result_from_json(stored)
    assert result.request_throughput == 16 / 100.0 and result.eviction_p50_ms is None


def test_the_timeline_is_a_png_file(tmp_path) -> None:
    results = [_result(FULL, None, 20.0, 4.0), _result("snapkv@0.25", 0.25, 50.0, 10.0),
               _result("gpu", None, 1.0, 1.0, pool=None, mean_running=None, ttft_p50_ms=None)]
    timelines = {r.name: [MetricSample(t, t % 5, 0.0, t / 20) for t in np.arange(0, 10, 0.25)]
                 for r in results}
    timelines["empty"] = []
    plot_timeline(timelines, tmp_path / "timeline.png", {FULL: 517})
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_MAGIC


def test_results_store_resumes_same_parameters_only(tmp_path) -> None:
    store = ResultStore(tmp_path / "results.json")
    load = _load([(0.0, 1.0, [1.0], 100, 2, None)], samples=[MetricSample(0.5, 1.0)])
    params = {"workload": {"requests": 1, "seed": (0, 1)}, "server_args": ["--x", "1"]}
    store.put(FULL, params, _result(FULL, None, 2.0, 1.0), load)
    again = ResultStore(tmp_path / "results.json")
    run = again.get(FULL, params)
    assert run is not None and run["requests"][0]["itl"] == [1.0] and run["vllm_benchmark"] == {"duration": 2.0}
    assert sb.result_from_json(run["result"]) == _result(FULL, None, 2.0, 1.0)
    assert sb.samples_from_json(run["samples"]) == [MetricSample(0.5, 1.0)]
    assert again.get(FULL, {**params, "server_args": ["--x", "2"]}) is None
    assert again.get("other", params) is None
    assert [r["name"] for r in again.matching({"requests": 1, "seed": [0, 1]})] == [FULL]
    assert again.matching({"requests": 2}) == []


def test_shared_prefix_prompts_start_alike(tokenizer) -> None:
    """--shared-prefix-tokens: every prompt starts with the same system prompt
    of about that many tokens (their first whole blocks agree), then its own
    session number and document; without it no two share a first block."""
    prompts = sb.build_prompts(tokenizer, 3, 1500, seed=1, shared_prefix_tokens=512)
    ids = [tokenizer(p).input_ids for p in prompts]
    common = 0
    while all(len(i) > common and i[common] == ids[0][common] for i in ids):
        common += 1
    assert 500 <= common <= 530, common
    assert all(1400 <= len(i) <= 1600 for i in ids)
    plain = [tokenizer(p).input_ids for p in sb.build_prompts(tokenizer, 3, 1500, seed=1)]
    assert len({tuple(i[:32]) for i in plain}) == 3
