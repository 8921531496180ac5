"""Scheduler side: the block manager of evicting layers.

The engine core's ``KVCacheSpecRegistry`` builds an :class:`EvictionManager`
for each group of :class:`~vllm_kvevict.plugin.kv_spec.EvictingAttentionSpec`
layers. The manager frees, after each step, the
blocks below the eviction frontier that the worker has compacted away, with
vLLM's own null-block mechanism (as for sliding-window layers), and sizes
admission to the budget instead of the full sequence.

Each request follows its own schedule (:func:`~vllm_kvevict.config.request_schedule`:
the server's, with the budget the request asked for, or none when it opted
out), read from the request's extra arguments when vLLM allocates its slots
(:func:`install_request_schedules`); the workers read the same arguments.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_kvevict.request_settings import request_schedule
from vllm_kvevict.metrics import ENGINE_METRICS, ProcessMetrics
from vllm_kvevict.schedule import EvictionSchedule, Schedule, cdiv
from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec
from vllm_kvevict.plugin.snapshot import STATS_PATH_ENV, SnapshotWriter


@dataclass
class RequestTrace:
    """What one request held and where its blocks were freed."""

    budget: int | None = None  # the request's budget; None: kv_eviction "off"
    prompt_len: int = 0
    tokens: int = 0  # processed tokens at the last schedule
    retained: int = 0  # of which each KV head keeps (protected prefix + tokens - frontier)
    peak_blocks: int = 0
    blocks: int = 0  # held after the last allocation or free
    free_points: list[int] = field(default_factory=list)  # processed tokens at each free


@dataclass
class ManagerStats:
    """Counters of one engine's eviction manager (blocks of this KV group)."""

    blocks_freed_by_eviction: int = 0
    eviction_frees: int = 0
    requests_admitted: int = 0
    blocks_held: int = 0
    peak_blocks_held: int = 0
    protected_prefix_blocks: int = 0  # distinct blocks of the running requests' protected prefixes
    live_requests: int = 0
    live: dict[str, RequestTrace] = field(default_factory=dict)
    finished: list[dict[str, Any]] = field(default_factory=list)

    MAX_FINISHED = 16
    MAX_FREE_POINTS = 64

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k not in ("live", "finished")}
        data["max_request_peak_blocks"] = max(
            (trace.peak_blocks for trace in self.live.values()), default=0
        )
        data["recent_requests"] = list(self.finished)
        return data

    def finish(self, request_id: str) -> None:
        trace = self.live.pop(request_id, None)
        if trace is not None:
            self.finished.append({"request_id": request_id, **trace.__dict__})
            del self.finished[: -self.MAX_FINISHED]


