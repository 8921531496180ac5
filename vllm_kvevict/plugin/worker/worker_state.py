"""Worker side: per-request side buffers that live beside the KV cache.

* ``positions[layer, row, head, i]``: original position of the token in slot
  ``frontier + i`` of the compacted part of the region (slots below the last
  eviction point). Slots at or after the last eviction point hold new tokens,
  whose position is their slot. Needed for the sinks, the causal mask of the
  observation queries, and every position-aware policy.
* ``query_ring[layer, row, pos % W]``: the last ``W`` post-RoPE queries, for
  query-based policies (SnapKV's observation window at decode time).

Every buffer has one row per sequence vLLM may run at once
(``--max-num-seqs``), allocated once before vLLM sizes the KV pool (see
:mod:`~vllm_kvevict.plugin.worker.side_buffers`) and never grown or shrunk.
Rows are assigned per request id and go back to the pool when the request
finishes, is aborted or is preempted. A request that starts over (new, or
recomputed after preemption) gets a row and rewrites it from position 0, and
nothing reads a row beyond what the current run has written, so rows need no
clearing.

With ``head_pages`` storage each row also has, per layer, its KV heads' page
tables (``head_pages [L, rows, H, max_pages]`` head-page ids, ``head_lens [L,
rows, H]`` compacted tokens), the first slot of its standard region (the last
point at which it compacted) and, with the MomentKV correction, the moments
of every token each head has evicted. These are reset when a row is assigned.

The counters (rows, side-buffer bytes, and the isolation check's poisoned
blocks and NaN outputs) are published for tests and tools through a
:class:`~vllm_kvevict.plugin.snapshot.SnapshotWriter`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvevict.eviction.point import StreamRows
from vllm_kvevict.metrics import ProcessMetrics
from vllm_kvevict.moments import Covariance, EvictedMoments
from vllm_kvevict.request_settings import request_schedule
from vllm_kvevict.schedule import EvictionSchedule, Schedule
from vllm_kvevict.plugin.worker.side_buffers import (
    LOG_BETA_DTYPE,
    PAGE_DTYPE,
    POSITION_DTYPE,
    REGION_START_DTYPE,
    SideBufferLayout,
    allocating,
    allocation_error,
    log_beta_error,
    side_buffer_layout,
)
from vllm_kvevict.plugin.snapshot import SnapshotWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM's format, level and handler


@dataclass
class WorkerCounters:
    """What this worker's eviction state holds and has done, for tests and tools."""

    rows_in_use: int = 0
    rows_allocated: int = 0
    side_buffer_bytes: int = 0
    blocks_poisoned: int = 0
    nan_outputs: int = 0
    # (request, step) pairs whose step crossed two or more eviction points.
    multi_point_steps: int = 0
    # (request, layer) evictions that fell back to sinks + most recent, by reason.
    fallbacks: dict[str, int] = field(default_factory=dict)


