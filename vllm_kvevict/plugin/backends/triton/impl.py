"""The Triton kernels of an evicting Impl: cache operations on vLLM's logical
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

from vllm_kvevict.plugin.backends.evicting_impl import Kernels
from vllm_kvevict.plugin.backends.step_plan import EvictionStepPlan
from vllm_kvevict.plugin.backends.triton.cache import TritonPagedCache


class TritonKernels(Kernels):
    """Cache operations on vLLM's logical cache view and attention by the
    Triton kernel over the page tables."""

    writes_logical_cache = True

    def layer_cache(self, layer: AttentionLayer, kv_cache: torch.Tensor, plan: EvictionStepPlan) -> TritonPagedCache:
        return TritonPagedCache(kv_cache)

    def pool_cache(self, blocks: torch.Tensor, plan: EvictionStepPlan) -> TritonPagedCache:
        return TritonPagedCache(blocks)

    def attend_head_pages(
        self, plan: EvictionStepPlan, layer_index: int, query: torch.Tensor, cache: Any,
        output: torch.Tensor, query_start: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor,
        requests: slice, region_start: torch.Tensor, block_offset: int = 0,
    ) -> None:
        from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention

        assert isinstance(cache, TritonPagedCache)
        batch = plan.head_paged_batch(
            layer_index, requests, query_start, seq_lens, region_start, block_offset, query.device
        )
        out, _ = head_paged_attention(
            query, cache.key_cache, cache.value_cache, batch, self.impl.scale,
            max_seq_len=plan.max_region_len,
        )
        output.copy_(out.view(output.shape).to(output.dtype))