class EvictionManager(FullAttentionManager):
    """Frees, per request, every block below the eviction frontier."""

    def __init__(self, kv_cache_spec: EvictingAttentionSpec, **kwargs: Any) -> None:
        self.schedule = kv_cache_spec.schedule
        self.max_step_tokens = kv_cache_spec.max_step_tokens
        # Each request's schedule (NEVER_EVICTS when it opted out), from its first
        # allocation until its blocks are freed.
        self.request_schedules: dict[str, Schedule] = {}
        # vLLM passes an admission cap only to sliding-window-like specs; a
        # request of ours never holds more than this, so admit it on that basis
        # (None in end_of_prompt mode: the whole prompt is held once). A
        # request with its own schedule is admitted on its own cap
        # (get_num_blocks_to_allocate).
        self.server_admission_blocks = self.schedule.max_blocks_per_request(self.max_step_tokens)
        kwargs["max_admission_blocks_per_request"] = self.server_admission_blocks
        super().__init__(kv_cache_spec, **kwargs)
        self.stats = ManagerStats()
        self._admitted: set[str] = set()  # requests allocated for since their blocks were last freed
        labels = dict(kv_cache_spec.metric_labels) or {
            "model_name": "", "engine": "0", "policy": ""
        }
        self.metrics = ProcessMetrics(f"engine{labels['engine']}", ENGINE_METRICS, labels)
        # Sums over admitted requests, kept incrementally (updated every step).
        self._logical_tokens = 0
        self._retained_tokens = 0
        self._unevicted_blocks = 0
        self.snapshot = SnapshotWriter(os.environ.get(STATS_PATH_ENV))
        self._write_snapshot(force=True)

    def track_request(self, request_id: str, extra_args: dict[str, Any] | None) -> None:
        """Take the request's schedule from its extra arguments (once per
        allocation of its blocks: again after a preemption freed them)."""
        if request_id in self.request_schedules:
            return
        schedule = request_schedule(self.schedule, extra_args)
        self.request_schedules[request_id] = schedule
        trace = self.stats.live.setdefault(request_id, RequestTrace())
        trace.budget = schedule.budget

    def schedule_of(self, request_id: str) -> Schedule:
        """The request's schedule; the server's for a request allocated
        outside ``KVCacheManager.allocate_slots``."""
        return self.request_schedules.get(request_id, self.schedule)

    def admission_blocks(self, request_id: str) -> int | None:
        """Most blocks the request holds at once (None: its whole sequence)."""
        schedule = self.schedule_of(request_id)
        return schedule.max_blocks_per_request(self.max_step_tokens)

    def get_num_blocks_to_allocate(self, request_id: str, *args: Any, **kwargs: Any) -> int:
        # vLLM reads the cap from this attribute; it is the request's own here.
        self.max_admission_blocks_per_request = self.admission_blocks(request_id)
        try:
            return super().get_num_blocks_to_allocate(request_id, *args, **kwargs)
        finally:
            self.max_admission_blocks_per_request = self.server_admission_blocks

    def cache_blocks(self, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        # Only a protected prefix is hashed: every block after it may be
        # compacted into or freed, so none of them may be found by another
        # request (a request that opted out hashes no further either, or an
        # evicting one could find its blocks past its own prefix).
        protected = self.schedule.protected_prefix(request.num_prompt_tokens)
        super().cache_blocks(request, min(num_tokens, protected), *args, **kwargs)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        if num_prompt_tokens is None:
            raise RuntimeError(
                "vllm-kvevict needs the prompt length to place the eviction frontier; "
                "this vLLM code path is not supported (is a KV connector configured?)"
            )
        trace = self.stats.live.setdefault(request_id, RequestTrace())
        trace.prompt_len = num_prompt_tokens
        if request_id not in self.req_to_blocks:
            return
        schedule = self.schedule_of(request_id)
        prefix = schedule.protected_prefix(num_prompt_tokens)
        frontier = schedule.frontier(processed_computed_tokens, num_prompt_tokens)
        retained = max(processed_computed_tokens - frontier, 0) + min(processed_computed_tokens, prefix)
        self._logical_tokens += processed_computed_tokens - trace.tokens
        self._retained_tokens += retained - trace.retained
        self._unevicted_blocks += cdiv(processed_computed_tokens, self.block_size) - cdiv(trace.tokens, self.block_size)
        dropped = (processed_computed_tokens - retained) - (trace.tokens - trace.retained)
        if dropped > 0:
            self.metrics.get("kvevict_tokens_evicted").inc(dropped)
        trace.tokens, trace.retained = processed_computed_tokens, retained
        self._update_metrics(force=False)
        blocks = self.req_to_blocks[request_id]
        first, last = prefix // self.block_size, min(frontier // self.block_size, len(blocks))
        freed = sum(1 for block in blocks[first:last] if not block.is_null)
        if freed:
            self._remove_blocks_in_range(request_id, first, last)
            self.stats.blocks_freed_by_eviction += freed
            self.stats.eviction_frees += 1
            self.metrics.get("kvevict_blocks_freed").inc(freed)
            points = self.stats.live[request_id].free_points
            if len(points) < ManagerStats.MAX_FREE_POINTS:
                points.append(processed_computed_tokens)
            self._account(request_id, force=True)

    def allocate_new_blocks(self, request_id: str, *args: Any, **kwargs: Any) -> Any:
        # A request that found blocks in the prefix cache holds them before
        # its first allocation: admitted is what was never allocated for.
        is_new = request_id not in self._admitted
        free_before = self.block_pool.get_num_free_blocks()
        found = len(self.req_to_blocks.get(request_id, ()))  # in the prefix cache
        new_blocks = super().allocate_new_blocks(request_id, *args, **kwargs)
        if is_new:
            self._admitted.add(request_id)
            self.stats.requests_admitted += 1
            self.metrics.get("kvevict_requests_admitted").inc()
            self.metrics.get("kvevict_requests_by_setting", setting=self._setting_of(request_id)).inc()
            # Without eviction vLLM admits a request only when the blocks of
            # its whole prompt (but those found in the cache) are free.
            trace = self.stats.live.get(request_id)
            if trace is not None and cdiv(trace.prompt_len, self.block_size) - found > free_before:
                self.metrics.get("kvevict_requests_admitted_beyond_memory").inc()
        if new_blocks:
            self._account(request_id)
        return new_blocks

    def _setting_of(self, request_id: str) -> str:
        """The eviction a request runs with, as kvevict_requests_by_setting names it."""
        schedule = self.schedule_of(request_id)
        if not schedule.evicts:
            return "off"
        return "server" if schedule.budget == self.schedule.budget else "own_budget"

    def free(self, request_id: str) -> None:
        trace = self.stats.live.get(request_id)
        if trace is not None and request_id in self.req_to_blocks:
            self._logical_tokens -= trace.tokens
            self._retained_tokens -= trace.retained
            self._unevicted_blocks -= cdiv(trace.tokens, self.block_size)
        super().free(request_id)
        self._admitted.discard(request_id)
        self.request_schedules.pop(request_id, None)
        self.stats.finish(request_id)
        self._account(None, force=True)

    def _account(self, request_id: str | None, force: bool = False) -> None:
        stats = self.stats
        if request_id is not None:
            held = sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)
            trace = stats.live.setdefault(request_id, RequestTrace())
            trace.peak_blocks = max(trace.peak_blocks, held)
            trace.blocks = held
        # One pool, one evicting group: every used block is held by a request
        # (block 0 is vLLM's null block and never free).
        pool = self.block_pool
        stats.blocks_held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        stats.protected_prefix_blocks = self._protected_prefix_blocks()
        stats.live_requests = len(self.req_to_blocks)
        stats.peak_blocks_held = max(stats.peak_blocks_held, stats.blocks_held)
        self._write_snapshot(force)
        self._update_metrics(force)

    def _protected_prefix_blocks(self) -> int:
        """Distinct blocks of the running requests' protected prefixes."""
        if not self.schedule.max_protected_prefix:
            return 0
        held = set()
        for request_id, blocks in self.req_to_blocks.items():
            trace = self.stats.live.get(request_id)
            schedule = self.schedule_of(request_id)
            if trace is not None:
                prefix_blocks = schedule.protected_prefix(trace.prompt_len) // self.block_size
                held.update(block.block_id for block in blocks[:prefix_blocks] if not block.is_null)
        return len(held)

    def _update_metrics(self, force: bool) -> None:
        logical, retained = self._logical_tokens, self._retained_tokens
        metrics = self.metrics
        metrics.get("kvevict_logical_tokens").set(logical)
        metrics.get("kvevict_retained_tokens").set(retained)
        metrics.get("kvevict_compression_ratio").set(logical / retained if retained else 1.0)
        metrics.get("kvevict_blocks_held").set(self.stats.blocks_held)
        metrics.get("kvevict_blocks_held_without_eviction").set(self._unevicted_blocks)
        metrics.get("kvevict_protected_prefix_tokens").set(self.stats.protected_prefix_blocks * self.block_size)
        metrics.export(force)

    def _write_snapshot(self, force: bool) -> None:
        """Publish the counters for tests and tools (``KVEVICT_STATS_PATH``)."""
        self.snapshot.write(self._snapshot, force)

    def _snapshot(self) -> dict[str, Any]:
        data = self.stats.as_dict()
        data["num_blocks"] = self.block_pool.num_gpu_blocks
        data["free_blocks"] = self.block_pool.get_num_free_blocks()
        data["max_admission_blocks_per_request"] = self.server_admission_blocks
        return data