class WorkerEvictionState:
    """One worker's side buffers (one row per sequence, allocated once) and
    the bookkeeping around them: which request holds which row, counters,
    metrics."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        retained_capacity: int,
        query_window: int,
        query_dtype: torch.dtype,
        device: torch.device,
        max_head_pages: int = 0,
        moment_correction: bool = False,
        moment_covariance: Covariance = "full",
        rows: int = 8,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.retained_capacity = retained_capacity
        self.query_window = query_window
        self.query_dtype = query_dtype
        self.device = device
        # head_pages storage (max_head_pages > 0): see the module docstring.
        self.max_head_pages = max_head_pages
        self.moment_correction = moment_correction
        self.moment_covariance = moment_covariance
        self.head_pages = torch.empty(0, dtype=PAGE_DTYPE)
        self.head_lens = torch.empty(0, dtype=PAGE_DTYPE)
        self.region_start = torch.empty(0, dtype=REGION_START_DTYPE)
        self.moments: list[EvictedMoments] = []
        # Global eviction (head_budget global): every layer's cache seen as one
        # pool of blocks, so a head's page table may name pages of any layer,
        # and the log β of every cached token, one fp32 per head-page slot.
        self.global_cache: torch.Tensor | None = None  # [total_blocks, H, 2 * bs, D]
        self.layer_block_offset: dict[int, int] = {}
        self._log_beta_pool: int | None = None  # the pool (its storage) the log β pages were zeroed for
        self.log_beta_pages = torch.empty(0, dtype=LOG_BETA_DTYPE)  # [total_blocks * H, bs]
        # Per request: (point, frontier, head_lens [L, H]) of its last compaction;
        # kept for the last few finished requests (tests and tools).
        self.last_compaction: dict[str, dict] = {}
        self._compactions: list[tuple[dict, int, torch.Tensor]] = []  # this step's, read at its end
        self.recent_requests: list[dict] = []
        self.row_of: dict[str, int] = {}
        # Each running request's schedule, from its extra
        # arguments; dropped with its row and rebuilt, the same, on resumption.
        self.schedules: dict[str, Schedule] = {}
        self.num_rows = rows
        self.free_rows = list(range(rows - 1, -1, -1))
        self.positions = torch.empty(0, dtype=POSITION_DTYPE)
        self.query_ring = torch.empty(0)
        self.counters = WorkerCounters()
        # Prometheus series (set by the metadata builder) and the tokens each
        # running request keeps per head (n - frontier) after its last step.
        self.metrics: ProcessMetrics | None = None
        self.counts_evictions = False
        self.retained_tokens: dict[str, int] = {}
        self._rank_label = "0"
        self.snapshot = SnapshotWriter(None)
        self._allocate(rows)

    @classmethod
    def from_layout(cls, layout: SideBufferLayout, device: torch.device) -> WorkerEvictionState:
        return cls(
            layout.num_layers, layout.num_kv_heads, layout.num_q_heads, layout.head_dim,
            layout.retained_capacity, layout.query_window, layout.query_dtype, device,
            max_head_pages=layout.max_head_pages, moment_correction=layout.moment_correction,
            moment_covariance=layout.moment_covariance, rows=layout.rows,
        )

    @property
    def layout(self) -> SideBufferLayout:
        """The shapes this state was allocated with."""
        return SideBufferLayout(
            self.num_layers, self.num_kv_heads, self.num_q_heads, self.head_dim, self.num_rows,
            self.retained_capacity, self.query_window, self.query_dtype, self.max_head_pages,
            self.moment_correction, self.moment_covariance,
        )

    def _allocate(self, rows: int) -> None:
        """Every side buffer at its full size, ``rows`` rows (zeroed, so the
        memory is committed now rather than at first use)."""
        layers, heads = self.num_layers, self.num_kv_heads
        self.positions = torch.zeros(
            (layers, rows, heads, self.retained_capacity), dtype=POSITION_DTYPE, device=self.device
        )
        if self.query_window:
            self.query_ring = torch.zeros(
                (layers, rows, self.query_window, self.num_q_heads, self.head_dim),
                dtype=self.query_dtype,
                device=self.device,
            )
        if self.max_head_pages:
            self.head_pages = torch.zeros(
                (layers, rows, heads, self.max_head_pages), dtype=PAGE_DTYPE, device=self.device
            )
            self.head_lens = torch.zeros((layers, rows, heads), dtype=PAGE_DTYPE, device=self.device)
            # Read on the host when each step is planned.
            self.region_start = torch.zeros(rows, dtype=REGION_START_DTYPE)
            if self.moment_correction:
                self.moments = [
                    EvictedMoments.zeros(
                        rows, heads, self.head_dim, self.device, covariance=self.moment_covariance
                    )
                    for _ in range(layers)
                ]
        self.counters.rows_allocated = rows
        self._count_side_buffers()

    def _count_side_buffers(self) -> None:
        buffers = [
            self.positions, self.query_ring, self.head_pages, self.head_lens, self.region_start,
            self.log_beta_pages,
        ]
        for moments in self.moments:
            buffers += [moments.count, moments.key_mean, moments.value_mean, moments.cross_cov]
        self.counters.side_buffer_bytes = sum(t.numel() * t.element_size() for t in buffers)
        if self.metrics is not None:
            self.publish_side_buffers(self._rank_label)

    def reserve_log_beta(self, total_blocks: int, block_size: int) -> None:
        """Pooled layers: the log β pages of a KV pool of ``total_blocks``
        blocks over every layer (zeroed), allocated once the pool's size is
        known and before the pool itself, so a pool they do not fit beside
        fails at start-up. :meth:`global_kv` reuses them."""
        shape = (total_blocks * self.num_kv_heads, block_size)
        if total_blocks <= 0 or tuple(self.log_beta_pages.shape) == shape:
            return
        nbytes = shape[0] * block_size * LOG_BETA_DTYPE.itemsize
        self.log_beta_pages = torch.empty(0, dtype=LOG_BETA_DTYPE)
        with allocating(nbytes, self.device, lambda reason: log_beta_error(
            nbytes, total_blocks * block_size, self.num_kv_heads, self.device, reason
        )):
            self.log_beta_pages = torch.zeros(shape, dtype=LOG_BETA_DTYPE, device=self.device)
        self._count_side_buffers()

    def _reset_head_pages(self, row: int) -> None:
        self.head_lens[:, row] = 0
        self.region_start[row] = 0
        for moments in self.moments:
            moments.reset(row)

    def global_kv(
        self, layer_index: int, kv_cache: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, int]:
        """Every layer's cache as one tensor of blocks (:meth:`pool_view`),
        and where layer ``layer_index``'s start, with the pooled layers' log
        β pages sized to it (zeroed when the pool is new)."""
        whole, offset = self.pool_view(layer_index, kv_cache)
        if whole is None:
            raise RuntimeError(
                "head_budget 'global' or 'pyramid' needs every layer's KV cache as a dense view of one "
                "allocation at a whole-block offset; this vLLM build lays it out otherwise"
            )
        if self._log_beta_pool != whole.untyped_storage().data_ptr():
            self._log_beta_pool = whole.untyped_storage().data_ptr()
            num_heads, total = kv_cache.shape[1], whole.shape[0]
            if tuple(self.log_beta_pages.shape) == (total * num_heads, block_size):
                self.log_beta_pages.zero_()  # reserved at start-up for this pool
            else:
                self.log_beta_pages = torch.empty(0, dtype=LOG_BETA_DTYPE)
                self.log_beta_pages = torch.zeros(
                    total * num_heads, block_size, dtype=LOG_BETA_DTYPE, device=kv_cache.device
                )
                self._count_side_buffers()
        return whole, offset

    def pool_view(self, layer_index: int, kv_cache: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """Every layer's cache as one tensor of blocks, and where layer
        ``layer_index``'s start; ``(None, 0)`` where the layers do not lie so.

        vLLM 0.32 places all layers in one allocation (``allocate_kv_cache``),
        each a dense ``[num_blocks, ...]`` view (the backend's view of a
        block, ``H`` head-pages of ``block_size`` tokens) at its own offset,
        so block ``b`` of that layer is block ``offset + b`` of the whole.
        """
        block_elems = kv_cache[0].numel()
        offset = kv_cache.storage_offset()
        if not kv_cache.is_contiguous() or offset % block_elems:
            return None, 0
        storage = kv_cache.untyped_storage()
        if self.global_cache is None or self.global_cache.untyped_storage().data_ptr() != storage.data_ptr():
            total = storage.nbytes() // kv_cache.element_size() // block_elems
            flat = torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device)
            flat.set_(storage, 0, (total * block_elems,))
            self.global_cache = flat.view(total, *kv_cache.shape[1:])
            self.layer_block_offset = {}
        self.layer_block_offset[layer_index] = offset // block_elems
        return self.global_cache, offset // block_elems

    @property
    def rank_label(self) -> str:
        """This worker's tensor-parallel rank, as its labelled series name it."""
        return self._rank_label

    def publish_side_buffers(self, rank: str) -> None:
        self._rank_label = rank
        if self.metrics is not None:
            self.metrics.get("kvevict_side_buffer_bytes", rank=rank).set(
                self.counters.side_buffer_bytes
            )
            self.metrics.export(force=True)

    def end_step(self, evictions: int, seconds: float) -> None:
        """After the last layer of a step: publish what the step did."""
        self._read_compactions()
        metrics = self.metrics
        if metrics is None:
            return
        if self.counts_evictions:
            if evictions:
                metrics.get("kvevict_eviction_events").inc(evictions)
                metrics.get("kvevict_eviction_seconds").observe(seconds)
            self._publish_retained()
        metrics.export()

    def record_fallback(self, reason: str) -> None:
        """One (request, layer) eviction kept sinks + most recent tokens
        instead of the policy's choice (the policy raised or scored NaN)."""
        self.counters.fallbacks[reason] = self.counters.fallbacks.get(reason, 0) + 1
        if self.metrics is not None and self.counts_evictions:
            self.metrics.get("kvevict_eviction_fallbacks", reason=reason).inc()
        self.write_snapshot(force=True)

    def observe_head_retained(self, counts: list[int]) -> None:
        """Tokens each KV head kept at one eviction of one layer."""
        if self.metrics is not None:
            histogram = self.metrics.get("kvevict_head_retained_tokens", rank=self._rank_label)
            for count in counts:
                histogram.observe(count)

    def _publish_retained(self) -> None:
        # Tokens per KV head, averaged over the layer's heads: every layer
        # keeps the same total (per-head budgets split it differently across
        # heads, which kvevict_head_retained_tokens shows).
        total = sum(self.retained_tokens.values())
        assert self.metrics is not None
        for layer in range(self.num_layers):
            self.metrics.get("kvevict_layer_retained_tokens", layer=str(layer)).set(total)

    def row(self, req_id: str) -> int:
        """The side-buffer row of ``req_id``, assigned at its first step."""
        row = self.row_of.get(req_id)
        if row is None:
            if not self.free_rows:
                raise RuntimeError(
                    f"no free side-buffer row for request {req_id!r}: all {self.num_rows} rows "
                    f"(--max-num-seqs) are held by requests that have not finished, "
                    f"but vLLM never runs more than --max-num-seqs sequences at once: a finished "
                    f"request's row was not released"
                )
            row = self.free_rows.pop()
            self.row_of[req_id] = row
            if self.max_head_pages:
                self._reset_head_pages(row)
            self.counters.rows_in_use = len(self.row_of)
            self.write_snapshot()
        return row

    def request_schedule(
        self, req_id: str, server: EvictionSchedule, extra_args: dict[str, Any] | None
    ) -> Schedule:
        """The request's schedule, as the scheduler's
        manager computes it from the same extra arguments."""
        if req_id not in self.schedules:
            self.schedules[req_id] = request_schedule(server, extra_args)
        return self.schedules[req_id]

    def release(self, req_ids: set[str]) -> None:
        """Requests that finished, were aborted or were preempted: free their rows."""
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.free_rows.append(row)
            self.retained_tokens.pop(req_id, None)
            self.schedules.pop(req_id, None)
            compaction = self.last_compaction.pop(req_id, None)
            if compaction is not None:
                self.recent_requests.append({"request_id": req_id, **compaction})
                del self.recent_requests[:-16]
        self.counters.rows_in_use = len(self.row_of)
        self.write_snapshot(force=True)
        if self.metrics is not None:
            if self.counts_evictions:
                self._publish_retained()
            self.metrics.export(force=True)

    def stream_rows(self, layer_index: int, row: int) -> StreamRows:
        """Views of one request's side buffers in one layer, for the eviction engine."""
        return StreamRows(
            positions=self.positions[layer_index, row],
            pages=self.head_pages[layer_index, row] if self.max_head_pages else None,
            lens=self.head_lens[layer_index, row] if self.max_head_pages else None,
            moments=self.moments[layer_index].row(row) if self.moments else None,
        )

    def record_compaction(
        self, request_id: str, point: int, frontier: int, layer_index: int, counts: torch.Tensor
    ) -> None:
        """Tokens each KV head of one layer kept at a compaction (tests and
        metrics), ``[H]`` on the device: read back with the step's others,
        in one read, when the step ends (:meth:`end_step`)."""
        record = self.last_compaction.setdefault(request_id, {})
        if record.get("point") != point:
            record.update(
                point=point, frontier=frontier, head_lens=[[] for _ in range(self.num_layers)]
            )
        self._compactions.append((record, layer_index, counts))

    def _read_compactions(self) -> None:
        if not self._compactions:
            return
        read = torch.stack([counts for _, _, counts in self._compactions]).tolist()
        for (record, layer_index, _), counts in zip(self._compactions, read):
            record["head_lens"][layer_index] = counts
            self.observe_head_retained(counts)
        self._compactions.clear()

    def write_snapshot(self, force: bool = False) -> None:
        """Publish the counters (throttled unless forced)."""
        self.snapshot.write(
            lambda: {**self.counters.__dict__, "recent_requests": self.recent_requests}, force
        )


