"""What the CPU backend's layers run: one small object per ``attention_kernel``
and storage (:class:`~vllm_kvevict.plugin.backends.evicting_impl.Kernels`),
chosen once when the Impl is made (:func:`cpu_kernels`).

=============================  =======================================================
kernel, storage                the step's attention; after an eviction point
=============================  =======================================================
native, slots                  vLLM's kernel through a shifted block table
torch, slots                   torch over each request's slots
native, head_pages             vLLM's kernel for requests not compacted yet, our C++
                               kernel over the page tables for the others; after a
                               point, our C++ kernel
torch, head_pages; any global  the page tables, by our C++ kernel (native) or its
                               torch twin
triton, any                    the Triton kernels under Triton's interpreter, on
                               vLLM's logical cache view (the CUDA backend's path)
=============================  =======================================================

Outside Triton the cache is vLLM's CPU cache in its ISA page order, read
through the probed layout (:class:`~vllm_kvevict.plugin.backends.cpu.head_pages.HeadPagedCache`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from vllm_kvevict import cpu_ops
from vllm_kvevict.eviction.cache_ops import CacheOps
from vllm_kvevict.eviction.point import EvictionPoint
from vllm_kvevict.plugin.backends.cpu.head_pages import HeadPagedCache, head_paged_cache
from vllm_kvevict.plugin.backends.evicting_impl import Kernels
from vllm_kvevict.plugin.backends.step_plan import EvictionStepPlan
from vllm_kvevict.plugin.backends.triton.impl import TritonKernels


def head_paged_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU cache ``[num_blocks, H, block_size, 2 * D]`` as head-pages:
    ``[num_blocks, H, 2 * block_size, D]``, each a K block then a V block."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1)


class PageTableKernels(Kernels):
    """Page tables by our C++ kernel (``native``) or its torch twin; the
    cache in vLLM's ISA page order."""

    def __init__(self, impl: CPUAttentionBackendImpl, native: bool, storage: str) -> None:
        super().__init__(impl)
        self.native = native
        # head_pages loaded the extension at start-up; slots and global storage
        # neither gather nor write head-pages with it, and must not build it here.
        self.native_cache = native and storage == "head_pages"

    def layer_cache(self, layer: AttentionLayer, kv_cache: torch.Tensor, plan: EvictionStepPlan) -> CacheOps:
        return head_paged_cache(
            head_paged_view(kv_cache), plan.backend_data,
            layer.isa,  # type: ignore[attr-defined]
            layer._k_scale_float, layer._v_scale_float, self.impl.kv_cache_dtype,
            native=self.native_cache,
        )

    def pool_cache(self, blocks: torch.Tensor, plan: EvictionStepPlan) -> CacheOps:
        return HeadPagedCache(blocks, plan.backend_data)

    def attend_head_pages(
        self, plan: EvictionStepPlan, layer_index: int, query: torch.Tensor, cache: Any,
        output: torch.Tensor, query_start: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor,
        requests: slice, region_start: torch.Tensor, block_offset: int = 0,
    ) -> None:
        batch = plan.head_paged_batch(
            layer_index, requests, query_start, seq_lens, region_start, block_offset, query.device
        )
        layout = plan.backend_data
        out, _ = cpu_ops.head_paged_attention(
            query, cache.kv_cache, layout.key_index, layout.value_index,
            batch, self.impl.scale, native=self.native,
        )
        output.copy_(out.view(output.shape).to(output.dtype))


class NativeHeadPagesKernels(PageTableKernels):
    """head_pages, native: each run of the batch through vLLM's kernel (not
    compacted yet: every token in its standard slots from 0, attended exactly
    as without eviction) or our C++ kernel over the page tables."""

    def __init__(self, impl: CPUAttentionBackendImpl) -> None:
        super().__init__(impl, native=True, storage="head_pages")

    def attend_step(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, attn_metadata: Any, output: torch.Tensor,
    ) -> None:
        starts = plan.query_start
        for first, end, metadata in attn_metadata.attention_runs:
            tokens = slice(starts[first], starts[end])
            if metadata is not None:
                CPUAttentionBackendImpl.forward(
                    self.impl, layer, query[tokens], key[tokens], value[tokens], kv_cache, metadata,
                    output[tokens],
                )
            else:
                self.attend_head_pages(
                    plan, layer_index, query[tokens], cache, output[tokens],
                    [q - starts[first] for q in starts[first : end + 1]], plan.seq_lens[first:end],
                    slice(first, end), plan.region_start[first:end],
                )


