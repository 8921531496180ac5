"""The plugin's Prometheus series, and how they reach vLLM's ``/metrics``.

The values live where they are known: block accounting in the engine core's
:class:`~vllm_kvevict.plugin.scheduler.manager.EvictionManager`, eviction work in the
workers. Neither process serves ``/metrics``; the API server does. Two
transports, picked by the same switch vLLM uses:

* ``--api-server-count > 1``: vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` before it
  starts the engine, so ``prometheus_client`` values in every process are
  memory-mapped files that each API server's ``MultiProcessCollector``
  aggregates. The series are plain ``prometheus_client`` metrics.
* one API server (and offline ``LLM()``): the same metrics live in a private
  registry per process, whose exposition text is written to a file in
  ``KVEVICT_METRICS_DIR`` (a temporary directory the first process creates);
  the API server registers an :class:`ExportedMetricsCollector` that merges
  those files at scrape time.

Names start with ``kvevict_``: vLLM unregisters every collector whose name
starts with ``vllm:`` when its stat logger starts.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import REGISTRY, Collector

logger = logging.getLogger(__name__)

METRICS_DIR_ENV = "KVEVICT_METRICS_DIR"
BASE_LABELS = ("model_name", "engine", "policy")
# Eviction step times. 10 ms apart from 10 to 150 ms, where one decode step
# of a batch lies on a CPU and an eviction step is compared with it (with
# 25 ms buckets a p50 of 91 ms and an ITL of 85 ms fell in one bucket and
# could not be told apart), coarser up to 5 s.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09,
    0.1, 0.11, 0.12, 0.13, 0.14, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5,
    2.5, 5.0,
)
# Finer around typical budgets (a head keeps budget .. budget + block - 1 tokens).
TOKEN_BUCKETS = (
    32, 64, 128, 192, 256, 288, 320, 384, 512, 544, 576, 640, 768, 1024, 1056, 1088,
    1280, 1536, 2048, 2080, 2560, 3072, 4096, 4128, 6144, 8192, 16384, 32768,
)


# kvevict_requests_by_setting's settings: the server's, the request's own budget, off.
REQUEST_SETTING_LABELS = ("server", "own_budget", "off")
# kvevict_config_info's labels: EvictionConfig.info_labels.
CONFIG_INFO_LABELS = (
    "budget", "sink_tokens", "recent_window", "prefill_mode", "decode_interval", "storage",
    "head_budget", "moment_correction", "attention_kernel", "prefix_caching",
)


@dataclass(frozen=True)
class MetricDef:
    kind: str  # gauge | counter | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    # The values of a single label known in advance: those series exist at 0 from the start.
    label_values: tuple[str, ...] = ()


# Scheduler side (engine core): what requests hold.
ENGINE_METRICS = {
    "kvevict_logical_tokens": MetricDef(
        "gauge", "Tokens the running requests have processed (their logical context)."
    ),
    "kvevict_retained_tokens": MetricDef(
        "gauge", "Tokens the running requests keep per KV head after eviction."
    ),
    "kvevict_compression_ratio": MetricDef(
        "gauge", "kvevict_logical_tokens / kvevict_retained_tokens (1 when idle)."
    ),
    "kvevict_blocks_held": MetricDef(
        "gauge", "KV-cache blocks the running requests hold."
    ),
    "kvevict_protected_prefix_tokens": MetricDef(
        "gauge", "Tokens of the protected prompt prefixes the running requests hold "
        "(prefix_caching shared; each shared block counted once), on top of their budgets."
    ),
    "kvevict_blocks_held_without_eviction": MetricDef(
        "gauge", "KV-cache blocks the running requests would hold with every token they "
        "processed kept (their logical context in blocks): beside kvevict_blocks_held, the "
        "memory eviction saves.",
    ),
    "kvevict_blocks_freed": MetricDef(
        "counter", "KV-cache blocks returned to vLLM's pool by eviction while requests ran."
    ),
    "kvevict_tokens_evicted": MetricDef(
        "counter", "Tokens dropped from the running requests' contexts by eviction (per KV "
        "head; a preempted request that recomputes drops its tokens again)."
    ),
    "kvevict_requests_by_setting": MetricDef(
        "counter", "Requests admitted, by the eviction they run with: the server's settings, "
        "their own budget (kv_eviction_budget), or off (kv_eviction \"off\").",
        labels=("setting",), label_values=REQUEST_SETTING_LABELS,
    ),
    "kvevict_requests_admitted": MetricDef("counter", "Requests admitted (preempted ones again)."),
    "kvevict_requests_admitted_beyond_memory": MetricDef(
        "counter",
        "Requests admitted while their prompt's full KV cache exceeded the free blocks: "
        "without eviction they would have waited.",
    ),
}
# Worker side: eviction work. Counters and histograms come from rank 0 (every
# rank applies the same evictions); side buffers from every rank.
WORKER_METRICS = {
    "kvevict_eviction_events": MetricDef(
        "counter", "Evictions applied: a request reaching an eviction point that drops tokens."
    ),
    "kvevict_eviction_seconds": MetricDef(
        "histogram", "Worker time per model step spent evicting, all layers: scoring, selection and "
        "moving the kept tokens, not the attention of the step's tokens.",
        buckets=LATENCY_BUCKETS,
    ),
    "kvevict_side_buffer_bytes": MetricDef(
        "gauge", "Bytes allocated for per-request side buffers (positions, query ring, page "
        "tables, moments, log beta) on this rank; allocated at start-up for max_num_seqs rows.",
        labels=("rank",),
    ),
    "kvevict_layer_retained_tokens": MetricDef(
        "gauge", "Tokens the running requests keep in this layer (mean over its KV heads).",
        labels=("layer",),
    ),
    "kvevict_eviction_fallbacks": MetricDef(
        "counter", "(request, layer) evictions that kept the sinks and the most recent tokens "
        "instead of the policy's choice, because its scoring raised or gave non-finite scores.",
        labels=("reason",),
    ),
    "kvevict_config_info": MetricDef(
        "gauge", "1, labelled with the eviction settings this engine serves (policy, budget, "
        "prefill mode, decode interval, storage, head budget, moment correction, attention "
        "kernel, prefix caching): the start-up log line's settings.",
        labels=CONFIG_INFO_LABELS,
    ),
    "kvevict_attention_kernel_info": MetricDef(
        "gauge", "1 for the attention kernel serving this rank's evicting layers "
        "(vllm: vLLM's own; cpp: the plugin's C++ kernel; torch: the torch fallback; "
        "triton: the Triton kernels).",
        labels=("rank", "kernel"),
    ),
    "kvevict_head_retained_tokens": MetricDef(
        "histogram", "Tokens one (layer, KV head) of this rank keeps after an eviction.",
        labels=("rank",), buckets=TOKEN_BUCKETS,
    ),
}
METRIC_DEFS = {**ENGINE_METRICS, **WORKER_METRICS}


def _exposed_names(name: str, definition: MetricDef) -> list[str]:
    if definition.kind == "counter":
        return [f"{name}_total"]
    if definition.kind == "histogram":
        return [f"{name}_bucket", f"{name}_count", f"{name}_sum"]
    return [name]


# Every series name as scraped (counters with _total, histogram parts).
METRIC_NAMES = sorted(n for name, d in METRIC_DEFS.items() for n in _exposed_names(name, d))


def _multiprocess() -> bool:
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


class ProcessMetrics:
    """The series one process owns (engine core: ENGINE_METRICS; worker: WORKER_METRICS)."""

    def __init__(self, role: str, definitions: dict[str, MetricDef], labels: dict[str, str]):
        self.role = role
        self.labels = labels
        self.registry: CollectorRegistry | None = None if _multiprocess() else CollectorRegistry()
        self._dir = os.environ.get(METRICS_DIR_ENV)
        self._last_export = 0.0
        self._export_failed = False
        self._lock = threading.Lock()
        self.metrics: dict[str, Gauge | Counter | Histogram] = {}
        for name, definition in definitions.items():
            names = (*BASE_LABELS, *definition.labels)
            kwargs = {"registry": self.registry}
            if definition.kind == "gauge":
                # mostrecent: one engine core / rank writes each labelled series.
                metric = Gauge(name, definition.help, names, multiprocess_mode="mostrecent", **kwargs)
            elif definition.kind == "counter":
                metric = Counter(name, definition.help, names, **kwargs)
            else:
                metric = Histogram(name, definition.help, names, buckets=definition.buckets, **kwargs)
            self.metrics[name] = metric
            # Expose 0 from the start: a series that only appears on its
            # first event reads as "no data", not as zero.
            if not definition.labels:
                self.get(name)
            for value in definition.label_values:
                (label,) = definition.labels
                self.get(name, **{label: value})
        # Published at once: an engine started in a process where another one
        # ran (LLM() after LLM()) replaces that engine's series from its start,
        # instead of serving them as its own until its first export.
        self.export(force=True)

    def get(self, name: str, **labels: str):
        return self.metrics[name].labels(**self.labels, **labels)

    def export(self, force: bool = False) -> None:
        """Write this process's exposition for the API server (one-API-server mode)."""
        if self.registry is None or not self._dir:
            return
        now = time.monotonic()
        if not force and now - self._last_export < 0.25:
            return
        self._last_export = now
        text = generate_latest(self.registry)
        with self._lock:
            try:
                fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=".tmp-")
                with os.fdopen(fd, "wb") as handle:
                    handle.write(text)
                os.replace(tmp, os.path.join(self._dir, f"{self.role}.prom"))
            except OSError as exc:
                # A full disk or a removed directory costs the metrics, never
                # the engine: warn once, keep serving, try again next time.
                if not self._export_failed:
                    logger.warning("kvevict metrics: cannot write %s (%s); /metrics misses this "
                                   "process's kvevict_ series until it can", self._dir, exc)
                self._export_failed = True
            else:
                self._export_failed = False