# This worker's state, allocated when the worker reported its KV-cache specs
# (before vLLM sized the KV pool), for the metadata builders to adopt.
_preallocated: WorkerEvictionState | None = None


def allocate_worker_state(layout: SideBufferLayout, device: torch.device) -> WorkerEvictionState:
    """A state with every side buffer of ``layout`` allocated on ``device``;
    :class:`~vllm_kvevict.config.KVEvictionConfigError` (one line: the bytes
    needed, the formula's terms, the fix) when they do not fit."""
    with allocating(layout.nbytes, device, lambda reason: allocation_error(layout, device, reason)):
        return WorkerEvictionState.from_layout(layout, device)


def preallocate_worker_state(layout: SideBufferLayout, device: torch.device) -> WorkerEvictionState:
    """Allocate this worker's side buffers once; a later call with the same
    layout returns the same state."""
    global _preallocated
    state = _preallocated
    if state is not None and state.layout == layout and state.device == device:
        return state
    _preallocated = None  # free a state of another layout before allocating
    _preallocated = allocate_worker_state(layout, device)
    logger.info(
        "KV eviction side buffers: %.1f MiB on %s for %d sequences (--max-num-seqs), "
        "allocated before the KV cache is sized", layout.nbytes / (1 << 20), device, layout.rows,
    )
    return _preallocated