def register_spec() -> None:
    """Map our spec to our manager, after vLLM's built-ins (see _ensure_registered)."""
    # The registry only registers the built-in specs when it is empty; do that
    # first or FullAttentionSpec itself would have no manager.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        EvictingAttentionSpec, EvictionManager, uniform_type_base_spec=FullAttentionSpec
    )
    probe = EvictingAttentionSpec(
        block_size=32,
        num_kv_heads=1,
        head_size=32,
        dtype=torch.float32,
        schedule=EvictionSchedule(budget=32, decode_interval=1, block_size=32),
        max_step_tokens=32,
    )
    manager = KVCacheSpecRegistry.get_manager_class(probe)
    if manager is not EvictionManager:
        # An unregistered subclass silently falls back to FullAttentionManager:
        # that would serve without ever freeing a block.
        raise RuntimeError(
            f"vLLM's KVCacheSpecRegistry resolved EvictingAttentionSpec to {manager}; "
            "this vLLM version is not supported by vllm-kvevict"
        )
    install_request_schedules()


def install_request_schedules() -> None:
    """Give every evicting manager the schedule of each request it allocates
    for, from the request's extra arguments: vLLM's KV-cache manager sees the
    request, its per-group managers only its id. Installed once per process."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    allocate_slots = KVCacheManager.allocate_slots
    if getattr(allocate_slots, "_kvevict", False):
        return

    @functools.wraps(allocate_slots)
    def _allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        managers = getattr(getattr(self, "coordinator", None), "single_type_managers", None)
        if managers is None:
            raise RuntimeError(
                "vLLM changed: KVCacheManager.coordinator.single_type_managers is gone; "
                "vllm-kvevict cannot give requests their own eviction schedules"
            )
        evicting = [m for m in managers if isinstance(m, EvictionManager)]
        if evicting:
            params = getattr(request, "sampling_params", None)
            extra_args = getattr(params, "extra_args", None)
            for manager in evicting:
                manager.track_request(request.request_id, extra_args)
        return allocate_slots(self, request, *args, **kwargs)

    _allocate_slots._kvevict = True  # type: ignore[attr-defined]
    KVCacheManager.allocate_slots = _allocate_slots
