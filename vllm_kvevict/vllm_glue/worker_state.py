"""Worker side: per-request side buffers that live beside the KV cache.

* ``positions[layer, row, head, i]``: original position of the token in slot
  ``frontier + i`` of the compacted part of the region (slots below the last
  eviction point). Slots at or after the last eviction point hold new tokens,
  whose position is their slot. Needed for the sinks, the causal mask of the
  observation queries, and every position-aware policy.
* ``query_ring[layer, row, pos % W]``: the last ``W`` post-RoPE queries, for
  query-based policies (SnapKV's observation window at decode time).

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
:class:`~vllm_kvevict.vllm_glue.snapshot.SnapshotWriter`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.eviction.moments import Covariance, EvictedMoments
from vllm_kvevict.eviction.point import StreamRows
from vllm_kvevict.metrics import ProcessMetrics
from vllm_kvevict.vllm_glue.snapshot import SnapshotWriter


@dataclass
class WorkerCounters:
    """What this worker's eviction state holds and has done, for tests and tools."""

    rows_in_use: int = 0
    rows_allocated: int = 0
    side_buffer_bytes: int = 0
    blocks_poisoned: int = 0
    nan_outputs: int = 0


class WorkerEvictionState:
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
        self.head_pages = torch.empty(0, dtype=torch.int32)
        self.head_lens = torch.empty(0, dtype=torch.int32)
        self.region_start = torch.empty(0, dtype=torch.int64)
        self.moments: list[EvictedMoments] = []
        # Global eviction (head_budget global): every layer's cache seen as one
        # pool of blocks, so a head's page table may name pages of any layer,
        # and the log β of every cached token, one fp32 per head-page slot.
        self.global_cache: torch.Tensor | None = None  # [total_blocks, H, 2 * bs, D]
        self.layer_block_offset: dict[int, int] = {}
        self.log_beta_pages = torch.empty(0)  # [total_blocks * H, bs]
        # Per request: (point, frontier, head_lens [L, H]) of its last compaction;
        # kept for the last few finished requests (tests and tools).
        self.last_compaction: dict[str, dict] = {}
        self.recent_requests: list[dict] = []
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []
        self.num_rows = 0
        self.positions = torch.empty(0)
        self.query_ring = torch.empty(0)
        self.counters = WorkerCounters()
        # Prometheus series (set by the metadata builder) and the tokens each
        # running request keeps per head (n - frontier) after its last step.
        self.metrics: ProcessMetrics | None = None
        self.counts_evictions = False
        self.retained_tokens: dict[str, int] = {}
        self._rank_label = "0"
        self.snapshot = SnapshotWriter(None)
        self._grow(8)

    def _grow(self, num_rows: int) -> None:
        positions = torch.zeros(
            (self.num_layers, num_rows, self.num_kv_heads, self.retained_capacity),
            dtype=torch.int64,
            device=self.device,
        )
        if self.num_rows:
            positions[:, : self.num_rows] = self.positions
        self.positions = positions
        if self.query_window:
            ring = torch.zeros(
                (self.num_layers, num_rows, self.query_window, self.num_q_heads, self.head_dim),
                dtype=self.query_dtype,
                device=self.device,
            )
            if self.num_rows:
                ring[:, : self.num_rows] = self.query_ring
            self.query_ring = ring
        if self.max_head_pages:
            self._grow_head_pages(num_rows)
        self.free_rows.extend(range(num_rows - 1, self.num_rows - 1, -1))
        self.num_rows = num_rows
        self.counters.rows_allocated = num_rows
        self._count_side_buffers()

    def _count_side_buffers(self) -> None:
        buffers = [self.positions, self.query_ring, self.head_pages, self.head_lens, self.log_beta_pages]
        for moments in self.moments:
            buffers += [moments.count, moments.key_mean, moments.value_mean, moments.cross_cov]
        self.counters.side_buffer_bytes = sum(t.numel() * t.element_size() for t in buffers)
        if self.metrics is not None:
            self.publish_side_buffers(self._rank_label)

    def _grow_head_pages(self, num_rows: int) -> None:
        old = self.num_rows
        shape = (self.num_layers, num_rows, self.num_kv_heads)
        pages = torch.zeros((*shape, self.max_head_pages), dtype=torch.int32, device=self.device)
        lens = torch.zeros(shape, dtype=torch.int32, device=self.device)
        region_start = torch.zeros(num_rows, dtype=torch.int64)
        if old:
            pages[:, :old] = self.head_pages
            lens[:, :old] = self.head_lens
            region_start[:old] = self.region_start
        self.head_pages, self.head_lens, self.region_start = pages, lens, region_start
        if self.moment_correction:
            grown = []
            for layer in range(self.num_layers):
                moments = EvictedMoments.zeros(
                    num_rows, self.num_kv_heads, self.head_dim, self.device,
                    covariance=self.moment_covariance,
                )
                if old:
                    previous = self.moments[layer]
                    for name in ("count", "key_mean", "value_mean", "cross_cov"):
                        getattr(moments, name)[:old] = getattr(previous, name)
                grown.append(moments)
            self.moments = grown

    def _reset_head_pages(self, row: int) -> None:
        self.head_lens[:, row] = 0
        self.region_start[row] = 0
        for moments in self.moments:
            moments.reset(row)

    def global_kv(
        self, layer_index: int, kv_cache: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, int]:
        """Every layer's cache as one tensor of blocks, and where layer ``layer_index``'s start.

        vLLM 0.32 places all layers in one allocation (``allocate_kv_cache``),
        each a dense ``[num_blocks, ...]`` view (the backend's view of a
        block, ``H`` head-pages of ``block_size`` tokens) at its own offset,
        so block ``b`` of that layer is block ``offset + b`` of the whole.
        """
        num_blocks, num_heads = kv_cache.shape[:2]
        block_elems = kv_cache[0].numel()
        offset = kv_cache.storage_offset()
        if not kv_cache.is_contiguous() or offset % block_elems:
            raise RuntimeError(
                "head_budget 'global' or 'pyramid' needs every layer's KV cache as a dense view of one "
                "allocation at a whole-block offset; this vLLM build lays it out otherwise"
            )
        storage = kv_cache.untyped_storage()
        if self.global_cache is None or self.global_cache.untyped_storage().data_ptr() != storage.data_ptr():
            total = storage.nbytes() // kv_cache.element_size() // block_elems
            flat = torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device)
            flat.set_(storage, 0, (total * block_elems,))
            self.global_cache = flat.view(total, *kv_cache.shape[1:])
            self.log_beta_pages = torch.zeros(
                total * num_heads, block_size, dtype=torch.float32, device=kv_cache.device
            )
            self.layer_block_offset = {}
            self._count_side_buffers()
        self.layer_block_offset[layer_index] = offset // block_elems
        return self.global_cache, offset // block_elems

    def publish_side_buffers(self, rank: str) -> None:
        self._rank_label = rank
        if self.metrics is not None:
            self.metrics.get("kvevict_side_buffer_bytes", rank=rank).set(
                self.counters.side_buffer_bytes
            )
            self.metrics.export(force=True)

    def end_step(self, evictions: int, seconds: float) -> None:
        """After the last layer of a step: publish what the step did."""
        metrics = self.metrics
        if metrics is None:
            return
        if self.counts_evictions:
            if evictions:
                metrics.get("kvevict_eviction_events").inc(evictions)
                metrics.get("kvevict_eviction_seconds").observe(seconds)
            self._publish_retained()
        metrics.export()

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
        row = self.row_of.get(req_id)
        if row is None:
            if not self.free_rows:
                self._grow(self.num_rows * 2)
            row = self.free_rows.pop()
            self.row_of[req_id] = row
            if self.max_head_pages:
                self._reset_head_pages(row)
            self.counters.rows_in_use = len(self.row_of)
            self.write_snapshot()
        return row

    def release(self, req_ids: set[str]) -> None:
        """Requests that finished, were aborted or were preempted: free their rows."""
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.free_rows.append(row)
            self.retained_tokens.pop(req_id, None)
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
        self, request_id: str, point: int, frontier: int, layer_index: int, counts: list[int]
    ) -> None:
        """Tokens each KV head of one layer kept at a compaction (tests and metrics)."""
        record = self.last_compaction.setdefault(request_id, {})
        if record.get("point") != point:
            record.update(
                point=point, frontier=frontier, head_lens=[[] for _ in range(self.num_layers)]
            )
        record["head_lens"][layer_index] = counts
        self.observe_head_retained(counts)

    def write_snapshot(self, force: bool = False) -> None:
        """Publish the counters (throttled unless forced)."""
        self.snapshot.write(
            lambda: {**self.counters.__dict__, "recent_requests": self.recent_requests}, force
        )