class VLLMSlotsKernels(PageTableKernels):
    """slots, native: vLLM's kernel over the live slots ``[0, prefix)`` and
    ``[frontier, seq_len)``, through the builder's shifted block table."""

    def __init__(self, impl: CPUAttentionBackendImpl) -> None:
        super().__init__(impl, native=True, storage="slots")

    def attend_step(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, attn_metadata: Any, output: torch.Tensor,
    ) -> None:
        CPUAttentionBackendImpl.forward(self.impl, layer, query, key, value, kv_cache, attn_metadata, output)

    def attend_segment(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int, ev: EvictionPoint,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, output: torch.Tensor,
    ) -> None:
        tokens = ev.segment_tokens
        CPUAttentionBackendImpl.forward(
            self.impl, layer, query[tokens], key[tokens], value[tokens], kv_cache,
            ev.backend_data, output[tokens],
        )


class TorchSlotsKernels(PageTableKernels):
    """slots, torch: each request's queries over its slots ``[0, prefix)``
    and ``[start, end)`` in torch."""

    def __init__(self, impl: CPUAttentionBackendImpl) -> None:
        super().__init__(impl, native=False, storage="slots")

    def attend_step(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, attn_metadata: Any, output: torch.Tensor,
    ) -> None:
        starts = plan.slots_region_start()
        for i, seq_len in enumerate(plan.seq_lens):
            tokens = slice(plan.query_start[i], plan.query_start[i + 1])
            prefix = plan.protected_prefix[i] if starts[i] >= plan.protected_prefix[i] else 0
            self.region_attention(plan, cache, i, tokens, prefix, starts[i], seq_len, query, output)

    def attend_segment(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int, ev: EvictionPoint,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, output: torch.Tensor,
    ) -> None:
        prefix, start = ev.slots_segment_region
        self.region_attention(plan, cache, ev.batch_index, ev.segment_tokens, prefix, start, ev.segment_end, query, output)

    def region_attention(
        self, plan: EvictionStepPlan, cache: HeadPagedCache, batch_index: int, tokens: slice,
        prefix: int, region_start: int, region_end: int, query: torch.Tensor, output: torch.Tensor,
    ) -> None:
        """``tokens`` (the last of the region) over slots ``[0, prefix)`` and
        ``[start, end)``. Every query lies after the prefix, so the prefix's
        keys may stand just before the region's: the causal mask sees the one
        sequence ``[start - prefix, end)``."""
        block_row = plan.block_table[batch_index]
        keys, values = cache.read_slots(block_row, region_start, region_end)
        if prefix:
            prefix_keys, prefix_values = cache.read_slots(block_row, 0, prefix)
            keys, values = torch.cat([prefix_keys, keys], dim=1), torch.cat([prefix_values, values], dim=1)
        output[tokens] = cpu_ops.region_attention(
            query[tokens], keys, values, region_start - prefix, self.impl.scale
        ).to(output.dtype)


def cpu_kernels(impl: CPUAttentionBackendImpl, kernel: str, storage: str) -> Kernels:
    """The kernels of a server whose ``attention_kernel`` resolved to
    ``kernel`` (``native``, ``torch`` or ``triton``) with ``storage``
    (``slots``, ``head_pages`` or ``global``)."""
    if kernel == "triton":
        return TritonKernels(impl)
    if storage == "slots":
        return VLLMSlotsKernels(impl) if kernel == "native" else TorchSlotsKernels(impl)
    if storage == "head_pages" and kernel == "native":
        return NativeHeadPagesKernels(impl)
    return PageTableKernels(impl, native=kernel == "native", storage=storage)
