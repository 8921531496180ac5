"""The step plan of every evicting attention backend: built once per step by
the metadata builder (:class:`EvictingBuilder`), read by each layer's forward
(:mod:`~vllm_kvevict.plugin.backends.evicting_impl`).

A backend (``backends/cpu``, ``backends/triton``) subclasses vLLM's metadata
builder for its platform and mixes in :class:`EvictingBuilder`, which turns
the scheduler's batch into one :class:`EvictionStepPlan` per step: the
eviction points each request reaches (from :mod:`vllm_kvevict.schedule`),
its side-buffer rows and its live blocks.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_kvevict.config import EvictionConfig, KVEvictionConfigError, config_from_additional
from vllm_kvevict.eviction.point import EvictionPoint, LayerEviction, ObservationRows
from vllm_kvevict.eviction.select import KeepRule
from vllm_kvevict.metrics import WORKER_METRICS, ProcessMetrics
from vllm_kvevict.schedule import EvictionSchedule
from vllm_kvevict.triton_kernels.batch import HeadPagedBatch
from vllm_kvevict.plugin.worker.isolation_check import PoisonFreedBlocks, StepObserver
from vllm_kvevict.plugin.worker.runner_hooks import (
    BatchContext,
    building_dummy_run,
    current_batch,
    install_runner_hooks,
    on_requests_finished,
)
from vllm_kvevict.plugin.snapshot import STATS_PATH_ENV, SnapshotWriter
from vllm_kvevict.plugin.vllm_fixes import install_cpu_seeded_sampling_fix
from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec, is_plain_full_attention
from vllm_kvevict.plugin.worker.side_buffers import side_buffer_layout
from vllm_kvevict.plugin.worker.worker_state import WorkerEvictionState, adopt_worker_state

# A child of vLLM's logger: its lines carry vLLM's format, level and handler.
logger = init_logger(f"vllm.{__name__}")

Storage = Literal["slots", "head_pages", "global"]
Kernel = Literal["native", "torch", "triton"]

# The worker's VllmConfig, remembered when the attention layers are built:
# vLLM asks customize_spec() later, outside any set_current_vllm_config().
_worker_vllm_config: VllmConfig | None = None


def remember_worker_config() -> None:
    global _worker_vllm_config
    _worker_vllm_config = get_current_vllm_config_or_none() or _worker_vllm_config


def worker_vllm_config() -> VllmConfig | None:
    return get_current_vllm_config_or_none() or _worker_vllm_config


def active_config(vllm_config: VllmConfig | None = None) -> EvictionConfig | None:
    vllm_config = vllm_config or worker_vllm_config()
    if vllm_config is None:
        return None
    return config_from_additional(vllm_config.additional_config)


def metric_labels(vllm_config: VllmConfig, config: EvictionConfig) -> dict[str, str]:
    """The labels of every kvevict_ series, as vLLM labels its own."""
    name = vllm_config.model_config.served_model_name
    return {
        "model_name": name if isinstance(name, str) else str(name[0]),
        "engine": str(vllm_config.parallel_config.data_parallel_rank),
        "policy": config.policy,
    }


def evicting_spec(spec: AttentionSpec) -> AttentionSpec:
    """A backend's ``customize_spec``: the full-attention spec made evicting
    when eviction is on."""
    vllm_config = worker_vllm_config()
    config = active_config(vllm_config)
    if config is None:
        return spec
    if not is_plain_full_attention(spec):
        raise KVEvictionConfigError(
            f"--kv-eviction supports full-attention decoder layers only, and this model "
            f"has {type(spec).__name__} layers; serve it without --kv-eviction"
        )
    assert vllm_config is not None
    config.check_block_size(spec.block_size)
    return EvictingAttentionSpec.from_full_attention(
        spec,
        config.schedule(spec.block_size, vllm_config.scheduler_config.max_num_batched_tokens),
        max_step_tokens=vllm_config.max_in_flight_tokens,
        metric_labels=tuple(metric_labels(vllm_config, config).items()),
    )


@dataclass
class EvictionStepPlan:
    """Per-step eviction work, built once and shared by every layer."""

    rule: KeepRule
    storage: Storage
    kernel: Kernel
    schedule: EvictionSchedule
    state: WorkerEvictionState
    observer: StepObserver
    layer_index: dict[str, int]
    layer_names: list[str]  # by layer index
    kv_head_replicas: int  # ranks holding a copy of each of this rank's KV heads
    first_replica_rank: int
    block_table: torch.Tensor  # unshifted, [num_reqs, max_blocks], on the cache's device
    query_start: list[int]
    seq_lens: list[int]
    frontier_before: list[int]
    protected_prefix: list[int]  # per request: the slots [0, p) never evicted (live: [0, p) and [frontier, n))
    evictions: list[EvictionPoint]  # per request, in point order
    ring_tokens: torch.Tensor | None  # batch token indices whose queries are kept
    ring_slots: torch.Tensor | None  # their flat (row, pos % window) slots
    state_rows: torch.Tensor  # [num_reqs] each request's state row
    region_start: torch.Tensor  # [num_reqs] head_pages: standard region start at step start
    region_start_host: list[int]  # the same, on the host
    local_kv_heads: torch.Tensor  # this rank's KV heads among the model's
    backend_data: Any = None  # what the backend's kernels need (the CPU page layout)
    num_evictions: int = 0  # (request, point) pairs that drop tokens
    eviction_seconds: float = 0.0  # summed over layers as they run
    # Pooled layers (storage global) with a query-based policy: each layer's
    # observation queries per (layer, batch index), kept from its forward for
    # the ranking after the last layer.
    pooled_queries: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Where each wave's observation queries are (key: the wave, or -1 for the
    # pooled layers' last compacting points), found at the first layer.
    observation_rows: dict[int, ObservationRows] = field(default_factory=dict)
    # head_pages or slots on a cache that compacts in place, every point at the
    # step's end: whether each layer's evictions wait for the last layer, to run
    # as one batch of every layer (decided at the first layer), and those waiting:
    # (layer index, the layer's cache, its evictions, their compacted lengths,
    # none with slots).
    defers_to_step_end: bool | None = None
    deferred: list[tuple[int, Any, list[LayerEviction], list[list[int]]]] = field(default_factory=list)
    deferred_offsets: list[int] = field(default_factory=list)  # each waiting layer's blocks in the pool
    _device_lengths: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _first_lengths: list[list[list[int]]] | None = None

    @property
    def waves(self) -> list[list[EvictionPoint]]:
        """The step's eviction points, each request's first ones together,
        then its second ones...: a layer hands the engine one wave at a time
        (the requests' points are independent; a request's next point comes
        after its previous one)."""
        waves: list[list[EvictionPoint]] = []
        reached: dict[int, int] = {}
        for ev in self.evictions:
            rank = reached[ev.batch_index] = reached.get(ev.batch_index, -1) + 1
            if rank == len(waves):
                waves.append([])
            waves[rank].append(ev)
        return waves

    def compacted_lengths(self, layer_index: int, wave: int) -> list[list[int]] | None:
        """head_pages: the compacted tokens per KV head of the first wave's
        compacting requests in layer ``layer_index``, as the engine sizes
        their gathers with. One read of every layer's, at the step's first
        compaction (a layer's lengths change only at its own compactions);
        None after the first wave (the engine reads them itself)."""
        if wave:
            return None
        if self._first_lengths is None:
            rows = [ev.state_row for ev in self.waves[0] if ev.compacts] if self.waves else []
            lens = self.state.head_lens
            self._first_lengths = torch.stack([lens[:, row] for row in rows], 1).tolist() if rows else []
        return self._first_lengths[layer_index] if self._first_lengths else None

    def device_lengths(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query_start``, ``seq_lens`` and ``frontier_before`` as int32
        tensors on ``device``: one copy per step, shared by every layer."""
        if self._device_lengths is None:
            host = torch.tensor(self.query_start + self.seq_lens + self.frontier_before, dtype=torch.int32)
            if device.type == "cuda":
                host = host.pin_memory()
            moved = host.to(device, non_blocking=True)
            n = len(self.seq_lens)
            self._device_lengths = (moved[: n + 1], moved[n + 1 : 2 * n + 1], moved[2 * n + 1 :])
        return self._device_lengths

    def slots_region_start(self) -> list[int]:
        """slots storage, for the head-paged kernels: where each request's
        standard region starts: its frontier, or 0 while a query of the step
        lies in its protected prefix (nothing is evicted then; from its end
        on the kernels read the prefix before the region)."""
        starts = []
        for i, (prefix, frontier) in enumerate(zip(self.protected_prefix, self.frontier_before)):
            n_before = self.seq_lens[i] - (self.query_start[i + 1] - self.query_start[i])
            starts.append(frontier if n_before >= prefix else 0)
        return starts

    def head_paged_batch(
        self, layer_index: int, requests: slice, query_start: list[int] | torch.Tensor,
        seq_lens: list[int] | torch.Tensor, region_start: torch.Tensor, block_offset: int,
        device: torch.device,
    ) -> HeadPagedBatch:
        """What the head-paged attention kernels read for the batch's
        ``requests`` in one layer (with slots storage: no compacted tokens).
        A request reads its protected prefix from the block table once its
        standard region starts after it."""
        state = self.state
        rows = self.state_rows[requests]
        region_start = region_start.to(device=device, dtype=torch.int32)
        prefix_lens = None
        if any(self.protected_prefix):
            prefix = torch.tensor(self.protected_prefix[requests], dtype=torch.int32, device=device)
            prefix_lens = torch.where(region_start >= prefix, prefix, 0)
        if self.storage == "slots":
            num_requests = len(seq_lens)
            page_table = torch.zeros(num_requests, state.num_kv_heads, 1, dtype=torch.int32, device=device)
            head_lens = torch.zeros(num_requests, state.num_kv_heads, dtype=torch.int32, device=device)
        else:
            page_table = state.head_pages[layer_index].index_select(0, rows)
            head_lens = state.head_lens[layer_index].index_select(0, rows)
        moments = state.moments[layer_index] if state.moments else None
        return HeadPagedBatch(
            head_page_table=page_table,
            head_lens=head_lens,
            query_start_loc=torch.as_tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.as_tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=self.block_table[: len(self.seq_lens)][requests].to(torch.int32) + block_offset,
            region_start=region_start,
            moments=moments,
            moment_rows=rows.to(torch.int32) if moments is not None else None,
            prefix_lens=prefix_lens,
        )

    @property
    def last_compactions(self) -> dict[int, EvictionPoint]:
        """Each request's last compacting point of the step, by batch index:
        where pooled layers are ranked (once, after the last layer)."""
        return {ev.batch_index: ev for ev in self.evictions if ev.compacts}

    @property
    def max_region_len(self) -> int:
        """A host-side bound on any head's live tokens in this step (compacted + standard)."""
        state = self.state
        compacted = state.max_head_pages * self.schedule.block_size if self.storage != "slots" else 0
        if any(self.protected_prefix):
            # the prefix, and a region that may start at 0 (slots) or at the
            # last compaction point (head_pages), below the frontier
            return compacted + max(self.protected_prefix) + max(self.seq_lens)
        return compacted + max(
            (n - f for n, f in zip(self.seq_lens, self.frontier_before)), default=0
        )


def host_seq_lens(cm: CommonAttentionMetadata) -> list[int]:
    """Each request's length after the step, without a device sync where vLLM
    keeps a host copy (exact without speculative decoding, which eviction
    refuses)."""
    upper_bound = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if upper_bound is not None:
        return upper_bound[: cm.num_reqs].tolist()
    return cm.seq_lens.cpu().tolist()


class EvictingBuilder:
    """Mixed into a backend's metadata builder: eviction state and the step plan."""

    config: EvictionConfig | None = None

    def init_eviction(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
        num_q_heads: int,
        kernel: Kernel,
    ) -> bool:
        """Set up eviction for an evicting spec; False (nothing set) otherwise."""
        if not isinstance(kv_cache_spec, EvictingAttentionSpec):
            return False
        config = active_config(vllm_config)
        assert config is not None
        self.config = config
        self.kernel: Kernel = kernel
        self.rule = KeepRule.from_config(config)
        policy = self.rule.policy
        self.schedule = kv_cache_spec.schedule
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.head_paged = config.uses_head_pages
        self.global_eviction = config.pools_layers
        self.storage: Storage = config.storage_name
        # The side buffers were allocated for --max-num-seqs rows when the
        # worker reported its KV-cache specs, before vLLM sized the KV pool;
        # adopt them (allocated here only where that did not happen).
        layout = side_buffer_layout(config, kv_cache_spec, len(layer_names), num_q_heads, vllm_config)
        self.state = adopt_worker_state(layout, device)
        if self.global_eviction:
            # log β sits beside every token slot of the pool, whose size vLLM
            # decides by measuring memory, so it cannot come before that: it is
            # allocated now, once the block count is known, before the pool.
            num_blocks = vllm_config.cache_config.num_gpu_blocks or 0
            self.state.reserve_log_beta(num_blocks * len(layer_names), kv_cache_spec.block_size)
        self.rule = dataclasses.replace(self.rule, on_fallback=self.state.record_fallback)
        self.observer = (
            PoisonFreedBlocks(kv_cache_spec.block_size, self.state.counters)
            if config.poisons_freed_blocks else StepObserver()
        )
        rank, world_size = _tensor_parallel_layout()
        # With more ranks than KV heads vLLM replicates each KV head on
        # consecutive ranks (see whole_query_group); fixed for the worker's life.
        total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self.kv_head_replicas = max(1, world_size // total_kv_heads)
        if policy.needs_output_projection and self.kv_head_replicas > 1:
            raise KVEvictionConfigError(
                f"policy {config.policy!r} reads each query head's output projection, and "
                f"with tensor parallel size {world_size} above the model's {total_kv_heads} "
                "KV heads a rank holds only part of a KV head's query heads; use a tensor "
                f"parallel size of at most {total_kv_heads}"
            )
        self.first_replica_rank = rank // self.kv_head_replicas * self.kv_head_replicas
        # With global eviction each rank ranks its own KV heads' streams.
        num_local = kv_cache_spec.num_kv_heads
        self.local_kv_heads = torch.arange(num_local) + rank // self.kv_head_replicas * num_local
        # Every rank applies the same evictions: rank 0 alone reports them (a
        # series exported twice with the same labels would be invalid), each
        # rank its own side buffers.
        self.state.metrics = ProcessMetrics(
            f"engine{vllm_config.parallel_config.data_parallel_rank}-worker{rank}",
            {k: v for k, v in WORKER_METRICS.items() if rank == 0 or "rank" in v.labels},
            metric_labels(vllm_config, config),
        )
        self.state.counts_evictions = rank == 0
        self.state.publish_side_buffers(str(rank))
        stats_path = os.environ.get(STATS_PATH_ENV)
        if stats_path:
            self.state.snapshot = SnapshotWriter(f"{stats_path}.worker{rank}")
            self.state.write_snapshot(force=True)
        install_runner_hooks()
        install_cpu_seeded_sampling_fix()
        on_requests_finished(self.state.release)
        on_requests_finished(self.observer.requests_released)
        return True

    def publish_attention_kernel(self, kernel: str) -> None:
        """``kvevict_attention_kernel_info{kernel}`` 1 for the kernel that serves
        this rank's evicting layers (vllm, cpp, torch or triton); from rank 0,
        the settings served: ``kvevict_config_info`` and one log line."""
        metrics = self.state.metrics
        if metrics is not None:
            metrics.get("kvevict_attention_kernel_info", rank=self.state.rank_label, kernel=kernel).set(1)
            if self.state.counts_evictions:
                metrics.get("kvevict_config_info", **self.config.info_labels(kernel)).set(1)
            metrics.export(force=True)
        if self.state.counts_evictions:  # one line per engine and kernel
            logger.info_once("KV eviction: %s", self.config.summary(kernel))

    def step_batch(self, cm: CommonAttentionMetadata) -> BatchContext | None:
        """The requests of the step whose metadata is being built, or None
        where nothing is evicted: eviction off, or one of vLLM's dummy and
        profiling runs.

        With eviction on, a real step must be planned: run without its plan,
        attention would read blocks the scheduler has already freed. A step
        whose requests cannot be known (the model runner's hook did not run,
        or its batch is not the metadata's) stops the engine with the reason
        rather than serve wrong text.
        """
        if self.config is None or building_dummy_run():
            return None
        batch = current_batch()
        if batch is None or len(batch.req_ids) != cm.num_reqs:
            found = "no batch" if batch is None else f"{len(batch.req_ids)} requests"
            raise RuntimeError(
                f"vllm-kvevict: attention metadata for {cm.num_reqs} requests was built with "
                f"{found} from vLLM's model runner, so the step cannot be evicted as the "
                "scheduler planned; this vLLM build calls its attention backend in a way "
                "vllm-kvevict does not support (serve without --kv-eviction)"
            )
        return batch

    def segment_backend_data(
        self, cm: CommonAttentionMetadata, batch_index: int, first_token: int,
        start: int, end: int, prefix: int, frontier: int,
    ) -> Any:
        """What the backend needs to attend one request's tokens ``[start,
        end)`` over ``[0, prefix)`` and ``[frontier, end)`` after an eviction
        point; stored in the point's ``backend_data``. None by default."""
        return None

    def plan_step(
        self, cm: CommonAttentionMetadata, batch: BatchContext, backend_data: Any = None
    ) -> EvictionStepPlan:
        """The step's eviction points, side-buffer rows and standard regions,
        each request on its own schedule (:meth:`WorkerEvictionState.request_schedule`)."""
        query_start = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        seq_lens = host_seq_lens(cm)
        window = self.state.query_window
        frontier_before: list[int] = []
        prefixes: list[int] = []
        evictions: list[EvictionPoint] = []
        ring_tokens: list[torch.Tensor] = []
        ring_slots: list[torch.Tensor] = []
        rows: list[int] = []
        region_starts: list[int] = []
        for i, req_id in enumerate(batch.req_ids):
            prompt_len = int(batch.prompt_lens[i])
            n_after = seq_lens[i]
            n_before = n_after - (query_start[i + 1] - query_start[i])
            row = self.state.row(req_id)
            schedule = self.state.request_schedule(
                req_id, self.schedule, batch.extra_args[i] if batch.extra_args else None
            )
            frontier = schedule.frontier(n_before, prompt_len)
            prefix = schedule.protected_prefix(prompt_len)
            frontier_before.append(frontier)
            prefixes.append(prefix)
            rows.append(row)
            region = int(self.state.region_start[row]) if self.head_paged else 0
            region_starts.append(region)
            points = schedule.eviction_points_in_step(n_before, n_after, prompt_len)
            if len(points) > 1:
                self.state.counters.multi_point_steps += 1
            last_point = schedule.last_eviction_point(n_before, prompt_len)
            for k, point in enumerate(points):
                frontier_after = schedule.frontier_at_point(point, prompt_len)
                segment_end = points[k + 1] if k + 1 < len(points) else n_after
                compacts = frontier_after > frontier
                segment_data = None
                if segment_end > point:
                    segment_data = self.segment_backend_data(
                        cm, i, query_start[i] + point - n_before, point, segment_end, prefix,
                        frontier_after,
                    )
                evictions.append(
                    EvictionPoint(
                        request_id=req_id,
                        batch_index=i,
                        state_row=row,
                        query_start=query_start[i],
                        tokens_before=n_before,
                        last_point_before=last_point,
                        frontier_before=frontier,
                        point=point,
                        frontier_after=frontier_after,
                        segment_end=segment_end,
                        compacts=compacts,
                        region_start=region,
                        protected_prefix=prefix,
                        backend_data=segment_data,
                    )
                )
                last_point, frontier = point, frontier_after
                if compacts:
                    region = point
            if self.head_paged:
                self.state.region_start[row] = region
                record = self.state.last_compaction.setdefault(req_id, {})
                record["tokens"] = n_after
            self.state.retained_tokens[req_id] = max(n_after - frontier, 0) + min(n_after, prefix)
            # The blocks vLLM may keep in its prefix cache after the request
            # (the server's protected prefix, hashed even for a request that
            # opted out) are not the request's to poison.
            cached = self.schedule.protected_prefix(prompt_len)
            self.observer.request_planned(req_id, cm.block_table_tensor[i], max(frontier, cached), n_after)
            if window:
                first = max(n_before, n_after - window)
                positions = torch.arange(first, n_after)
                ring_tokens.append(query_start[i] + positions - n_before)
                ring_slots.append(row * window + positions % window)

        self.observer.step_planned()
        _check_live_blocks(
            cm.block_table_tensor, prefixes, frontier_before, seq_lens, self.schedule.block_size, batch.req_ids
        )
        device = self.state.device
        return EvictionStepPlan(
            rule=self.rule,
            storage=self.storage,
            kernel=self.kernel,
            schedule=self.schedule,
            state=self.state,
            observer=self.observer,
            layer_index=self.layer_index,
            layer_names=list(self.layer_index),
            kv_head_replicas=self.kv_head_replicas,
            first_replica_rank=self.first_replica_rank,
            block_table=cm.block_table_tensor,
            query_start=query_start,
            seq_lens=seq_lens,
            frontier_before=frontier_before,
            protected_prefix=prefixes,
            evictions=evictions,
            ring_tokens=torch.cat(ring_tokens).to(device) if ring_tokens else None,
            ring_slots=torch.cat(ring_slots).to(device) if ring_slots else None,
            state_rows=torch.tensor(rows, dtype=torch.int64, device=device),
            region_start=torch.tensor(region_starts, dtype=torch.int64, device=device),
            region_start_host=region_starts,
            local_kv_heads=self.local_kv_heads.to(device),
            backend_data=backend_data,
            num_evictions=sum(ev.frontier_after > ev.frontier_before for ev in evictions),
        )


def _check_live_blocks(
    block_table: torch.Tensor, prefix: list[int], frontier: list[int], seq_lens: list[int],
    block_size: int, req_ids: list[str],
) -> None:
    """Every block a request reads this step, its protected prefix's and from
    its frontier's block to its last token's, must be a real block: vLLM's
    null block (id 0) there means the scheduler freed what the worker is
    about to read (the two disagree on the schedule). One comparison over the
    batch's block table."""
    num_reqs = len(seq_lens)
    if not num_reqs:
        return
    table = block_table[:num_reqs]
    columns = torch.arange(table.shape[1], device=table.device)
    first = torch.tensor(frontier, device=table.device) // block_size
    end = (torch.tensor(seq_lens, device=table.device) + block_size - 1) // block_size
    prefix_end = torch.minimum(torch.tensor(prefix, device=table.device) // block_size, end)
    live = ((columns >= first[:, None]) | (columns < prefix_end[:, None])) & (columns < end[:, None])
    null = (table == 0) & live
    if bool(null.any()):
        request = req_ids[int(null.any(dim=1).nonzero()[0])]
        raise RuntimeError(
            f"vllm-kvevict: request {request} would read a block the scheduler freed (vLLM's "
            "null block inside its live range): the scheduler and the worker disagree on the "
            "eviction schedule; this is a bug in vllm-kvevict, please report it"
        )


def _tensor_parallel_layout() -> tuple[int, int]:
    """(rank, world size) of tensor parallelism; (0, 1) outside a worker."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):  # no model-parallel group (unit use)
        return 0, 1


def whole_query_group(
    queries: torch.Tensor, replicas: int, first_replica_rank: int
) -> torch.Tensor:
    """This rank's observation queries, ``[Hq_local, W, D]``, completed to every
    query head that shares its KV head.

    With more ranks than KV heads vLLM replicates each KV head on ``r`` ranks,
    and each replica holds only ``G / r`` of the ``G`` query heads that attend
    to it. A query-based policy scoring with those alone would keep different
    tokens on each replica (and not those of TP=1). The replicas of one KV head
    are consecutive ranks holding consecutive query heads, so gathering them
    rebuilds the group in order. Every rank runs the same evictions in the
    same order (they follow from the scheduler's output), so the collective
    cannot deadlock.
    """
    from vllm.distributed import get_tp_group

    gathered = get_tp_group().all_gather(queries.contiguous(), dim=0)  # [Hq_total, W, D]
    local = queries.shape[0]
    return gathered[first_replica_rank * local : (first_replica_rank + replicas) * local]
