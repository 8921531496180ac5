"""The per-layer forward every evicting attention backend shares, which runs
the eviction engine.

A backend mixes :class:`EvictingImpl` into vLLM's attention Impl for its
platform and gives it the cache operations and the attention kernels it runs
(:class:`Kernels`, chosen once per Impl). Per layer, with the step's plan
(:class:`~vllm_kvevict.plugin.backends.step_plan.EvictionStepPlan`):

* attention over each request's live tokens;
* at each eviction point, after the attention of the tokens before it, the
  eviction engine (:mod:`vllm_kvevict.eviction`) on this layer's cache; the
  tokens of the step after the point then attend over what it left. Within
  one layer that is exact: the layer's queries, keys and values depend only
  on the layer below, so the request's output is the same as if the scheduler
  had cut its steps at the points. The scheduler frees the blocks below the
  new frontier once the step's output is in.

RoPE positions stay true: only what attention reads changes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionLayer

from vllm_kvevict.eviction.cache_ops import CacheOps
from vllm_kvevict.eviction.global_pages import PooledEviction, compact_global_many
from vllm_kvevict.eviction.head_pages import (
    block_head_pages, compact_head_pages_many, compact_layers_many, compacts_together,
)
from vllm_kvevict.eviction.point import (
    EvictionPoint, LayerEviction, ScoringInputsFor, StreamRows, observation_queries_many,
    observation_rows,
)
from vllm_kvevict.eviction.slots import evict_slots_layers_many, evict_slots_many
from vllm_kvevict.policies import ScoringInputs
from vllm_kvevict.plugin.worker.gate_capture import current_capture
from vllm_kvevict.plugin.worker.layer_neighbours import model_parts
from vllm_kvevict.plugin.backends.step_plan import (
    EvictionStepPlan,
    remember_worker_config,
    whole_query_group,
)

POOLED_WINDOWS = -1
"""The key of the pooled layers' observation windows (each request's last
compacting point) in ``plan.observation_rows``, beside the waves' indexes."""


class Kernels:
    """What one backend's layers run with eviction: the engine's cache
    operations and the attention kernels, chosen once per Impl (for a
    server's kernel and storage) and called as the evicting forward's hooks.

    The base attends every request over its page tables (a ``slots``
    request: one with no compacted tokens whose standard region starts at
    its frontier) through :meth:`attend_head_pages`; a subclass gives the
    caches and that kernel, and may attend otherwise.
    """

    writes_logical_cache = False
    """Whether new tokens are written into vLLM's logical cache view
    ``[blocks, H, block_size, K|V]`` by us, instead of by the platform's writer."""

    def __init__(self, impl: Any) -> None:
        self.impl = impl  # the layer's Impl: its scale, cache dtype and vLLM's forward

    def layer_cache(self, layer: AttentionLayer, kv_cache: torch.Tensor, plan: EvictionStepPlan) -> CacheOps:
        """The engine's cache operations on vLLM's view of one layer's cache."""
        raise NotImplementedError

    def pool_cache(self, blocks: torch.Tensor, plan: EvictionStepPlan) -> CacheOps:
        """The same on every layer's blocks as one pool (global eviction), in
        the layout of ``layer_cache(...).kv_cache``."""
        raise NotImplementedError

    def attend_step(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: CacheOps, attn_metadata: Any, output: torch.Tensor,
    ) -> None:
        """Every token of the step over its request's live tokens."""
        num_tokens = plan.query_start[-1]
        query_start, seq_lens, frontier = plan.device_lengths(query.device)
        region = plan.region_start
        if plan.storage == "slots":
            region = frontier
            if any(plan.protected_prefix):
                region = torch.tensor(plan.slots_region_start(), dtype=torch.int64, device=query.device)
        self.attend_head_pages(
            plan, layer_index, query[:num_tokens], cache, output[:num_tokens],
            query_start, seq_lens, slice(None), region,
        )

    def attend_segment(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int, ev: EvictionPoint,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: CacheOps, output: torch.Tensor,
    ) -> None:
        """The tokens after ``ev.point`` over what it left: with slots the
        region from the new frontier, with head pages the compacted tokens
        and the standard region from the point."""
        tokens = ev.segment_tokens
        region = ev.slots_segment_region[1] if plan.storage == "slots" else ev.point
        self.attend_head_pages(
            plan, layer_index, query[tokens], cache, output[tokens],
            [0, tokens.stop - tokens.start], [ev.segment_end],
            slice(ev.batch_index, ev.batch_index + 1),
            torch.tensor([region], dtype=torch.int64, device=query.device),
        )

    def attend_head_pages(
        self, plan: EvictionStepPlan, layer_index: int, query: torch.Tensor, cache: CacheOps,
        output: torch.Tensor, query_start: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor,
        requests: slice, region_start: torch.Tensor, block_offset: int = 0,
    ) -> None:
        """The head-paged kernel over the page tables of the batch's
        ``requests`` (lengths as host lists, or device tensors already
        copied; ``block_offset``: the layer's blocks in a pool of every layer's)."""
        raise NotImplementedError


