"""The Triton path of an evicting Impl: cache operations on vLLM's logical
cache view (:class:`~vllm_kvevict.plugin.backends.triton.cache.TritonPagedCache`)
and attention by the Triton kernel over per-(request, KV head) page tables,
with MomentKV's moments in the same pass.

One kernel serves the three storages: ``slots`` is a request with no
compacted tokens whose standard region starts at its frontier; ``head_pages``
and ``global`` read their page tables (global: every layer's blocks as one
pool, the layer's block table offset into it). The CUDA backend runs it; the
CPU backend runs it with ``attention_kernel: triton`` under Triton's
interpreter.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionLayer

from vllm_kvevict.eviction.point import EvictionPoint
from vllm_kvevict.plugin.backends.evicting_impl import EvictingImpl
from vllm_kvevict.plugin.backends.step_plan import EvictionStepPlan
from vllm_kvevict.plugin.backends.triton.cache import TritonPagedCache


class TritonEvictingImpl(EvictingImpl):
    def _layer_cache(self, layer: AttentionLayer, kv_cache: torch.Tensor, plan: EvictionStepPlan) -> TritonPagedCache:
        return TritonPagedCache(kv_cache)

    def _pool_cache(self, blocks: torch.Tensor, plan: EvictionStepPlan) -> TritonPagedCache:
        return TritonPagedCache(blocks)

    def _attend_step(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, attn_metadata: Any, output: torch.Tensor,
    ) -> None:
        num_tokens = plan.query_start[-1]
        query_start, seq_lens, frontier = plan.device_lengths(query.device)
        region = plan.region_start
        if plan.storage == "slots":
            region = frontier
            if any(plan.protected_prefix):
                region = torch.tensor(plan.slots_region_start(), dtype=torch.int64, device=query.device)
        self._attend_head_pages(
            plan, layer_index, query[:num_tokens], cache, output[:num_tokens],
            query_start, seq_lens, slice(None), region,
        )

    def _attend_segment(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int, ev: EvictionPoint,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, output: torch.Tensor,
    ) -> None:
        """The tokens after ``ev.point`` over what it left: with slots the
        region from the new frontier, with head pages the compacted tokens
        and the standard region from the point."""
        tokens = ev.segment_tokens
        region = ev.slots_segment_region[1] if plan.storage == "slots" else ev.point
        self._attend_head_pages(
            plan, layer_index, query[tokens], cache, output[tokens],
            [0, tokens.stop - tokens.start], [ev.segment_end],
            slice(ev.batch_index, ev.batch_index + 1),
            torch.tensor([region], dtype=torch.int64, device=query.device),
        )

    def _attend_head_pages(
        self, plan: EvictionStepPlan, layer_index: int, query: torch.Tensor, cache: Any,
        output: torch.Tensor, query_start: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor,
        requests: slice, region_start: torch.Tensor, block_offset: int = 0,
    ) -> None:
        """The Triton kernel over the page tables of the batch's ``requests``
        (lengths as host lists, or device tensors already copied)."""
        from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention

        assert isinstance(cache, TritonPagedCache)
        batch = plan.head_paged_batch(
            layer_index, requests, query_start, seq_lens, region_start, block_offset, query.device
        )
        out, _ = head_paged_attention(
            query, cache.key_cache, cache.value_cache, batch, self.scale,
            max_seq_len=plan.max_region_len,
        )
        output.copy_(out.view(output.shape).to(output.dtype))
