"""The evicting attention backend for vLLM's CPU platform.

Registered over ``AttentionBackendEnum.CPU_ATTN`` (the CPU platform ignores
``--attention-backend`` but honours overrides). With eviction off every method
falls through to vLLM's own CPU backend.

With eviction on, each request's live tokens sit in the slots
``[frontier, seq_len)`` of its block-table row (see ``vllm_kvevict.schedule``):

* attention reads exactly that region: vLLM's C++ kernel through a block table
  and sequence lengths shifted by the (block-aligned) frontier, or the torch
  reference (``cpu_attention="torch"``);
* in the forward pass that reaches an eviction point, after the attention of
  the tokens before it, each layer scores its live tokens with the policy,
  keeps the best of every KV head, and compacts them into
  ``[new_frontier, point)``; the scheduler frees the blocks below the new
  frontier once the step's output is in;
* a step whose tokens run past an eviction point (a chunk shared with other
  requests, a preempted request recomputing its output) evicts at each point
  in turn and recomputes the attention of the tokens after it over the
  compacted region. Within one layer that is exact: the layer's queries, keys
  and values depend only on the layer below, so the request's output is the
  same as if the scheduler had cut its steps at the points.

New tokens are written by vLLM's own ``do_kv_cache_update`` at their true
slots, and RoPE positions stay true: only what attention reads changes.

With ``head_pages`` storage (per-head budgets, the MomentKV correction) the
survivors go to per-(layer, KV head) page tables instead
(:mod:`cpu_head_pages`) and attention runs our kernel over them
(:mod:`vllm_kvevict.cpu_ops`); the schedule, and so the blocks the scheduler
frees, are the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import logging
import os
import time
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionLayer, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_kvevict import cpu_ops
from vllm_kvevict.config import EvictionConfig, KVEvictionConfigError, config_from_additional
from vllm_kvevict.metrics import WORKER_METRICS, ProcessMetrics
from vllm_kvevict.policies import EvictionPolicy, RotaryFrequencies, ScoringInputs
from vllm_kvevict.policies.base import EvictedMoments
from vllm_kvevict.policies.allocation import (
    HeadAllocation,
    allocate_head_tokens,
    select_top,
    stack_streams,
)
from vllm_kvevict.schedule import EvictionSchedule, cdiv
from vllm_kvevict.triton_kernels.paged_reference import region_attention_reference
from vllm_kvevict.triton_kernels.evicted_summary import fold_evicted_reference
from vllm_kvevict.vllm_glue.compat import check_cpu_backend_contract
from vllm_kvevict.vllm_glue.cpu_head_pages import (
    HeadPagedCache,
    assign_pages,
    block_head_pages,
    gather_log_beta,
)
from vllm_kvevict.vllm_glue.gate_capture import current_capture
from vllm_kvevict.vllm_glue.cpu_page_layout import PageLayout, probe_page_layout
from vllm_kvevict.vllm_glue.layer_neighbours import output_projection_slices, rotary_frequencies
from vllm_kvevict.vllm_glue.runner_hooks import (
    current_batch,
    install_runner_hooks,
    layer_neighbours,
    on_requests_finished,
)
from vllm_kvevict.vllm_glue.spec import (
    STATS_PATH_ENV,
    EvictingAttentionSpec,
    is_plain_full_attention,
)
from vllm_kvevict.vllm_glue.worker_state import WorkerEvictionState

# Everything below subclasses or calls these; fail at import, not mid-request.
check_cpu_backend_contract()

logger = logging.getLogger(__name__)


# The worker's VllmConfig, remembered when the attention layers are built:
# vLLM asks customize_spec() later, outside any set_current_vllm_config().
_worker_vllm_config: VllmConfig | None = None


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


class KVEvictCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        # Must name an existing enum member: Attention looks itself up by it.
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[KVEvictCPUImpl]:
        return KVEvictCPUImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictCPUMetadataBuilder]:
        return KVEvictCPUMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        spec = super().customize_spec(spec)
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
            budget=config.budget,
            interval=config.decode_interval,
            max_step_tokens=vllm_config.max_in_flight_tokens,
            prefill_mode=config.prefill_mode,
            end_of_prompt_max_tokens=config.end_of_prompt_max_tokens,
            prefill_interval=(
                config.prefill_interval or vllm_config.scheduler_config.max_num_batched_tokens
            ),
            metric_labels=tuple(metric_labels(vllm_config, config).items()),
        )


@dataclass
class RequestEviction:
    """One request that reaches an eviction point in this step."""

    request_id: str
    batch_index: int
    state_row: int
    query_start: int  # index of the request's first token in the batch
    tokens_before: int  # n_before: tokens processed before this step
    last_point_before: int  # last eviction point at or below n_before
    frontier_before: int
    point: int
    frontier_after: int
    segment_end: int  # the step's tokens in [point, segment_end) attend after this eviction
    segment_metadata: CPUAttentionMetadata | None  # their attention (native slots path)
    # head_pages storage: whether the frontier moves (the only points that
    # compact), and the first slot of the standard region when this runs.
    compacts: bool = False
    region_start: int = 0

    @property
    def segment_tokens(self) -> slice:
        """Batch indices of the tokens that attend after this eviction."""
        first = self.query_start + self.point - self.tokens_before
        return slice(first, first + self.segment_end - self.point)


@dataclass
class EvictionStepPlan:
    """Per-step eviction work, built once and shared by every layer."""

    config: EvictionConfig
    policy: EvictionPolicy
    schedule: EvictionSchedule
    state: WorkerEvictionState
    layer_index: dict[str, int]
    layer_names: list[str]  # by layer index
    kv_head_replicas: int  # ranks holding a copy of each of this rank's KV heads
    first_replica_rank: int
    page_layout: PageLayout
    block_table: torch.Tensor  # unshifted, [num_reqs, max_blocks]
    query_start: list[int]
    seq_lens: list[int]
    frontier_before: list[int]
    evictions: list[RequestEviction]  # per request, in point order
    ring_tokens: torch.Tensor | None  # batch token indices whose queries are kept
    ring_slots: torch.Tensor | None  # their flat (row, pos % window) slots
    unwritten_tail_slots: torch.Tensor | None  # poison mode: slots past seq_len in last blocks
    num_evictions: int = 0  # (request, point) pairs that drop tokens
    eviction_seconds: float = 0.0  # summed over layers as they run
    # head_pages storage (None with slots storage)
    allocation: HeadAllocation | None = None
    state_rows: torch.Tensor | None = None  # [num_reqs] each request's state row
    region_start: torch.Tensor | None = None  # [num_reqs] standard region start at step start
    # head_budget global: one ranking over every layer at the end of the step
    global_eviction: bool = False
    local_kv_heads: torch.Tensor | None = None  # this rank's KV heads among the model's


@dataclass
class KVEvictCPUMetadata(CPUAttentionMetadata):
    eviction: EvictionStepPlan | None = None


class KVEvictCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config: EvictionConfig | None = None
        if not isinstance(kv_cache_spec, EvictingAttentionSpec):
            return
        config = active_config(vllm_config)
        assert config is not None
        self.config = config
        self.policy = config.build_policy()
        self.schedule = kv_cache_spec.schedule()
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.page_layout = probe_page_layout(
            self.block_size, kv_cache_spec.head_size, kv_cache_spec.dtype, self.isa
        )
        self.head_paged = config.uses_head_pages
        self.allocation = config.build_allocation() if self.head_paged else None
        if self.head_paged and config.cpu_attention == "native":
            # Build (or load) our kernel now, while the worker starts, rather
            # than stall the first request for the ~30 s compile.
            cpu_ops.load_cpu_ops()
        max_head_pages = 0
        retained_capacity = self.schedule.retained_capacity()
        self.global_eviction = config.head_budget == "global"
        if self.head_paged:
            # After an eviction a request's compacted tokens fill the blocks
            # [F, P // bs), fewer than budget // bs + 1 of them; one head may
            # take every head-page they hold (with global eviction, those of
            # every layer, but never more than a whole sequence).
            streams = kv_cache_spec.num_kv_heads
            if self.global_eviction:
                streams *= len(layer_names)
            max_head_pages = streams * (config.budget // self.block_size + 1)
            if self.global_eviction:
                max_head_pages = min(
                    max_head_pages, cdiv(vllm_config.model_config.max_model_len, self.block_size)
                )
            retained_capacity = max_head_pages * self.block_size
        self.state = WorkerEvictionState(
            num_layers=len(layer_names),
            num_kv_heads=kv_cache_spec.num_kv_heads,
            num_q_heads=self.num_heads,
            head_dim=kv_cache_spec.head_size,
            retained_capacity=retained_capacity,
            query_window=config.observation_window if self.policy.needs_queries else 0,
            query_dtype=vllm_config.model_config.dtype,
            device=device,
            max_head_pages=max_head_pages,
            moment_correction=config.moment_correction,
            moment_covariance=config.moment_covariance,
        )
        self.state.poison_freed_blocks = config.poisons_freed_blocks
        rank, world_size = _tensor_parallel_layout()
        # With more ranks than KV heads vLLM replicates each KV head on
        # consecutive ranks (see _whole_query_group); fixed for the worker's life.
        total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self.kv_head_replicas = max(1, world_size // total_kv_heads)
        if self.policy.needs_output_projection and self.kv_head_replicas > 1:
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
            self.state.stats_path = f"{stats_path}.worker{rank}"
            self.state.write_snapshot(force=True)
        install_runner_hooks()
        on_requests_finished(self.state.release)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CPUAttentionMetadata:
        batch = current_batch()
        cm = common_attn_metadata
        if self.config is None or batch is None or len(batch.req_ids) != cm.num_reqs:
            # Eviction off, or one of vLLM's dummy/profiling runs.
            return super().build(common_prefix_len, cm, fast_build)

        schedule, bs = self.schedule, self.schedule.block_size
        query_start = cm.query_start_loc_cpu.tolist()
        seq_lens = cm.seq_lens.cpu().tolist()
        window = self.state.query_window
        frontier_before: list[int] = []
        evictions: list[RequestEviction] = []
        ring_tokens: list[torch.Tensor] = []
        ring_slots: list[torch.Tensor] = []
        tail_slots: list[torch.Tensor] = []
        rows: list[int] = []
        region_starts: list[int] = []
        for i, req_id in enumerate(batch.req_ids):
            prompt_len = int(batch.prompt_lens[i])
            n_after = seq_lens[i]
            n_before = n_after - (query_start[i + 1] - query_start[i])
            frontier = schedule.frontier(n_before, prompt_len)
            frontier_before.append(frontier)
            row = self.state.row(req_id)
            rows.append(row)
            region = int(self.state.region_start[row]) if self.head_paged else 0
            region_starts.append(region)
            points = schedule.eviction_points_in_step(n_before, n_after, prompt_len)
            last_point = schedule.last_eviction_point(n_before, prompt_len)
            for k, point in enumerate(points):
                frontier_after = schedule.frontier_at_point(point)
                segment_end = points[k + 1] if k + 1 < len(points) else n_after
                segment_metadata = None
                compacts = frontier_after > frontier
                if (
                    segment_end > point
                    and self.config.cpu_attention == "native"
                    and not self.head_paged
                ):
                    segment_metadata = self._segment_metadata(
                        cm, i, query_start[i] + point - n_before, point, segment_end,
                        frontier_after,
                    )
                evictions.append(
                    RequestEviction(
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
                        segment_metadata=segment_metadata,
                        compacts=compacts,
                        region_start=region,
                    )
                )
                last_point, frontier = point, frontier_after
                if compacts:
                    region = point
            if self.head_paged:
                self.state.region_start[row] = region
                record = self.state.last_compaction.setdefault(req_id, {})
                record["tokens"] = n_after
            self.state.retained_tokens[req_id] = n_after - frontier
            if self.state.poison_freed_blocks:
                # What the request holds once this step is done; all of it
                # goes back to the pool when the request ends or is preempted.
                self.state.held_blocks[req_id] = cm.block_table_tensor[
                    i, frontier // bs : cdiv(n_after, bs)
                ].clone()
                if n_after % bs:
                    last_block = int(cm.block_table_tensor[i, n_after // bs])
                    tail_slots.append(last_block * bs + torch.arange(n_after % bs, bs))
            if window:
                first = max(n_before, n_after - window)
                positions = torch.arange(first, n_after)
                ring_tokens.append(query_start[i] + positions - n_before)
                ring_slots.append(row * window + positions % window)

        # Attention reads [frontier, seq_len): shift each block-table row by the
        # frontier's block and shorten the sequence accordingly.
        frontier = torch.tensor(frontier_before, dtype=cm.seq_lens.dtype)
        table = cm.block_table_tensor
        shifted_table = shift_block_table(table, frontier // bs)
        shifted_lens = cm.seq_lens - frontier.to(cm.seq_lens.device)
        shifted = dataclasses.replace(
            cm,
            seq_lens=shifted_lens,
            block_table_tensor=shifted_table,
            max_seq_len=int(shifted_lens.max()) if cm.num_reqs else 0,
        )
        metadata = super().build(common_prefix_len, shifted, fast_build)
        plan = EvictionStepPlan(
            config=self.config,
            policy=self.policy,
            schedule=schedule,
            state=self.state,
            layer_index=self.layer_index,
            layer_names=list(self.layer_index),
            kv_head_replicas=self.kv_head_replicas,
            first_replica_rank=self.first_replica_rank,
            page_layout=self.page_layout,
            block_table=table,
            query_start=query_start,
            seq_lens=seq_lens,
            frontier_before=frontier_before,
            evictions=evictions,
            ring_tokens=torch.cat(ring_tokens) if ring_tokens else None,
            ring_slots=torch.cat(ring_slots) if ring_slots else None,
            unwritten_tail_slots=torch.cat(tail_slots) if tail_slots else None,
            num_evictions=sum(ev.frontier_after > ev.frontier_before for ev in evictions),
        )
        if self.head_paged:
            plan.allocation = self.allocation
            plan.state_rows = torch.tensor(rows, dtype=torch.int64)
            plan.region_start = torch.tensor(region_starts, dtype=torch.int64)
            plan.global_eviction = self.global_eviction
            plan.local_kv_heads = self.local_kv_heads
        values = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return KVEvictCPUMetadata(**values, eviction=plan)

    def _segment_metadata(
        self,
        cm: CommonAttentionMetadata,
        batch_index: int,
        first_token: int,
        start: int,
        end: int,
        frontier: int,
    ) -> CPUAttentionMetadata:
        """Kernel metadata for one request's tokens ``[start, end)`` over ``[frontier, end)``."""
        num_tokens, length = end - start, end - frontier
        row = cm.block_table_tensor[batch_index : batch_index + 1]
        first_block = torch.tensor([frontier // self.block_size])
        query_start_loc = torch.tensor([0, num_tokens], dtype=cm.query_start_loc.dtype)
        segment = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(cm.query_start_loc.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens=torch.tensor([length], dtype=cm.seq_lens.dtype, device=cm.seq_lens.device),
            num_reqs=1,
            num_actual_tokens=num_tokens,
            max_query_len=num_tokens,
            max_seq_len=length,
            block_table_tensor=shift_block_table(row, first_block),
            slot_mapping=cm.slot_mapping[first_token : first_token + num_tokens],
        )
        return super().build(0, segment)


def shift_block_table(table: torch.Tensor, first_blocks: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` starting at their ``first_blocks`` column (the frontier's block).

    Columns past the end repeat the last one; the kernel never reads them.
    """
    width = table.shape[1]
    columns = torch.arange(width)[None, :] + first_blocks.to(torch.int64)[:, None]
    return table.gather(1, columns.clamp_(max=width - 1).to(table.device))


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


def head_paged_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU cache ``[num_blocks, H, block_size, 2 * D]`` as head-pages:
    ``[num_blocks, H, 2 * block_size, D]``, each a K block then a V block."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU page layout: each (block, head) page is a K block then a V block."""
    key_cache, value_cache = head_paged_view(kv_cache).chunk(2, dim=2)
    return key_cache, value_cache


class KVEvictCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        global _worker_vllm_config
        super().__init__(*args, **kwargs)
        _worker_vllm_config = get_current_vllm_config_or_none() or _worker_vllm_config
        # What this layer's policy reads from the model, found at first use.
        self._rotary: RotaryFrequencies | None = None
        self._output_projection: torch.Tensor | None = None

    def _scoring_inputs(
        self,
        plan: EvictionStepPlan,
        layer_index: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        queries: torch.Tensor | None,
        query_positions: torch.Tensor | None,
        evicted: EvictedMoments | None = None,
    ) -> ScoringInputs:
        """What the policy scores with, plus the model parts it asks for."""
        policy, name = plan.policy, plan.layer_names[layer_index]
        if policy.needs_rotary and self._rotary is None:
            self._rotary = rotary_frequencies(layer_neighbours(name), name, self.head_size)
        if policy.needs_output_projection and self._output_projection is None:
            self._output_projection = output_projection_slices(
                layer_neighbours(name), name, self.num_heads, self.head_size
            )
        return ScoringInputs(
            keys, values, positions, queries, query_positions, self.scale, evicted,
            rotary=self._rotary if policy.needs_rotary else None,
            output_projection=self._output_projection if policy.needs_output_projection else None,
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = getattr(attn_metadata, "eviction", None)
        if plan is None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )
        key_cache, value_cache = split_kv_cache(kv_cache)
        layer_index = plan.layer_index[layer.layer_name]
        state = plan.state
        if state.poison_freed_blocks:
            state.kv_caches.setdefault(layer_index, kv_cache)
            if plan.unwritten_tail_slots is not None:
                # vLLM's kernel reads a request's last block whole and masks
                # the slots past seq_len; 0 * NaN would still be NaN. A new
                # block may be a poisoned one, so clear its unwritten tail (as
                # vLLM zeroes new blocks when stale bytes could decode to NaN).
                self._clear_slots(layer, plan.unwritten_tail_slots, key, key_cache, value_cache)
        if plan.global_eviction:
            self._global_forward(plan, layer, layer_index, query, head_paged_view(kv_cache),
                                 attn_metadata, output)
        elif plan.allocation is not None:
            self._head_paged_forward(plan, layer_index, query, head_paged_view(kv_cache), output)
        elif plan.config.cpu_attention == "native":
            super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )
        else:
            self._torch_attention(plan, query, key_cache, value_cache, output)
        if plan.allocation is None:
            started = time.perf_counter()
            for eviction in plan.evictions:
                self._evict(plan, layer, layer_index, eviction, query, key_cache, value_cache)
                if eviction.segment_end > eviction.point:
                    self._attend_segment(
                        plan, layer, eviction, query, key, value, kv_cache, key_cache,
                        value_cache, output,
                    )
            plan.eviction_seconds += time.perf_counter() - started
        if state.poison_freed_blocks:
            # Isolation check: a read of a poisoned block or page shows up here.
            out = output[: plan.query_start[-1]].reshape(plan.query_start[-1], -1)
            state.counters.nan_outputs += int(torch.isnan(out).any(dim=-1).sum())
        if layer_index == len(plan.layer_index) - 1:
            state.end_step(plan.num_evictions, plan.eviction_seconds)
        if plan.ring_tokens is not None:
            ring = plan.state.query_ring[layer_index]
            ring.view(-1, *ring.shape[2:]).index_copy_(
                0, plan.ring_slots, query[plan.ring_tokens].to(ring.dtype)
            )
        return output

    def _head_paged_forward(
        self,
        plan: EvictionStepPlan,
        layer_index: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """head_pages storage: attention of the whole batch, then each eviction
        point in order, each followed by the attention of the tokens after it."""
        assert plan.state_rows is not None and plan.region_start is not None
        num_reqs = len(plan.seq_lens)
        tokens = slice(0, plan.query_start[-1])
        self._head_paged_attention(
            plan, layer_index, query[tokens], kv_cache, output[tokens],
            torch.tensor(plan.query_start, dtype=torch.int32),
            torch.tensor(plan.seq_lens, dtype=torch.int32),
            plan.state_rows, plan.block_table[:num_reqs], plan.region_start,
        )
        started = time.perf_counter()
        cache = HeadPagedCache(kv_cache, plan.page_layout)
        for ev in plan.evictions:
            if not ev.compacts:
                continue  # nothing moves: the standard region just grows
            self._compact(plan, layer_index, ev, query, cache)
            if ev.segment_end > ev.point:
                segment = ev.segment_tokens
                count = segment.stop - segment.start
                self._head_paged_attention(
                    plan, layer_index, query[segment], kv_cache, output[segment],
                    torch.tensor([0, count], dtype=torch.int32),
                    torch.tensor([ev.segment_end], dtype=torch.int32),
                    plan.state_rows[ev.batch_index : ev.batch_index + 1],
                    plan.block_table[ev.batch_index : ev.batch_index + 1],
                    torch.tensor([ev.point], dtype=torch.int64),
                )
        plan.eviction_seconds += time.perf_counter() - started

    def _global_forward(
        self,
        plan: EvictionStepPlan,
        layer: AttentionLayer,
        layer_index: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """head_budget global: store this step's log β, attend over the layer's
        page tables (pages of any layer), and after the last layer rank every
        layer's tokens together (spec §5.3: compress between forward passes).

        Eviction points inside the step are applied at its end, at the last
        one: tokens of the step after a point attend to the uncompacted cache,
        which the request holds during the step anyway. The blocks freed are
        the schedule's, so the scheduler's accounting is unchanged.
        """
        assert plan.state_rows is not None and plan.region_start is not None
        state, bs = plan.state, plan.schedule.block_size
        whole, offset = state.global_kv(layer_index, kv_cache)
        num_tokens, num_reqs = plan.query_start[-1], len(plan.seq_lens)
        if plan.policy.needs_log_beta:
            capture = current_capture()
            if capture is None:
                raise RuntimeError("policy 'learned' is serving, but no retention gates were loaded")
            assert plan.local_kv_heads is not None
            log_beta = capture.take(layer.layer_name, num_tokens)[:, plan.local_kv_heads]
            slots = attn_metadata.slot_mapping[:num_tokens].long()
            pages = block_head_pages(offset + slots // bs, kv_cache.shape[1]).view(num_tokens, -1)
            state.log_beta_pages[pages.long(), (slots % bs)[:, None].expand_as(pages)] = log_beta.float()
        tokens = slice(0, num_tokens)
        self._head_paged_attention(
            plan, layer_index, query[tokens], whole, output[tokens],
            torch.tensor(plan.query_start, dtype=torch.int32),
            torch.tensor(plan.seq_lens, dtype=torch.int32),
            plan.state_rows, plan.block_table[:num_reqs] + offset, plan.region_start,
        )
        if layer_index != state.num_layers - 1:
            return
        if plan.policy.needs_log_beta:
            capture.pending.clear()  # what vLLM's dummy runs left behind
        started = time.perf_counter()
        last: dict[int, RequestEviction] = {}
        for ev in plan.evictions:
            if ev.compacts:
                last[ev.batch_index] = ev
        for ev in last.values():
            self._compact_global(plan, ev)
        plan.eviction_seconds += time.perf_counter() - started

    def _compact_global(self, plan: EvictionStepPlan, ev: RequestEviction) -> None:
        """Keep the best tokens below ``ev.point`` over every (layer, KV head)
        of the request, in the head-pages of every layer's blocks
        ``[frontier_after, point // bs)``."""
        assert plan.allocation is not None and plan.region_start is not None
        config, state, bs = plan.config, plan.state, plan.schedule.block_size
        assert state.global_cache is not None
        row, i = ev.state_row, ev.batch_index
        region_start = int(plan.region_start[i])
        frontier_before = plan.frontier_before[i]
        cache = HeadPagedCache(state.global_cache, plan.page_layout)
        num_layers, num_heads = state.num_layers, cache.num_heads
        block_row = plan.block_table[i]
        # Gather every layer first: a stream's new pages may be another
        # layer's old ones.
        gathered, scores = [], []
        for layer_index in range(num_layers):
            offset = state.layer_block_offset[layer_index]
            pages = state.head_pages[layer_index, row]
            lens = state.head_lens[layer_index, row]
            tokens = cache.gather_live(
                pages, lens, state.positions[layer_index, row], block_row + offset,
                region_start, ev.point,
            )
            log_beta = gather_log_beta(
                state.log_beta_pages, pages, lens, block_row + offset, region_start, ev.point
            )
            inputs = ScoringInputs(
                tokens.keys, tokens.values, tokens.positions, None, None, self.scale,
                log_beta=log_beta, step=ev.point,
            )
            scores.append(plan.policy.masked_scores(
                inputs, config.sink_tokens, config.recent_window, ev.point, tokens.live
            ))
            gathered.append((tokens, log_beta))
        stacked = stack_streams(scores)
        kept_blocks = block_row[ev.frontier_after // bs : ev.point // bs]
        free_pages = torch.cat([
            block_head_pages(kept_blocks + state.layer_block_offset[layer_index], num_heads)
            for layer_index in range(num_layers)
        ])
        counts = allocate_head_tokens(plan.allocation, stacked, free_pages.numel(), bs)
        kept = select_top(stacked, counts)
        counts_list = counts.tolist()
        new_pages = assign_pages(free_pages, counts_list, bs)
        record = state.last_compaction.setdefault(ev.request_id, {})
        record.update(point=ev.point, frontier=ev.frontier_after, head_lens=[])
        for layer_index, (tokens, log_beta) in enumerate(gathered):
            pages = state.head_pages[layer_index, row]
            positions = state.positions[layer_index, row]
            layer_counts = counts_list[layer_index * num_heads : (layer_index + 1) * num_heads]
            for h, count in enumerate(layer_counts):
                stream = layer_index * num_heads + h
                index = kept[stream, :count]
                stream_pages = new_pages[stream]
                cache.write_compacted(stream_pages, tokens.keys[h, index], tokens.values[h, index])
                if count:
                    page_rows = state.log_beta_pages[stream_pages.long()]
                    page_rows.view(-1)[:count] = log_beta[h, index]
                    state.log_beta_pages[stream_pages.long()] = page_rows
                pages[h, : stream_pages.numel()] = stream_pages
                positions[h, :count] = tokens.positions[h, index]
            state.head_lens[layer_index, row] = torch.tensor(layer_counts, dtype=state.head_lens.dtype)
            state.observe_head_retained(layer_counts)
            record["head_lens"].append(layer_counts)
        if state.poison_freed_blocks:
            used = sum(p.numel() for p in new_pages)
            cache.poison_pages(free_pages[used:])
            if ev.point % bs:
                block = int(block_row[ev.point // bs])
                for offset in state.layer_block_offset.values():
                    cache.poison_standard_prefix(block + offset, ev.point % bs)
            # The scheduler returns these to the pool once this step is done.
            state.poison(block_row[frontier_before // bs : ev.frontier_after // bs])

    def _head_paged_attention(
        self,
        plan: EvictionStepPlan,
        layer_index: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor,
        block_table: torch.Tensor,
        region_start: torch.Tensor,
    ) -> None:
        state = plan.state
        summary = state.summaries[layer_index] if state.summaries else None
        out, _ = cpu_ops.head_paged_attention(
            query,
            kv_cache,
            query_start_loc,
            seq_lens,
            state.head_pages[layer_index].index_select(0, rows),
            state.head_lens[layer_index].index_select(0, rows),
            block_table.to(torch.int32),
            region_start.to(torch.int32),
            plan.page_layout.key_index,
            plan.page_layout.value_index,
            self.scale,
            summary=summary,
            summary_rows=rows.to(torch.int32) if summary is not None else None,
            native=plan.config.cpu_attention == "native",
        )
        output.copy_(out.view(output.shape).to(output.dtype))

    def _compact(
        self,
        plan: EvictionStepPlan,
        layer_index: int,
        ev: RequestEviction,
        query: torch.Tensor,
        cache: HeadPagedCache,
    ) -> None:
        """head_pages storage: keep the policy's choice of every live token below
        ``ev.point``, split across heads by the allocation, in the head-pages of
        the blocks ``[frontier_after, point // bs)``; fold the rest into the
        MomentKV summary."""
        assert plan.allocation is not None
        config, state, bs = plan.config, plan.state, plan.schedule.block_size
        row = ev.state_row
        pages = state.head_pages[layer_index, row]
        lens = state.head_lens[layer_index, row]
        positions = state.positions[layer_index, row]
        block_row = plan.block_table[ev.batch_index]
        tokens = cache.gather_live(
            pages, lens, positions, block_row, ev.region_start, ev.point
        )
        queries = query_positions = None
        if plan.policy.needs_queries:
            queries, query_positions = self._observation_queries(plan, layer_index, ev, query)
        summary = state.summaries[layer_index] if state.summaries else None
        moments = None
        if summary is not None:
            moments = EvictedMoments(
                summary.count[row], summary.key_mean[row], summary.value_mean[row],
                summary.cross_cov[row],
            )
        inputs = self._scoring_inputs(
            plan, layer_index, tokens.keys, tokens.values, tokens.positions, queries,
            query_positions, moments,
        )
        scores = plan.policy.masked_scores(
            inputs, config.sink_tokens, config.recent_window, ev.point, tokens.live
        )
        kept_blocks = block_row[ev.frontier_after // bs : ev.point // bs]
        free_pages = block_head_pages(kept_blocks, cache.num_heads)
        total_pages = free_pages.numel()
        counts = allocate_head_tokens(plan.allocation, scores, total_pages, bs)
        kept = select_top(plan.policy.refine_scores(inputs, scores, counts), counts)
        counts_list = counts.tolist()
        new_pages = assign_pages(free_pages, counts_list, bs)
        for h, count in enumerate(counts_list):
            index = kept[h, :count]
            if summary is not None:
                evicted = tokens.live[h].clone()
                evicted[index] = False
                fold_evicted_reference(
                    summary, row, h, tokens.keys[h, evicted], tokens.values[h, evicted]
                )
            cache.write_compacted(new_pages[h], tokens.keys[h, index], tokens.values[h, index])
            pages[h, : new_pages[h].numel()] = new_pages[h]
            positions[h, :count] = tokens.positions[h, index]
        lens.copy_(counts.to(lens.dtype))
        state.observe_head_retained(counts_list)
        record = state.last_compaction.setdefault(ev.request_id, {})
        if record.get("point") != ev.point:
            record.update(
                point=ev.point,
                frontier=ev.frontier_after,
                head_lens=[[] for _ in range(state.num_layers)],
            )
        record["head_lens"][layer_index] = counts_list
        if state.poison_freed_blocks:
            used = sum(p.numel() for p in new_pages)
            cache.poison_pages(free_pages[used:])
            if ev.point % bs:
                cache.poison_standard_prefix(int(block_row[ev.point // bs]), ev.point % bs)
            # The scheduler returns these to the pool once this step is done.
            state.poison(
                block_row[ev.frontier_before // bs : ev.frontier_after // bs], layer_index
            )

    def _torch_attention(
        self,
        plan: EvictionStepPlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        for i, seq_len in enumerate(plan.seq_lens):
            tokens = slice(plan.query_start[i], plan.query_start[i + 1])
            self._region_attention(
                plan, i, tokens, plan.frontier_before[i], seq_len, query, key_cache,
                value_cache, output,
            )

    def _region_attention(
        self,
        plan: EvictionStepPlan,
        batch_index: int,
        tokens: slice,
        region_start: int,
        region_end: int,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Torch reference: ``tokens`` (the last of the region) over slots ``[start, end)``."""
        bs = plan.schedule.block_size
        block_ids = plan.block_table[batch_index, region_start // bs : cdiv(region_end, bs)]
        length = region_end - region_start
        keys = plan.page_layout.read_pages(key_cache, block_ids, is_key=True)[:, :length]
        values = plan.page_layout.read_pages(value_cache, block_ids, is_key=False)[:, :length]
        output[tokens] = region_attention_reference(
            query[tokens], keys, values, region_start, self.scale
        ).to(output.dtype)

    def _clear_slots(
        self,
        layer: AttentionLayer,
        slots: torch.Tensor,
        like: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> None:
        zeros = like.new_zeros((slots.numel(), *like.shape[1:]))
        ops.cpu_attn_reshape_and_cache(
            zeros, zeros, key_cache, value_cache, slots.long(),
            layer.isa,  # type: ignore[attr-defined]
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def _attend_segment(
        self,
        plan: EvictionStepPlan,
        layer: AttentionLayer,
        ev: RequestEviction,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Attention of the tokens after ``ev.point`` over the region it left."""
        tokens = ev.segment_tokens
        if plan.config.cpu_attention == "native":
            assert ev.segment_metadata is not None
            CPUAttentionBackendImpl.forward(
                self,
                layer, query[tokens], key[tokens], value[tokens], kv_cache,
                ev.segment_metadata, output[tokens],
            )
            return
        self._region_attention(
            plan, ev.batch_index, tokens, ev.frontier_after, ev.segment_end, query, key_cache,
            value_cache, output,
        )

    def _evict(
        self,
        plan: EvictionStepPlan,
        layer: AttentionLayer,
        layer_index: int,
        ev: RequestEviction,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> None:
        """Keep the policy's choice of the live tokens below ``ev.point``."""
        config, state, bs = plan.config, plan.state, plan.schedule.block_size
        positions_row = state.positions[layer_index, ev.state_row]  # [H, capacity]
        num_compacted = ev.last_point_before - ev.frontier_before
        num_live = ev.point - ev.frontier_before
        new_positions = torch.arange(ev.last_point_before, ev.point, device=positions_row.device)
        if ev.frontier_after == ev.frontier_before:
            # The frontier stays in its block: every live token is kept where
            # it is; only record where the new ones came from.
            positions_row[:, num_compacted:num_live] = new_positions
            return
        block_row = plan.block_table[ev.batch_index]
        old_blocks = block_row[ev.frontier_before // bs : cdiv(ev.point, bs)]
        keys = plan.page_layout.read_pages(key_cache, old_blocks, is_key=True)[:, :num_live]
        values = plan.page_layout.read_pages(value_cache, old_blocks, is_key=False)[:, :num_live]
        num_heads = keys.shape[0]
        positions = torch.cat(
            [positions_row[:, :num_compacted], new_positions.expand(num_heads, -1)], dim=1
        )
        queries = query_positions = None
        if plan.policy.needs_queries:
            queries, query_positions = self._observation_queries(plan, layer_index, ev, query)
        num_keep = ev.point - ev.frontier_after
        kept = plan.policy.select(
            self._scoring_inputs(
                plan, layer_index, keys, values, positions, queries, query_positions
            ),
            num_keep,
            config.sink_tokens,
            config.recent_window,
            ev.point,
        )
        gather_index = kept.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        # Write the survivors to slots [frontier_after, point) through vLLM's
        # own cache-write op, so they land in the kernel's page order.
        slots = torch.arange(ev.frontier_after, ev.point)
        slot_mapping = block_row[slots // bs].long() * bs + slots % bs
        ops.cpu_attn_reshape_and_cache(
            keys.gather(1, gather_index).transpose(0, 1).contiguous(),
            values.gather(1, gather_index).transpose(0, 1).contiguous(),
            key_cache,
            value_cache,
            slot_mapping,
            layer.isa,  # type: ignore[attr-defined]
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        positions_row[:, :num_keep] = positions.gather(1, kept)
        state.observe_head_retained([num_keep] * num_heads)
        if state.poison_freed_blocks:
            # The scheduler returns these to the pool once this step is done.
            state.poison(
                block_row[ev.frontier_before // bs : ev.frontier_after // bs], layer_index
            )

    def _observation_queries(
        self,
        plan: EvictionStepPlan,
        layer_index: int,
        ev: RequestEviction,
        query: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries of positions ``[point - W, point)``, ``[Hq, W, D]``.

        Positions processed in this step come from its query tensor; earlier
        ones from the ring, which this layer has not updated yet this step.
        """
        window = plan.state.query_window
        positions = torch.arange(max(0, ev.point - window), ev.point)
        from_ring = positions < ev.tokens_before
        ring = plan.state.query_ring[layer_index, ev.state_row]  # [W, Hq, D]
        gathered = torch.empty(
            (positions.numel(), query.shape[1], query.shape[2]), dtype=query.dtype
        )
        gathered[from_ring] = ring[positions[from_ring] % window].to(query.dtype)
        fresh = ev.query_start + positions[~from_ring] - ev.tokens_before
        gathered[~from_ring] = query[fresh]
        queries = gathered.transpose(0, 1)
        if plan.kv_head_replicas > 1:
            queries = _whole_query_group(queries, plan.kv_head_replicas, plan.first_replica_rank)
        return queries, positions


def _whole_query_group(
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