class EvictingImpl:
    """Mixed into a backend's attention Impl: a layer's forward with eviction,
    through the Impl's :class:`Kernels` (``self.kernels``, set by the backend
    when eviction is on)."""

    scale: float
    head_size: int
    num_heads: int
    kernels: Kernels

    def init_eviction(self) -> None:
        remember_worker_config()

    # The forward.

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's forward (the backend's base Impl, next in the MRO) unless the
        step has an eviction plan."""
        plan = getattr(attn_metadata, "eviction", None)
        if plan is None:
            return super().forward(  # type: ignore[misc]
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )
        return self.forward_evicting(plan, layer, query, key, value, kv_cache, attn_metadata, output)

    def forward_evicting(
        self,
        plan: EvictionStepPlan,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
    ) -> torch.Tensor:
        layer_index = plan.layer_index[layer.layer_name]
        state, num_tokens = plan.state, plan.query_start[-1]
        kernels = self.kernels
        cache = kernels.layer_cache(layer, kv_cache, plan)
        plan.observer.layer_started(layer_index, kv_cache, cache)
        if plan.storage == "global":
            self._global_forward(plan, layer, layer_index, query, cache, attn_metadata, output)
            if plan.rule.policy.needs_queries:
                last = plan.last_compactions
                windows = self._observations(plan, layer_index, POOLED_WINDOWS, list(last.values()), query)
                for i, window in zip(last, windows):
                    plan.pooled_queries[layer_index, i] = window
        else:
            kernels.attend_step(plan, layer, layer_index, query, key, value, kv_cache, cache, attn_metadata, output)
        # The eviction engine's calls alone are timed: the attention of the
        # tokens after a point is the step's own work, evicting or not. Each
        # call takes every request's k-th point of the step (a wave).
        for wave_index, wave in enumerate(plan.waves if plan.storage != "global" else []):
            if plan.storage == "head_pages":
                wave = [ev for ev in wave if ev.compacts]
                if not wave:
                    continue
            started = time.perf_counter()
            windows = self._observations(plan, layer_index, wave_index, wave, query)
            evictions = [
                LayerEviction(
                    ev,
                    state.stream_rows(layer_index, ev.state_row) if plan.storage == "head_pages"
                    else StreamRows(state.positions[layer_index, ev.state_row]),
                    plan.block_table[ev.batch_index], self._scoring_inputs(plan, layer_index, window),
                )
                for ev, window in zip(wave, windows)
            ]
            if plan.storage == "slots":
                if self._defers(plan, layer_index, kv_cache, cache, evictions):
                    plan.deferred.append((layer_index, cache, evictions, []))
                else:
                    for counts in evict_slots_many(cache, plan.rule, evictions, layer_index, plan.observer):
                        if counts is not None:
                            state.observe_head_retained(counts)
            else:
                lengths = plan.compacted_lengths(layer_index, wave_index)
                if self._defers(plan, layer_index, kv_cache, cache, evictions):
                    plan.deferred.append((layer_index, cache, evictions, lengths))  # type: ignore[arg-type]
                else:
                    kept = compact_head_pages_many(cache, plan.rule, evictions, layer_index, plan.observer, lengths)
                    for ev, counts in zip(wave, kept):
                        state.record_compaction(ev.request_id, ev.point, ev.frontier_after, layer_index, counts)
            plan.eviction_seconds += time.perf_counter() - started
            for ev in wave:
                if ev.segment_end > ev.point:
                    kernels.attend_segment(plan, layer, layer_index, ev, query, key, value, kv_cache, cache, output)
        if plan.storage == "global" and layer_index == state.num_layers - 1:
            started = time.perf_counter()
            self._compact_global(plan)
            plan.eviction_seconds += time.perf_counter() - started
        if plan.deferred and layer_index == state.num_layers - 1:
            started = time.perf_counter()
            self._compact_deferred(plan)
            plan.eviction_seconds += time.perf_counter() - started
        plan.observer.layer_finished(output[:num_tokens])
        if layer_index == len(plan.layer_index) - 1:
            state.end_step(plan.num_evictions, plan.eviction_seconds)
        if plan.ring_tokens is not None:
            ring = state.query_ring[layer_index]
            ring.view(-1, *ring.shape[2:]).index_copy_(
                0, plan.ring_slots, query[plan.ring_tokens].to(ring.dtype)
            )
        return output

    def _defers(
        self, plan: EvictionStepPlan, layer_index: int, kv_cache: torch.Tensor, cache: CacheOps,
        evictions: list[LayerEviction],
    ) -> bool:
        """Whether this layer's evictions (head pages or slots) wait for the
        step's last layer, to run there as one batch of every layer
        (:meth:`_compact_deferred`):
        decided at the step's first evicting layer, where every compacting
        point is at the step's end (no token of the step attends after it,
        so a layer may evict after the later layers ran), the batch would
        take the layer's evictions (``compacts_together``: the device path),
        and every layer's cache lies in one pool of blocks."""
        state = plan.state
        if plan.defers_to_step_end is None:
            waves = plan.waves
            plan.defers_to_step_end = (
                layer_index < state.num_layers - 1
                and len(waves) == 1
                and all(ev.segment_end == ev.point for ev in waves[0] if ev.compacts or plan.storage == "slots")
                and compacts_together(cache, plan.rule, evictions)
            )
        if not plan.defers_to_step_end:
            return False
        before = state.global_cache
        pool, offset = state.pool_view(layer_index, kv_cache)
        if pool is None or (plan.deferred and pool is not before):
            plan.defers_to_step_end = False  # not one pool: the layers waiting evict now, this one in place
            self._compact_deferred(plan, together=False)
            return False
        plan.deferred_offsets.append(offset)
        return True

    def _compact_deferred(self, plan: EvictionStepPlan, together: bool = True) -> None:
        """The evictions that waited for the last layer, every layer's as one
        batch on the pool of every layer's blocks
        (:func:`~vllm_kvevict.eviction.head_pages.compact_layers_many`,
        :func:`~vllm_kvevict.eviction.slots.evict_slots_layers_many`), or
        layer by layer where they do not run as one (or not ``together``)."""
        state, deferred, layer_offsets = plan.state, plan.deferred, plan.deferred_offsets
        plan.deferred, plan.deferred_offsets = [], []
        if not deferred:
            return
        evictions = [e for _, _, layer_evictions, _ in deferred for e in layer_evictions]
        layers = [layer_index for layer_index, _, layer_evictions, _ in deferred for _ in layer_evictions]
        offsets = [o for o, (_, _, layer_evictions, _) in zip(layer_offsets, deferred) for _ in layer_evictions]
        if plan.storage == "slots":
            retained = None
            if together and state.global_cache is not None:
                retained = evict_slots_layers_many(
                    self.kernels.pool_cache(state.global_cache, plan), plan.rule, evictions, layers, offsets,
                    plan.observer,
                )
            if retained is None:
                retained = [
                    counts
                    for layer_index, cache, layer_evictions, _ in deferred
                    for counts in evict_slots_many(cache, plan.rule, layer_evictions, layer_index, plan.observer)
                ]
            for counts in retained:
                if counts is not None:
                    state.observe_head_retained(counts)
            return
        kept = None
        if together and state.global_cache is not None:
            lengths = [n for _, _, _, layer_lengths in deferred for n in layer_lengths]
            kept = compact_layers_many(
                self.kernels.pool_cache(state.global_cache, plan), plan.rule, evictions, layers, offsets,
                plan.observer, lengths,
            )
        if kept is None:
            kept = [
                counts
                for layer_index, cache, layer_evictions, layer_lengths in deferred
                for counts in compact_head_pages_many(
                    cache, plan.rule, layer_evictions, layer_index, plan.observer, layer_lengths
                )
            ]
        for eviction, layer_index, counts in zip(evictions, layers, kept):
            ev = eviction.ev
            state.record_compaction(ev.request_id, ev.point, ev.frontier_after, layer_index, counts)

    def _observations(
        self, plan: EvictionStepPlan, layer_index: int, wave_index: int, wave: list[EvictionPoint],
        query: torch.Tensor,
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Each point's observation queries in this layer and their positions
        (``None`` each, for a policy that reads none), before the layer's ring
        takes this step's queries: one gather for the wave (``wave_index``;
        :data:`POOLED_WINDOWS` for the pooled layers' last compacting points)
        (:func:`~vllm_kvevict.eviction.point.observation_queries_many`;
        where the rows are, found once per step for every layer), completed
        to whole query groups by one collective."""
        if not plan.rule.policy.needs_queries:
            return [None] * len(wave)
        if not wave:
            return []
        rings = plan.state.query_ring[layer_index]
        rows = plan.observation_rows.get(wave_index)
        if rows is None:
            rows = plan.observation_rows[wave_index] = observation_rows(wave, rings.shape[1], query.device)
        windows = observation_queries_many(rings, query, rows)
        if plan.kv_head_replicas > 1:
            spans = [queries.shape[1] for queries, _ in windows]
            whole = whole_query_group(
                torch.cat([queries for queries, _ in windows], dim=1), plan.kv_head_replicas, plan.first_replica_rank
            )
            windows = [(part, positions) for part, (_, positions) in zip(whole.split(spans, dim=1), windows)]
        return windows

    def _scoring_inputs(
        self, plan: EvictionStepPlan, layer_index: int, window: tuple[torch.Tensor, torch.Tensor] | None
    ) -> ScoringInputsFor:
        """What the policy scores with at a point: its observation queries
        (``window``, from :meth:`_observations`) and the model parts it asks
        for, around the tokens the engine gathers."""
        queries, query_positions = window if window is not None else (None, None)
        parts = self._model_parts(plan, layer_index)

        def inputs(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, evicted: Any) -> ScoringInputs:
            return ScoringInputs(
                keys, values, positions, queries, query_positions, self.scale, evicted, **parts,
            )

        return inputs

    @staticmethod
    def _model_parts(plan: EvictionStepPlan, layer_index: int) -> dict[str, Any]:
        """The model parts the policy scores with in layer ``layer_index``
        (looked up when the model was loaded)."""
        policy = plan.rule.policy
        if not (policy.needs_rotary or policy.needs_output_projection):
            return {}
        parts = model_parts(plan.layer_names[layer_index])
        return {"rotary": parts.rotary, "output_projection": parts.output_projection}

    def _global_forward(
        self,
        plan: EvictionStepPlan,
        layer: AttentionLayer,
        layer_index: int,
        query: torch.Tensor,
        cache: Any,
        attn_metadata: Any,
        output: torch.Tensor,
    ) -> None:
        """Pooled layers (head_budget global or pyramid): store this step's log β
        (the learned policy's) and attend over the
        layer's page tables (pages of any layer). Every layer is ranked
        together after the last one, at the step's last compacting point
        (DBTrimKV compresses between forward passes): tokens of the step after
        an earlier point attend to the uncompacted cache, which the request
        holds during the step anyway, and the blocks freed are the schedule's."""
        state, bs = plan.state, plan.schedule.block_size
        whole, offset = state.global_kv(layer_index, cache.kv_cache, bs)
        num_tokens = plan.query_start[-1]
        if plan.rule.policy.needs_log_beta:
            capture = current_capture()
            if capture is None:
                raise RuntimeError("policy 'learned' is serving, but no retention gates were loaded")
            log_beta = capture.take(layer.layer_name, num_tokens)[:, plan.local_kv_heads]
            slots = attn_metadata.slot_mapping[:num_tokens].long()
            pages = block_head_pages(offset + slots // bs, cache.num_heads).view(num_tokens, -1)
            state.log_beta_pages[pages.long(), (slots % bs)[:, None].expand_as(pages)] = log_beta.float()
            if layer_index == state.num_layers - 1:
                capture.pending.clear()  # what vLLM's dummy runs left behind
        query_start, seq_lens, _ = plan.device_lengths(query.device)
        self.kernels.attend_head_pages(
            plan, layer_index, query[:num_tokens], self.kernels.pool_cache(whole, plan),
            output[:num_tokens], query_start, seq_lens, slice(None), plan.region_start, offset,
        )

    def _compact_global(self, plan: EvictionStepPlan) -> None:
        """Each request's last compacting point of the step, over every layer."""
        state = plan.state
        assert state.global_cache is not None
        cache = self.kernels.pool_cache(state.global_cache, plan)
        layers = range(state.num_layers)
        requests = [
            PooledEviction(
                ev, [state.stream_rows(layer_index, ev.state_row) for layer_index in layers],
                plan.block_table[i], plan.region_start_host[i], plan.frontier_before[i],
                [plan.pooled_queries.get((layer_index, i)) for layer_index in layers],
                [self._model_parts(plan, layer_index) for layer_index in layers],
            )
            for i, ev in plan.last_compactions.items()
        ]
        kept = compact_global_many(
            cache, plan.rule, requests, [state.layer_block_offset[layer_index] for layer_index in layers],
            state.log_beta_pages, self.scale, plan.observer,
        )
        for request, per_layer in zip(requests, kept):
            ev = request.ev
            for layer_index, counts in enumerate(per_layer):
                state.record_compaction(ev.request_id, ev.point, ev.frontier_after, layer_index, counts)