class ExportedMetricsCollector(Collector):
    """Serves, at scrape time, the series the engine core and workers exported."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for path in sorted(self.directory.glob("*.prom")):
            try:
                text = path.read_text()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                if family.name.endswith("_created") or not family.name.startswith("kvevict_"):
                    continue
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                merged.samples.extend(s for s in family.samples if not s.name.endswith("_created"))
        yield from families.values()


_collector: ExportedMetricsCollector | None = None


def install_metrics_export() -> None:
    """Run in every process by ``register()``: the top process makes the directory.

    The processes vLLM starts (engine core, workers, extra API servers) are
    multiprocessing children and inherit ``KVEVICT_METRICS_DIR``; a top-level
    process (``vllm serve``, a program calling ``LLM()``) makes its own, even
    when it was started by a process that had one, serves the files, and
    removes the directory at exit.
    """
    global _collector
    if _collector is not None or _multiprocess():
        return
    import multiprocessing

    if multiprocessing.parent_process() is None or METRICS_DIR_ENV not in os.environ:
        directory = tempfile.mkdtemp(prefix="kvevict-metrics-")
        os.environ[METRICS_DIR_ENV] = directory
        atexit.register(shutil.rmtree, directory, True)
        _collector = ExportedMetricsCollector(directory)
        REGISTRY.register(_collector)