def adopt_worker_state(layout: SideBufferLayout, device: torch.device) -> WorkerEvictionState:
    """The state pre-allocated for ``layout`` (every metadata builder of the
    worker shares it: rows are keyed by request id); allocated now, at full
    size, where nothing was pre-allocated."""
    state = _preallocated
    if state is not None and not (state.layout == layout and state.device == device):
        logger.warning(
            "KV eviction side buffers were allocated for %s on %s but the KV cache groups need "
            "%s on %s; allocating them again, after vLLM sized the KV cache",
            state.layout, state.device, layout, device,
        )
    return preallocate_worker_state(layout, device)


def preallocate_for_kv_cache_specs(
    specs: dict[str, Any], vllm_config: VllmConfig, device: torch.device
) -> None:
    """Allocate the side buffers of the evicting layers among ``specs`` (the
    model runner's KV-cache specs, by layer name), for ``--max-num-seqs``
    rows. Runs after the model is loaded and before vLLM measures memory, so
    the KV pool is sized around them."""
    from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers

    from vllm_kvevict.config import config_from_additional
    from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec

    evicting = {name: spec for name, spec in specs.items() if isinstance(spec, EvictingAttentionSpec)}
    config = config_from_additional(vllm_config.additional_config)
    if not evicting or config is None:
        return
    layer_names = list(evicting)
    num_q_heads = get_num_attention_heads_from_layers(vllm_config, layer_names)
    if num_q_heads is None:
        return  # no attention layer registered under these names: the builders allocate
    spec = evicting[layer_names[0]]
    preallocate_worker_state(
        side_buffer_layout(config, spec, len(layer_names), num_q_heads, vllm_config), device
    )
