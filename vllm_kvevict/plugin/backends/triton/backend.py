"""The evicting attention backend for CUDA GPUs, on vLLM's Triton attention.

Registered under its own name (``KVEVICT_TRITON``, see
:mod:`vllm_kvevict`), which ``--kv-eviction`` selects on CUDA. With eviction
off (a layer whose spec does not evict, vLLM's profiling and dummy runs)
every method falls through to vLLM's ``TRITON_ATTN``.

With eviction on:

* the cache is declared ``LBHNC`` (each block ``[H, block_size, K|V]``), the
  order the CPU platform uses, so the per-head pages the engine compacts into
  are contiguous; the kernels read vLLM's logical view through its strides
  and would take ``LBNHC`` as well;
* new tokens are written by torch indexing into the logical view (the step's
  real tokens, counted on the host: padded slots are skipped without a sync),
  the writer the CPU platform tests; attention and compaction run the kernels of
  :mod:`vllm_kvevict.triton_kernels` (:mod:`~vllm_kvevict.plugin.backends.triton.impl`);
* the metadata builder reports ``AttentionCGSupport.NEVER`` for evicting
  specs, so vLLM falls back to piecewise CUDA graphs: attention runs eagerly
  between the captured pieces, and an eviction step's host-side work (the
  policy's scores, page assignment) is allowed;
* the step plan reads lengths and offsets from vLLM's host copies
  (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``), not from the
  device; eviction steps themselves sync where the engine reads counts;
* Model Runner V2 and async scheduling are turned off at start-up
  (:mod:`~vllm_kvevict.plugin.frontend.cli`): the runner hooks wrap the V1 runner,
  and the scheduler must see each step's frontier before it frees blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_kvevict.backend_name import GPU_BACKEND_NAME
from vllm_kvevict.plugin.compat import check_gpu_backend_contract
from vllm_kvevict.plugin.backends.evicting_impl import EvictingImpl
from vllm_kvevict.plugin.backends.step_plan import EvictingBuilder, EvictionStepPlan, evicting_spec
from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec
from vllm_kvevict.plugin.backends.triton.cache import write_new_tokens
from vllm_kvevict.plugin.backends.triton.impl import TritonKernels

# Everything below subclasses or calls these; fail at import, not mid-request.
check_gpu_backend_contract()


class KVEvictTritonBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        # The enum member registered for this backend: Attention looks itself up by it.
        return GPU_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KVEvictTritonImpl]:
        return KVEvictTritonImpl

    @staticmethod
    def get_builder_cls() -> type[KVEvictTritonMetadataBuilder]:
        return KVEvictTritonMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return evicting_spec(super().customize_spec(spec))


@dataclasses.dataclass
class KVEvictTritonMetadata(TritonAttentionMetadata):
    eviction: EvictionStepPlan | None = None


class KVEvictTritonMetadataBuilder(EvictingBuilder, TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = TritonAttentionMetadataBuilder._cudagraph_support

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: VllmConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        if isinstance(kv_cache_spec, EvictingAttentionSpec):
            # Piecewise graphs: attention (and eviction) runs eagerly.
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.init_eviction(kv_cache_spec, layer_names, vllm_config, device, self.num_heads_q, "triton"):
            self.publish_attention_kernel("triton")

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonAttentionMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        batch = self.step_batch(cm)
        if batch is None:
            return metadata  # eviction off, or one of vLLM's dummy/profiling runs
        values = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return KVEvictTritonMetadata(**values, eviction=self.plan_step(cm, batch))


class KVEvictTritonImpl(EvictingImpl, TritonAttentionImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_eviction()
        self.kernels = TritonKernels(self)

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        plan = _step_plan(layer)
        if plan is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        write_new_tokens(kv_cache, key, value, slot_mapping, plan.query_start[-1])


def _step_plan(layer: AttentionLayer) -> EvictionStepPlan | None:
    """This step's eviction plan for ``layer``, from vLLM's forward context."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)
    return getattr(metadata, "eviction", None)
