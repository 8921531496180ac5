"""`kvevict bench`: serving capacity under a constrained KV pool, with and without
eviction, measured on the real serving path.

The load is vLLM's own serving benchmark (the ``benchmark()`` of ``vllm bench
serve``): N streaming ``/v1/completions`` requests of long passkey prompts
(``--prompt-tokens``), greedy, with ``ignore_eos`` and a fixed number of output
tokens, ``--concurrency`` at a time, to a KV pool that holds only a few of them
in full. vLLM's benchmark times every request (TTFT, inter-token gaps) and
counts throughput; this tool adds what it lacks: a sampler that scrapes
``/metrics`` every 0.25 s meanwhile (vLLM's running and waiting requests,
KV-cache usage, preemptions, the plugin's ``kvevict_blocks_held``), the plugin's
``kvevict_eviction_seconds`` histogram read before and after the load (how long
one step's eviction took), and one KV pool for every setting it serves.

Each ``--setting`` is one of:

* a server that already runs (``--setting NAME=URL``; any vLLM, CPU or GPU,
  with or without ``--kv-eviction``); runs against several servers into the
  same ``--out`` are reported together, with ``x full`` ratios against the one
  named ``full``;
* managed (``--setting full --setting snapkv@0.25 ...``, see ``settings.py``):
  the tool starts one ``vllm serve`` per setting, one after another, all with
  the same KV pool (default: what 4 requests need in full) and the same flags,
  and a budget of FRACTION x the mean prompt for eviction settings;
  ``full-unbounded`` is the full cache in a pool that holds every request in
  full at once (no memory limit, no eviction): the ``x unbounded`` ratios
  divide by it, the ceiling eviction in the bounded pool can reach.

Both can be mixed. Outputs in ``--out``: ``results.md``, ``results.csv``,
``results.json`` (every request's timings and every metric sample; a setting
already there with the same parameters is not run again unless ``--force``)
and ``timeline.png``.

    kvevict bench                                   # full vs snapkv@0.25, default model
    kvevict bench --setting full --setting snapkv@0.25 --setting momentkv@0.5
    kvevict bench --setting full-unbounded --setting full --setting snapkv@0.25
    kvevict bench --setting full=http://gpu-host:8000 --tokenizer MODEL
    kvevict bench --setting snapkv@0.25 --kv-eviction-config '{"prefill_mode": "per_chunk"}'
    kvevict bench --shared-prefix-tokens 1024 --setting full+prefix --setting snapkv@0.25 --setting snapkv+prefix@0.25
    kvevict bench --setting full --setting snapkv@0.25 --server-args "--dtype bfloat16"
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import math
import random
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import requests

from vllm_kvevict.evaluation.ruler import load_tokenizer
from vllm_kvevict.evaluation.server import VllmServer, parse_metrics, scrape, scrape_metrics, served_model
from vllm_kvevict.evaluation.settings import (
    add_kv_eviction_config_argument,
    DEFAULT_BLOCK_SIZE,
    FULL,
    FULL_UNBOUNDED,
    ServingSetting,
    eviction_config,
    flag_value,
    check_running_servers,
    parse_settings,
    pyplot,
)

DEFAULT_SETTINGS = (FULL, "snapkv@0.25")
# vLLM 0.32 series (vllm/v1/metrics/loggers.py). Counters are exposed with
# "_total"; vLLM's gauges carry the labels model_name and engine.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction (1.0 = full) of num_gpu_blocks - 1
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # labels: the CacheConfig, num_gpu_blocks included
BLOCKS_HELD = "kvevict_blocks_held"
# The plugin's histogram (vllm_kvevict/metrics.py): one observation per model
# step of the first worker in which some request dropped tokens, its worker time
# in eviction work summed over all layers and over the requests evicting then.
EVICTION_SECONDS = "kvevict_eviction_seconds"
PNG_DPI = 110


# ---------------------------------------------------------------- pool arithmetic


def blocks_per_request(prompt_tokens: int, max_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """KV blocks one request holds at its end without eviction."""
    return -(-(prompt_tokens + max_tokens) // block_size)


def default_pool_blocks(prompt_tokens: int, max_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE,
                        full_requests: int = 4) -> int:
    """A pool that holds ``full_requests`` whole requests, plus vLLM's null block
    (block 0 is never handed out: usable blocks = num_gpu_blocks - 1)."""
    return full_requests * blocks_per_request(prompt_tokens, max_tokens, block_size) + 1


def unbounded_pool_blocks(prompt_tokens: int, max_tokens: int, requests: int,
                          block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The pool of ``full-unbounded``: every request of the load in full at once,
    plus the null block, so no request waits for memory and nothing is evicted."""
    return default_pool_blocks(prompt_tokens, max_tokens, block_size, full_requests=requests)


def dtype_bytes(dtype: str, kv_cache_dtype: str | None = None) -> int:
    """Bytes per KV element: ``--kv-cache-dtype`` when quantized, else ``--dtype``."""
    if kv_cache_dtype and kv_cache_dtype != "auto":
        if kv_cache_dtype.startswith("fp8") or kv_cache_dtype in ("int8", "uint8"):
            return 1
        dtype = kv_cache_dtype
    sizes = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
             "bfloat16": 2, "bf16": 2}
    if dtype not in sizes:
        raise ValueError(f"cannot size the KV cache for --dtype {dtype!r}: pass --dtype "
                         "float32/bfloat16/float16 or --kv-cache-memory-bytes explicitly")
    return sizes[dtype]


def kv_block_bytes(model_config: dict[str, Any], block_size: int, element_bytes: int) -> int:
    """Bytes of one KV block over all layers (what vLLM divides the KV memory by):
    2 (K and V) x layers x KV heads x block size x head_dim x element bytes."""
    config = model_config.get("text_config") or model_config
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * layers * kv_heads * block_size * head_dim * element_bytes


def kv_cache_memory_bytes(pool_blocks: int, block_bytes: int) -> int:
    """``--kv-cache-memory-bytes`` for exactly ``pool_blocks`` blocks (vLLM floors the
    division; the 4 KiB slack keeps a rounding error from costing a block)."""
    return pool_blocks * block_bytes + 4096


# ---------------------------------------------------------------- metrics


def info_labels(text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample of ``name`` (vLLM's ``*_info`` gauges)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return dict(sample.labels)
    return None


def pool_blocks_from_exposition(text: str) -> int | None:
    """vLLM's ``num_gpu_blocks`` (the pool, null block included) from ``vllm:cache_config_info``."""
    labels = info_labels(text, CACHE_CONFIG_INFO) or {}
    try:
        return int(labels["num_gpu_blocks"])
    except (KeyError, ValueError):
        return None


Buckets = list[tuple[float, float]]  # (upper bound ``le``, cumulative count), +Inf last


@dataclass
class HistogramDelta:
    """What a Prometheus histogram gained over a run: cumulative bucket counts
    and the sum of the observations."""

    buckets: Buckets
    sum: float

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0


def histogram_from_exposition(text: str, name: str) -> HistogramDelta | None:
    """Histogram ``name``'s buckets and sum, each summed over its label sets
    (engines); None when the server does not expose it."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    total = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + float(sample.value)
            elif sample.name == f"{name}_sum":
                total = (total or 0.0) + float(sample.value)
    if not buckets or total is None:
        return None
    return HistogramDelta(sorted(buckets.items()), total)


def histogram_delta(before: HistogramDelta | None, after: HistogramDelta | None) -> HistogramDelta | None:
    """``after - before`` per bucket. A histogram born during the run started
    from 0; one absent at the end, with other buckets, or that went down (the
    server restarted) is unknown (None)."""
    if after is None:
        return None
    if before is None:
        return after
    old = dict(before.buckets)
    if set(old) != {bound for bound, _ in after.buckets}:
        return None
    buckets = [(bound, count - old[bound]) for bound, count in after.buckets]
    if any(count < 0 for _, count in buckets):
        return None
    return HistogramDelta(buckets, after.sum - before.sum)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (0 <= q <= 1) of the observations in cumulative
    ``buckets``, as Prometheus's ``histogram_quantile`` estimates it: the bucket
    that holds rank q x count, with the observations taken as spread evenly
    inside it (linear interpolation from the bucket's lower bound, 0 for the
    first bucket, to its upper bound). A rank in the +Inf bucket gives the
    highest finite bound (Prometheus's answer too). None without observations."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    ordered = sorted(buckets)
    if not ordered or not math.isinf(ordered[-1][0]):
        raise ValueError("a histogram's buckets end with le=+Inf")
    observations = ordered[-1][1]
    if observations <= 0:
        return None
    rank = q * observations
    # The first bucket reaching the rank (q = 0: the first that holds any).
    index = next(i for i, (_, count) in enumerate(ordered)
                 if (count >= rank and count > 0) or i == len(ordered) - 1)
    if index == len(ordered) - 1:
        return ordered[-2][0] if len(ordered) > 1 else None
    upper, count = ordered[index]
    lower, below = ordered[index - 1] if index > 0 else (0.0, 0.0)
    if index == 0 and upper <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / (count - below)


@dataclass
class MetricSample:
    """One scrape: seconds since the load started, and the series (None when absent)."""

    t: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # fraction of the usable pool
    preemptions: float | None = None  # cumulative
    blocks_held: float | None = None  # kvevict_blocks_held (servers with eviction)


def sample_from_values(values: dict[str, float], t: float) -> MetricSample:
    return MetricSample(t, values.get(RUNNING), values.get(WAITING), values.get(KV_USAGE),
                        values.get(PREEMPTIONS), values.get(BLOCKS_HELD))


def counter_delta(before: float | None, after: float | None) -> float | None:
    """Increase of a counter over the run. A counter that first appears during the
    run (a label set created on its first increment) started from 0; one absent at
    the end is unknown (None)."""
    if after is None:
        return None
    return after - (before or 0.0)


# ---------------------------------------------------------------- statistics


def outstanding_mask(times: Sequence[float], intervals: Sequence[tuple[float, float]]) -> np.ndarray:
    """For each time, whether some request was outstanding (sent, not yet answered)."""
    t = np.asarray(times, dtype=float)[:, None]
    if not intervals or t.size == 0:
        return np.zeros(len(times), dtype=bool)
    spans = np.asarray(intervals, dtype=float)
    return ((t >= spans[None, :, 0]) & (t <= spans[None, :, 1])).any(axis=1)


@dataclass
class SampleSummary:
    """The metric samples taken while some request was outstanding."""

    max_running: float | None = None
    mean_running: float | None = None
    max_waiting: float | None = None
    kv_usage_peak: float | None = None
    kv_usage_mean: float | None = None
    kv_blocks_peak: float | None = None
    kv_blocks_mean: float | None = None
    blocks_held_peak: float | None = None
    samples: int = 0


def usage_to_blocks(usage: float | None, pool_blocks: int | None) -> float | None:
    """vLLM's usage fraction in blocks: it divides by the usable blocks (pool - null block)."""
    if usage is None or pool_blocks is None:
        return None
    return usage * (pool_blocks - 1)


def summarize_samples(samples: Sequence[MetricSample], intervals: Sequence[tuple[float, float]],
                      pool_blocks: int | None = None) -> SampleSummary:
    """Max and mean of the series over the samples inside the load (means are over
    samples, which are evenly spaced in time)."""
    mask = outstanding_mask([s.t for s in samples], intervals)
    inside = [s for s, keep in zip(samples, mask) if keep]

    def series(attr: str) -> list[float]:
        return [getattr(s, attr) for s in inside if getattr(s, attr) is not None]

    def peak(values: list[float]) -> float | None:
        return max(values) if values else None

    def mean(values: list[float]) -> float | None:
        return float(np.mean(values)) if values else None

    running, usage = series("running"), series("kv_usage")
    return SampleSummary(
        max_running=peak(running), mean_running=mean(running),
        max_waiting=peak(series("waiting")),
        kv_usage_peak=peak(usage), kv_usage_mean=mean(usage),
        kv_blocks_peak=usage_to_blocks(peak(usage), pool_blocks),
        kv_blocks_mean=usage_to_blocks(mean(usage), pool_blocks),
        blocks_held_peak=peak(series("blocks_held")), samples=len(inside),
    )


# ---------------------------------------------------------------- records


@dataclass
class BenchResult:
    """One setting's figures: what the report's row, the CSV and the plots show."""

    name: str
    kept_fraction: float | None  # None: full cache (or a server given by URL)
    budget: int | None  # tokens per (layer, KV head)
    requests: int
    completed: int
    failed: int
    wall_s: float  # first request sent .. last answer received
    prompt_tokens: int  # of the completed requests
    completion_tokens: int
    output_throughput: float  # completion tokens / wall s
    total_throughput: float  # (prompt + completion tokens) / wall s
    max_running: float | None  # vllm:num_requests_running while requests were outstanding
    mean_running: float | None
    max_waiting: float | None
    preemptions: float | None  # vllm:num_preemptions_total, end - start
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    kv_usage_peak: float | None  # vllm:kv_cache_usage_perc (fraction)
    kv_usage_mean: float | None
    kv_blocks_peak: float | None  # usage x (pool - 1); None when the pool is unknown
    kv_blocks_mean: float | None
    blocks_held_peak: float | None  # kvevict_blocks_held
    pool_blocks: int | None  # vLLM's num_gpu_blocks, null block included
    request_throughput: float | None = None  # completed requests / wall s
    # kvevict_eviction_seconds over the run (end - start): steps of the first
    # worker that evicted, their eviction time in all, and p50/p99 of one step's
    # (all layers, every request evicting in it) estimated from the buckets.
    eviction_steps: float | None = None
    eviction_seconds: float | None = None
    eviction_p50_ms: float | None = None
    eviction_p99_ms: float | None = None
    errors: list[str] = field(default_factory=list)  # the first few failures


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def summarize_run(name: str, fraction: float | None, budget: int | None, load: LoadRun,
                  pool_blocks: int | None) -> BenchResult:
    """One setting's row: throughput over vLLM's benchmark duration, latency
    percentiles as vLLM's benchmark computed them, tokens over the completed
    requests, and the metric samples taken while some request was outstanding."""
    done = [r for r in load.requests if r["error"] is None]
    wall = load.figures.get("duration", 0.0)
    prompt = sum(r["prompt_tokens"] for r in done)
    completion = sum(r["completion_tokens"] for r in done)
    summary = summarize_samples(load.samples, [(r["send_s"], r["end_s"]) for r in load.requests],
                                pool_blocks)
    latency = {key: load.figures.get(key) if done else None
               for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")}
    eviction = load.eviction
    return BenchResult(
        name=name, kept_fraction=fraction, budget=budget, requests=len(load.requests),
        completed=len(done), failed=len(load.requests) - len(done), wall_s=wall,
        prompt_tokens=prompt, completion_tokens=completion,
        output_throughput=completion / wall if wall > 0 else 0.0,
        total_throughput=(prompt + completion) / wall if wall > 0 else 0.0,
        max_running=summary.max_running, mean_running=summary.mean_running,
        max_waiting=summary.max_waiting, preemptions=load.preemptions,
        ttft_p50_ms=latency["p50_ttft_ms"], ttft_p99_ms=latency["p99_ttft_ms"],
        itl_p50_ms=latency["p50_itl_ms"], itl_p99_ms=latency["p99_itl_ms"],
        kv_usage_peak=summary.kv_usage_peak, kv_usage_mean=summary.kv_usage_mean,
        kv_blocks_peak=summary.kv_blocks_peak, kv_blocks_mean=summary.kv_blocks_mean,
        blocks_held_peak=summary.blocks_held_peak, pool_blocks=pool_blocks,
        request_throughput=len(done) / wall if wall > 0 else 0.0,
        eviction_steps=None if eviction is None else eviction.count,
        eviction_seconds=None if eviction is None else eviction.sum,
        eviction_p50_ms=None if eviction is None else _ms(histogram_quantile(0.5, eviction.buckets)),
        eviction_p99_ms=None if eviction is None else _ms(histogram_quantile(0.99, eviction.buckets)),
        errors=[f"request {r['index']}: {r['error']}" for r in load.requests if r["error"]][:10],
    )


RATIO_FIELDS = ("max_running", "mean_running", "output_throughput", "total_throughput")
UNBOUNDED_RATIO_FIELDS = ("output_throughput", "request_throughput")


def ratios_vs(results: Sequence[BenchResult], reference: str,
              names: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """Per setting, each field in ``names`` divided by the ``reference`` row's
    ({} without that row)."""
    base = next((r for r in results if r.name == reference), None)
    if base is None:
        return {}
    ratios: dict[str, dict[str, float | None]] = {}
    for result in results:
        ratios[result.name] = {}
        for name in names:
            mine, theirs = getattr(result, name), getattr(base, name)
            ratios[result.name][name] = mine / theirs if mine is not None and theirs else None
    return ratios


def ratios_vs_full(results: Sequence[BenchResult]) -> dict[str, dict[str, float | None]]:
    """Per setting, each of RATIO_FIELDS divided by the ``full`` row's ({} without one)."""
    return ratios_vs(results, FULL, RATIO_FIELDS)


def ratios_vs_unbounded(results: Sequence[BenchResult]) -> dict[str, dict[str, float | None]]:
    """Per setting, output tokens/s and requests/s as a fraction of the
    ``full-unbounded`` row's: the same load without eviction and without a
    memory limit ({} without that row)."""
    return ratios_vs(results, FULL_UNBOUNDED, UNBOUNDED_RATIO_FIELDS)


# ---------------------------------------------------------------- rendering


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _kept(result: BenchResult) -> str:
    return "100%" if result.kept_fraction is None else f"{result.kept_fraction:.0%}"


def _blocks(result: BenchResult, blocks: float | None, usage: float | None) -> str:
    """Blocks when the pool is known, else vLLM's usage in %."""
    if result.pool_blocks is not None:
        return _fmt(blocks, 0)
    return _fmt(None if usage is None else usage * 100, 0, "%")


TABLE_HEADER = (
    "setting", "kept", "budget", "done/sent", "wall s", "out tok/s", "total tok/s",
    "max running", "mean running", "preempt", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
    "ITL p99 ms", "evict p50 ms", "evict p99 ms", "evict steps", "KV blocks peak",
    "KV blocks mean", "held peak", "pool", "running x full", "tok/s x full",
    "tok/s x unbounded", "req/s x unbounded",
)


def markdown_table(results: Sequence[BenchResult]) -> str:
    """One row per setting. KV blocks are vLLM's usage x (pool - 1); without a
    known pool they show as usage %. ``held peak`` is the plugin's count;
    ``evict`` columns the plugin's kvevict_eviction_seconds over the run."""
    ratios, unbounded = ratios_vs_full(results), ratios_vs_unbounded(results)
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    for r in results:
        ratio, wide = ratios.get(r.name, {}), unbounded.get(r.name, {})
        cells = [
            r.name, _kept(r), "-" if r.budget is None else str(r.budget),
            f"{r.completed}/{r.requests}", _fmt(r.wall_s), _fmt(r.output_throughput),
            _fmt(r.total_throughput), _fmt(r.max_running, 0), _fmt(r.mean_running),
            _fmt(r.preemptions, 0), _fmt(r.ttft_p50_ms, 0), _fmt(r.ttft_p99_ms, 0),
            _fmt(r.itl_p50_ms), _fmt(r.itl_p99_ms), _fmt(r.eviction_p50_ms, 2),
            _fmt(r.eviction_p99_ms, 2), _fmt(r.eviction_steps, 0),
            _blocks(r, r.kv_blocks_peak, r.kv_usage_peak), _blocks(r, r.kv_blocks_mean, r.kv_usage_mean),
            _fmt(r.blocks_held_peak, 0), "-" if r.pool_blocks is None else str(r.pool_blocks),
            _fmt(ratio.get("max_running"), 2, "x"), _fmt(ratio.get("output_throughput"), 2, "x"),
            _fmt(wide.get("output_throughput"), 2, "x"), _fmt(wide.get("request_throughput"), 2, "x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CSV_FIELDS = [f.name for f in fields(BenchResult) if f.name != "errors"]


def results_csv(results: Sequence[BenchResult]) -> str:
    """Every BenchResult field (empty for None) plus the ``x full`` and ``x
    unbounded`` ratios."""
    ratios, unbounded = ratios_vs_full(results), ratios_vs_unbounded(results)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*CSV_FIELDS, *(f"{name}_x_full" for name in RATIO_FIELDS),
                     *(f"{name}_x_unbounded" for name in UNBOUNDED_RATIO_FIELDS)])
    for r in results:
        row: list[Any] = []
        for name in CSV_FIELDS:
            value = getattr(r, name)
            row.append("" if value is None else round(value, 6) if isinstance(value, float) else value)
        ratio = ratios.get(r.name, {})
        row += ["" if ratio.get(name) is None else round(ratio[name], 6) for name in RATIO_FIELDS]
        wide = unbounded.get(r.name, {})
        row += ["" if wide.get(name) is None else round(wide[name], 6) for name in UNBOUNDED_RATIO_FIELDS]
        writer.writerow(row)
    return buffer.getvalue()


def plot_timeline(timelines: dict[str, Sequence[MetricSample]], path: Path,
                  pool_blocks: dict[str, int | None] | None = None) -> None:
    """Requests running and KV-cache usage (%) against time since the load
    started, one line per setting."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for name, samples in timelines.items():
        run = [(s.t, s.running) for s in samples if s.running is not None]
        usage = [(s.t, s.kv_usage * 100) for s in samples if s.kv_usage is not None]
        if run:
            top.plot(*zip(*run), label=name, drawstyle="steps-post")
        if usage:
            pool = (pool_blocks or {}).get(name)
            label = name if pool is None else f"{name} (pool {pool} blocks)"
            bottom.plot(*zip(*usage), label=label)
    top.set_ylabel("requests running")
    top.set_title("vllm:num_requests_running")
    bottom.set_ylabel("KV cache used (%)")
    bottom.set_title("vllm:kv_cache_usage_perc")
    bottom.set_xlabel("seconds since the requests were sent")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if timelines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=PNG_DPI)
    plt.close(fig)


# ---------------------------------------------------------------- workload


SYSTEM_PROMPT = (
    "You are the archive's assistant. The documents below come from one archive; answer "
    "questions about them exactly, quoting numbers digit by digit, and say so when a "
    "document does not contain the answer. "
)


def shared_system_prompt(tokenizer: Any, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens, the same for every request."""
    rules = " ".join(
        f"Rule {i}: records of shelf {i} date from {1700 + 3 * i} and are filed under "
        f"{['red', 'green', 'blue', 'grey'][i % 4]} tabs." for i in range(1, 4 * tokens)
    )
    ids = tokenizer(SYSTEM_PROMPT + rules).input_ids[:tokens]
    return tokenizer.decode(ids) + "\n\n"


def build_prompts(tokenizer: Any, count: int, prompt_tokens: int, seed: int,
                  shared_prefix_tokens: int = 0) -> list[str]:
    """``count`` passkey prompts of about ``prompt_tokens`` tokens, each from its own
    seed (key and needle depth). Each starts with its own session number, so no two
    share a first block and prefix caching cannot serve one from another; with
    ``shared_prefix_tokens``, each starts with the same system prompt of that many
    tokens (the session number and document follow)."""
    from vllm_kvevict.evaluation.tasks import needle_prompt

    system = shared_system_prompt(tokenizer, shared_prefix_tokens) if shared_prefix_tokens else ""
    prompts = []
    for index in range(count):
        rng = random.Random(f"kvevict-bench:{seed}:{index}")
        key = rng.randint(10_000, 99_999)
        header = f"Session {rng.randint(10_000_000, 99_999_999)}. "
        document = needle_prompt(tokenizer, key, prompt_tokens - shared_prefix_tokens, rng.random())
        prompts.append(system + header + document)
    return prompts


class MetricSampler(threading.Thread):
    """Scrapes ``/metrics`` every ``interval`` seconds until stopped."""

    def __init__(self, url: str, clock0: float, interval: float = 0.25) -> None:
        super().__init__(daemon=True, name="kvevict-bench-sampler")
        self.url = url
        self.clock0 = clock0
        self.interval = interval
        self.samples: list[MetricSample] = []
        self.errors = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            start = time.perf_counter()
            try:
                text = scrape(self.url, timeout=max(2.0, 8 * self.interval))
                middle = (start + time.perf_counter()) / 2 - self.clock0
                self.samples.append(sample_from_values(parse_metrics(text), middle))
            except (requests.RequestException, ValueError):
                self.errors += 1
            self._stop_event.wait(max(0.0, self.interval - (time.perf_counter() - start)))

    def stop(self) -> list[MetricSample]:
        self._stop_event.set()
        self.join()
        return self.samples


def wait_idle(url: str, timeout: float = 300, poll: float = 0.5) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits; return the last values.
    A server without vLLM's gauges is taken as idle."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            values = scrape_metrics(url)
        except requests.HTTPError:
            return {}  # no /metrics: nothing to wait for (and no server-side figures)
        if not values.get(RUNNING) and not values.get(WAITING):
            return values
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} still busy after {timeout:.0f}s: "
                               f"{values.get(RUNNING)} running, {values.get(WAITING)} waiting")
        time.sleep(poll)


def settled_histogram(url: str, name: str, pause: float = 0.5, tries: int = 10) -> HistogramDelta | None:
    """Histogram ``name`` once two scrapes ``pause`` seconds apart agree: the
    workers write their series at most every 0.25 s, and at the end when their
    requests are released, which can come just after vLLM's gauges read idle."""
    previous = None
    for _ in range(tries):
        try:
            current = histogram_from_exposition(scrape(url), name)
        except requests.HTTPError:
            return None
        if current is None or current == previous:
            return current
        previous = current
        time.sleep(pause)
    return previous


@dataclass
class LoadRun:
    requests: list[dict[str, Any]]  # per request: times since the load started, tokens, error
    figures: dict[str, Any]  # vLLM's benchmark(): duration, throughput, TTFT and ITL percentiles
    samples: list[MetricSample]
    preemptions: float | None
    pool_blocks: int | None  # from vllm:cache_config_info, when the server exposes it
    eviction: HistogramDelta | None = None  # kvevict_eviction_seconds, end - start


def request_records(figures: dict[str, Any], max_tokens: Sequence[int], clock0: float) -> list[dict[str, Any]]:
    """vLLM's per-request lists as one record per request, in seconds since the
    load started; a request that returned another number of tokens than it
    asked for (``max_tokens``, per request in load order) failed."""
    records = []
    for index, (start, ttft, itl, latency, prompt, completion, error, asked) in enumerate(zip(
            figures["start_times"], figures["ttfts"], figures["itls"], figures["latencies"],
            figures["input_lens"], figures["output_lens"], figures["errors"], max_tokens, strict=True)):
        error = error.strip().splitlines()[-1][:300] if error else None
        if error is None and completion != asked:
            error = f"{completion} completion tokens, asked {asked}"
        send = start - clock0
        records.append({"index": index, "send_s": send, "first_token_s": send + ttft if ttft else None,
                        "end_s": send + latency, "itl": itl, "prompt_tokens": prompt,
                        "completion_tokens": completion, "error": error})
    return records


def run_load(url: str, load: Sequence[Any], concurrency: int, tokenizer: Any, interval: float = 0.25,
             idle_timeout: float = 300, progress: bool = True) -> LoadRun:
    """Wait for an idle server, run vLLM's serving benchmark over ``load`` (its
    ``SampleRequest``s, ``concurrency`` at a time, greedy, ``ignore_eos``) while
    sampling ``/metrics``, wait for idle again."""
    from vllm.benchmarks.serve import TaskType, benchmark

    model, _ = served_model(url)
    before = wait_idle(url, idle_timeout)
    try:
        text = scrape(url)
    except requests.HTTPError:
        text = ""
    evicted_before = histogram_from_exposition(text, EVICTION_SECONDS)
    clock0 = time.perf_counter()
    sampler = MetricSampler(url, clock0, interval)
    sampler.start()
    try:
        figures = asyncio.run(benchmark(
            task_type=TaskType.GENERATION, endpoint_type="openai", api_url=url + "/v1/completions",
            base_url=url, model_id=model, model_name=model, tokenizer=tokenizer,
            input_requests=list(load), logprobs=None, request_rate=float("inf"), burstiness=1.0,
            disable_tqdm=not progress, num_warmups=0, profile=False,
            selected_percentile_metrics=["ttft", "itl", "e2el"], selected_percentiles=[50, 99],
            ignore_eos=True, goodput_config_dict={}, max_concurrency=concurrency,
            lora_modules=None, extra_headers=None, extra_body={"temperature": 0},
            ready_check_timeout_sec=0))
        after = wait_idle(url, idle_timeout)
        evicted_after = settled_histogram(url, EVICTION_SECONDS)
    finally:
        samples = sampler.stop()
    records = request_records(figures, [r.expected_output_len for r in load], clock0)
    figures = {k: v for k, v in figures.items() if not isinstance(v, list)}
    return LoadRun(records, figures, samples, counter_delta(before.get(PREEMPTIONS), after.get(PREEMPTIONS)),
                   pool_blocks_from_exposition(text), histogram_delta(evicted_before, evicted_after))


# ---------------------------------------------------------------- results file


class ResultStore:
    """results.json: per setting name, its parameters, result, requests and samples."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.runs: dict[str, dict[str, Any]] = {}
        if path.exists():
            data = json.loads(path.read_text())
            self.runs = {run["name"]: run for run in data.get("runs", [])}

    @staticmethod
    def normalize(params: dict[str, Any]) -> dict[str, Any]:
        return json.loads(json.dumps(params, sort_keys=True))

    def get(self, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
        run = self.runs.get(name)
        return run if run is not None and run["params"] == self.normalize(params) else None

    def put(self, name: str, params: dict[str, Any], result: BenchResult, load: LoadRun) -> None:
        self.runs[name] = {
            "name": name, "params": self.normalize(params), "result": asdict(result),
            "requests": load.requests, "vllm_benchmark": load.figures,
            "samples": [asdict(s) for s in load.samples],
            # kvevict_eviction_seconds over the run: [le, cumulative count], the sum.
            "eviction_histogram": None if load.eviction is None else {
                "buckets": [[_le(bound), count] for bound, count in load.eviction.buckets],
                "sum": load.eviction.sum},
        }
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"version": 1, "runs": list(self.runs.values())}, indent=1))
        tmp.replace(self.path)

    def matching(self, workload: dict[str, Any]) -> list[dict[str, Any]]:
        """The stored runs of the same workload (any server), in the order first run."""
        wanted = self.normalize(workload)
        return [run for run in self.runs.values() if run["params"].get("workload") == wanted]


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes ``le`` (``+Inf``; JSON has no infinity)."""
    return "+Inf" if math.isinf(bound) else repr(bound)


def result_from_json(data: dict[str, Any]) -> BenchResult:
    result = BenchResult(**{k: v for k, v in data.items() if k in {f.name for f in fields(BenchResult)}})
    if result.request_throughput is None:  # stored before the column existed
        result.request_throughput = result.completed / result.wall_s if result.wall_s > 0 else 0.0
    return result


def samples_from_json(data: Iterable[dict[str, Any]]) -> list[MetricSample]:
    return [MetricSample(**s) for s in data]


def write_outputs(out: Path, runs: Sequence[dict[str, Any]], header: str) -> str:
    """results.md, results.csv, timeline.png; returns the Markdown table."""
    results = [result_from_json(run["result"]) for run in runs]
    table = markdown_table(results)
    errors = [line for r in results for line in (f"{r.name}: {e}" for e in r.errors)]
    text = header + "\n\n" + table + "\n"
    if errors:
        text += "\nFailed requests (first ones):\n\n" + "\n".join(f"- {e}" for e in errors) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.csv").write_text(results_csv(results))
    plot_timeline({run["name"]: samples_from_json(run["samples"]) for run in runs},
                  out / "timeline.png", {r.name: r.pool_blocks for r in results})
    return table


# ---------------------------------------------------------------- command


def _read_model_config(model: str) -> dict[str, Any] | None:
    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def managed_server_args(args: argparse.Namespace, max_model_len: int) -> list[str]:
    """The flags every managed server gets before eviction, pool size and
    ``--server-args`` (which come last, so they override these)."""
    return [
        "--dtype", args.dtype, "--block-size", str(args.block_size),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(max_model_len), "--enforce-eager",
    ]


def plan_pool(model_config: dict[str, Any] | None, effective_args: Sequence[str],
              max_prompt_tokens: int, max_tokens: int, pool_blocks: int | None = None,
              memory_bytes: int | None = None, full_requests: int = 4) -> tuple[int | None, int]:
    """(pool blocks, ``--kv-cache-memory-bytes``) of the managed servers.

    Block bytes come from the model's config.json at the effective ``--dtype``,
    ``--kv-cache-dtype`` and ``--block-size`` (``effective_args``: our flags with
    the extra ones after them). An explicit memory size wins; the pool is then
    what it buys (None when the model's block size is unknown).
    """
    block_size = int(flag_value(effective_args, "--block-size") or DEFAULT_BLOCK_SIZE)
    explicit = flag_value(effective_args, "--kv-cache-memory-bytes")
    memory_bytes = int(explicit) if explicit is not None else memory_bytes
    block_bytes = None
    if model_config is not None:
        element = dtype_bytes(flag_value(effective_args, "--dtype") or "float32",
                              flag_value(effective_args, "--kv-cache-dtype"))
        block_bytes = kv_block_bytes(model_config, block_size, element)
    if memory_bytes is not None:
        return (memory_bytes // block_bytes if block_bytes else pool_blocks), memory_bytes
    if block_bytes is None:
        raise ValueError("the model has no config.json to size the KV pool from; "
                         "pass --kv-cache-memory-bytes")
    pool = pool_blocks or default_pool_blocks(max_prompt_tokens, max_tokens, block_size, full_requests)
    return pool, kv_cache_memory_bytes(pool, block_bytes)


@dataclass
class PlannedRun:
    """A setting with the parameters that identify its result in results.json."""

    setting: ServingSetting
    params: dict[str, Any]
    budget: int | None = None
    server_args: list[str] | None = None  # None: a running server (url)
    pool_blocks: int | None = None


def plan_managed(args: argparse.Namespace, settings: Sequence[ServingSetting], model: str,
                 workload: dict[str, Any], lengths: Sequence[int]) -> list[PlannedRun]:
    """Every managed server's flags, with budgets and the pool checked up front."""
    extra = shlex.split(args.server_args or "")
    block_size = int(flag_value(extra, "--block-size") or args.block_size)
    longest, mean_prompt = max(lengths), float(np.mean(lengths))
    max_model_len = -(-(longest + args.max_tokens + 64) // block_size) * block_size
    base = managed_server_args(args, max_model_len)
    pool, memory = plan_pool(_read_model_config(model), [*base, *extra], longest, args.max_tokens,
                             args.pool_blocks, args.kv_cache_memory_bytes, args.pool_full_requests)
    need = blocks_per_request(longest, args.max_tokens, block_size)
    if pool is not None and pool - 1 < need and any(s.policy is None and not s.unbounded for s in settings):
        raise ValueError(f"a pool of {pool} blocks cannot hold one full request ({need} blocks + "
                         "vLLM's null block): raise --pool-blocks or drop the 'full' setting")
    wide = wide_memory = None
    if any(s.unbounded for s in settings):
        if flag_value(extra, "--kv-cache-memory-bytes") is not None:
            raise ValueError(f"--server-args sets --kv-cache-memory-bytes for every server, and "
                             f"{FULL_UNBOUNDED} sizes its own pool: drop one of them")
        wide = unbounded_pool_blocks(longest, args.max_tokens, args.requests, block_size)
        try:
            _, wide_memory = plan_pool(_read_model_config(model), [*base, *extra], longest,
                                       args.max_tokens, wide)
        except ValueError:
            raise ValueError(f"{FULL_UNBOUNDED}: the model has no config.json to size a pool of "
                             f"{args.requests} requests from; drop {FULL_UNBOUNDED}") from None
    plans = []
    for setting in settings:
        size, setting_pool = (wide_memory, wide) if setting.unbounded else (memory, pool)
        server_args = [*base, "--kv-cache-memory-bytes", str(size)]
        budget = setting.budget(mean_prompt, block_size)
        eviction = eviction_config(setting, mean_prompt, block_size,
                                   context=f"setting {setting.name} at {mean_prompt:.0f} prompt tokens")
        if eviction is not None:
            server_args += ["--kv-eviction", setting.policy, "--kv-eviction-config", json.dumps(eviction)]
        # Prefix caching only where the setting asks for it ("+prefix").
        server_args.append("--enable-prefix-caching" if setting.prefix_caching else "--no-enable-prefix-caching")
        server_args += extra
        params = {"workload": workload, "model": model, "server_args": server_args}
        plans.append(PlannedRun(setting, params, budget, server_args, setting_pool))
    if not all(s.unbounded for s in settings):
        print(f"managed servers: KV pool {pool} blocks of {block_size} tokens "
              f"(--kv-cache-memory-bytes {memory}); one request needs {need} blocks in full", flush=True)
    if wide is not None:
        seqs = int(flag_value([*base, *extra], "--max-num-seqs"))
        cap = f"; vLLM runs at most {seqs} at once (--max-num-seqs)" if seqs < args.requests else ""
        print(f"{FULL_UNBOUNDED}: KV pool {wide} blocks (--kv-cache-memory-bytes {wide_memory}), "
              f"all {args.requests} requests in full{cap}", flush=True)
    return plans


def _workload(args: argparse.Namespace, tokenizer_source: str) -> dict[str, Any]:
    workload = {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens, "concurrency": args.concurrency, "seed": args.seed,
                "tokenizer": tokenizer_source}
    if args.shared_prefix_tokens:
        workload["shared_prefix_tokens"] = args.shared_prefix_tokens
    return workload


def build_parser() -> argparse.ArgumentParser:
    from vllm_kvevict.help_format import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="kvevict bench", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter, epilog=__doc__.split("\n\n", 1)[1],
    )
    target = parser.add_argument_group("what to benchmark")
    target.add_argument("--setting", action="append", default=[], metavar="SPEC",
                        help="'full', 'full-unbounded' (no eviction, in a KV pool that holds every "
                        "request: the reference of the x unbounded ratios), 'CONFIG@FRACTION' (a policy, a shipped config such as momentkv or "
                        "adakv_snapkv, or a .yaml/.json config path, kept at FRACTION of the prompt, "
                        "e.g. snapkv@0.25), 'CONFIG@TOKENS' "
                        "(a fixed budget): the tool serves these; or 'NAME=URL' (a running server; "
                        "the name 'full' or 'full-unbounded' makes it the reference of the x full "
                        "or x unbounded ratios); "
                        f"repeatable (default: {' '.join(DEFAULT_SETTINGS)})")
    add_kv_eviction_config_argument(target)
    target.add_argument("--model", default=None,
                        help="model the managed servers serve (default: the embedded SmolLM2)")
    target.add_argument("--tokenizer", default=None,
                        help="tokenizer the prompts are sized with (default: --model, or the "
                        "served model's path)")
    load = parser.add_argument_group("workload")
    load.add_argument("--requests", type=int, default=16, help="requests sent")
    load.add_argument("--prompt-tokens", type=int, default=4000, help="target prompt length")
    load.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    load.add_argument("--concurrency", type=int, default=None,
                      help="client threads (default: all requests at once)")
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts (keys, needle depths)")
    load.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                      help="every prompt starts with the same system prompt of N tokens (part of "
                      "--prompt-tokens), which settings with '+prefix' share through vLLM's prefix "
                      "cache, e.g. --setting full+prefix --setting snapkv@0.25 --setting "
                      "snapkv+prefix@0.25")
    server = parser.add_argument_group("managed servers")
    server.add_argument("--pool-blocks", type=int, default=None,
                        help="KV pool in blocks, vLLM's null block included (default: what "
                        "--pool-full-requests requests need in full); with NAME=URL, the pool of "
                        "that server (default: from vllm:cache_config_info)")
    server.add_argument("--pool-full-requests", type=int, default=4,
                        help="default pool: whole requests it holds without eviction")
    server.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="instead of sizing the pool from config.json (full-unbounded "
                        "sizes its own)")
    server.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    server.add_argument("--max-num-seqs", type=int, default=64,
                        help="high, so that the KV pool, not vLLM, limits concurrency")
    server.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="prefill chunk (tokens per engine step)")
    server.add_argument("--dtype", default="float32", help="model dtype (the CPU build's)")
    server.add_argument("--server-args", default="",
                        help="more vllm serve flags as one string, appended last (they override), e.g. "
                        "for a GPU: --server-args \"--dtype bfloat16 --gpu-memory-utilization 0.9\" "
                        "(one flag alone: --server-args=--enforce-eager)")
    server.add_argument("--ready-timeout", type=float, default=900,
                        help="seconds a managed server may take to start")
    run = parser.add_argument_group("run")
    run.add_argument("--out", type=Path, default=Path("kvevict-bench"), help="output folder")
    run.add_argument("--force", action="store_true", help="rerun settings already in results.json")
    run.add_argument("--sample-interval", type=float, default=0.25, help="seconds between scrapes")
    run.add_argument("--idle-timeout", type=float, default=300,
                     help="seconds to wait for the server to drain before and after")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("requests", "prompt_tokens", "max_tokens", "block_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    args.concurrency = args.concurrency or args.requests
    for flag in ("concurrency", "max_num_seqs", "max_num_batched_tokens", "pool_full_requests"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("sample_interval", "idle_timeout", "ready_timeout"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    try:
        extra = shlex.split(args.server_args)
    except ValueError as exc:
        parser.error(f"--server-args: {exc}; quote it as one shell string")
    block_size = int(flag_value(extra, "--block-size") or args.block_size)
    settings = parse_settings(parser, args.setting or list(DEFAULT_SETTINGS), args.kv_eviction_config,
                              block_size, unbounded=True)
    check_running_servers(parser, settings)
    if args.model is not None and not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: no such folder; give a local model folder "
                     "(`kvevict fetch-model` converts the default one)")

    model = args.model
    if model is None and any(s.managed for s in settings):
        from vllm_kvevict.default_model import fetch_default_model

        model = str(fetch_default_model())
    tokenizer_source = args.tokenizer or model
    if tokenizer_source is None:
        url = next(s.url for s in settings if s.url)
        _, root = served_model(url)
        if not root:
            parser.error("the server does not name its model's path: pass --tokenizer")
        tokenizer_source = root
    try:
        tokenizer = load_tokenizer(tokenizer_source)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot load the tokenizer {tokenizer_source!r} ({exc}); pass --tokenizer "
                     "with a local copy of the served model's tokenizer")
    if not 0 <= args.shared_prefix_tokens < args.prompt_tokens:
        parser.error(f"--shared-prefix-tokens {args.shared_prefix_tokens} must be in [0, "
                     f"--prompt-tokens {args.prompt_tokens})")
    from vllm.benchmarks.datasets import SampleRequest

    prompts = build_prompts(tokenizer, args.requests, args.prompt_tokens, args.seed, args.shared_prefix_tokens)
    lengths = [len(tokenizer(p).input_ids) for p in prompts]
    inputs = [SampleRequest(prompt=p, prompt_len=n, expected_output_len=args.max_tokens)
              for p, n in zip(prompts, lengths)]
    mean_prompt = float(np.mean(lengths))
    print(f"{args.requests} prompts of {min(lengths)}..{max(lengths)} tokens "
          f"(mean {mean_prompt:.0f}), {args.max_tokens} output tokens each, "
          f"{args.concurrency} at a time", flush=True)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    store = ResultStore(out / "results.json")
    workload = _workload(args, tokenizer_source)

    managed = [s for s in settings if s.managed]
    try:
        planned = {p.setting.name: p for p in plan_managed(args, managed, model, workload, lengths)} if managed else {}
    except ValueError as exc:
        parser.error(str(exc))
    plans = [planned.get(s.name) or PlannedRun(
        s, {"workload": workload, "url": s.url, "pool_blocks": args.pool_blocks},
        pool_blocks=args.pool_blocks) for s in settings]

    for plan in plans:
        setting = plan.setting
        if not args.force and store.get(setting.name, plan.params) is not None:
            print(f"{setting.name}: already in {store.path}, skipped (--force reruns it)", flush=True)
            continue
        if plan.server_args is None:
            load = run_load(setting.url, inputs, args.concurrency, tokenizer, args.sample_interval,
                            args.idle_timeout, not args.no_progress)
        else:
            load = _run_managed(setting, model, plan.server_args, inputs, tokenizer, args, out)
        pool_blocks = plan.pool_blocks or load.pool_blocks
        if plan.server_args is not None and load.pool_blocks not in (None, plan.pool_blocks):
            print(f"{setting.name}: vLLM reports a pool of {load.pool_blocks} blocks, "
                  f"{plan.pool_blocks} expected; reporting vLLM's", flush=True)
            pool_blocks = load.pool_blocks
        result = summarize_run(setting.name, setting.fraction, plan.budget, load, pool_blocks)
        store.put(setting.name, plan.params, result, load)
        evicted = (f", eviction p50 {result.eviction_p50_ms:.2f} ms a step over "
                   f"{result.eviction_steps:.0f} steps" if result.eviction_p50_ms is not None else "")
        print(f"{setting.name}: {result.completed}/{result.requests} done in {result.wall_s:.1f}s, "
              f"{result.output_throughput:.1f} output tok/s, up to {_fmt(result.max_running, 0)} "
              f"running at once{evicted}", flush=True)

    runs = store.matching(workload)
    header = (f"{args.requests} streaming requests of ~{mean_prompt:.0f} prompt tokens "
              f"(target {args.prompt_tokens}) and {args.max_tokens} output tokens, "
              f"{args.concurrency} at a time, seed {args.seed}; running = "
              f"vllm:num_requests_running while requests were outstanding; KV blocks = "
              f"vllm:kv_cache_usage_perc x (pool - 1); TTFT, ITL: vLLM's serving benchmark; "
              f"evict = one model step's eviction work (all layers, every request evicting in "
              f"that step) from {EVICTION_SECONDS}, p50/p99 interpolated in its buckets, over "
              f"the steps that evicted; x unbounded = fraction of {FULL_UNBOUNDED} (no eviction, "
              f"a KV pool for all {args.requests} requests).")
    table = write_outputs(out, runs, header)
    print("\n" + header + "\n\n" + table)
    print(f"\nwritten to {out}/ (results.md, results.csv, results.json, timeline.png)",
          flush=True)
    return 0 if all(run["result"]["failed"] == 0 for run in runs) else 1


def _run_managed(setting: ServingSetting, model: str, server_args: list[str], load: Sequence[Any],
                 tokenizer: Any, args: argparse.Namespace, out: Path) -> LoadRun:
    """Start ``vllm serve`` for one setting, run the load, stop it."""
    work = out / "servers" / setting.name.replace("/", "_")
    work.mkdir(parents=True, exist_ok=True)
    print(f"{setting.name}: starting vllm serve (log: {work / 'server.log'})", flush=True)
    server = VllmServer(model, server_args, stats_path=work / "stats.json", log_path=work / "server.log")
    try:
        server.wait_ready(timeout=args.ready_timeout)
        return run_load(server.url, load, args.concurrency, tokenizer, args.sample_interval,
                        args.idle_timeout, not args.no_progress)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
