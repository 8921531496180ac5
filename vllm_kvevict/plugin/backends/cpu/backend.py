"""The evicting attention backend for vLLM's CPU platform.

Registered over ``AttentionBackendEnum.CPU_ATTN`` (the CPU platform ignores
``--attention-backend`` but honours overrides). With eviction off every method
falls through to vLLM's own CPU backend.

With eviction on, the builder plans each step and the Impl runs the eviction
engine layer by layer (:mod:`~vllm_kvevict.plugin.backends.evicting_impl`), with
the kernels ``attention_kernel`` names:

* ``native``: with ``slots`` storage vLLM's C++ kernel through a block table
  and sequence lengths shifted by the (block-aligned) frontier; with
  ``head_pages`` our C++ kernel over the per-(layer, KV head) page tables
  (:mod:`vllm_kvevict.cpu_ops`) for the requests that have compacted, and
  vLLM's for those that have not (a prompt's chunks before its end-of-prompt
  eviction: every token still in its standard slots). New tokens are written by vLLM's own
  ``do_kv_cache_update`` in its ISA page order, which
  :class:`~vllm_kvevict.plugin.backends.cpu.head_pages.HeadPagedCache` reads
  through the probed layout;
* ``torch``: the same over the torch implementation;
* ``triton``: the CUDA backend's path (:mod:`~vllm_kvevict.plugin.backends.triton.impl`)
  under Triton's interpreter: new tokens written by torch indexing into
  vLLM's logical ``[blocks, H, block_size, K|V]`` view, attention and
  compaction by the Triton kernels. Slow, and the way the GPU path is tested
  inside vLLM on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionLayer, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_kvevict import cpu_ops
from vllm_kvevict.eviction.cache_ops import CacheOps
from vllm_kvevict.eviction.point import EvictionPoint
from vllm_kvevict.top_k import use_native_selection
from vllm_kvevict.plugin.compat import check_cpu_backend_contract
from vllm_kvevict.plugin.backends.cpu.head_pages import HeadPagedCache, head_paged_cache
from vllm_kvevict.plugin.backends.cpu.page_layout import PageLayout, probe_page_layout
from vllm_kvevict.plugin.backends.step_plan import (
    EvictingBuilder,
    EvictionStepPlan,
    active_config,
    evicting_spec,
)
from vllm_kvevict.plugin.backends.triton.cache import write_new_tokens
from vllm_kvevict.plugin.backends.triton.impl import TritonEvictingImpl

# Everything below subclasses or calls these; fail at import, not mid-request.
check_cpu_backend_contract()


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
        return evicting_spec(super().customize_spec(spec))


@dataclasses.dataclass
class KVEvictCPUMetadata(CPUAttentionMetadata):
    eviction: EvictionStepPlan | None = None
    # head_pages storage, native kernel: the batch in runs of consecutive
    # requests, (first request, end request, vLLM's metadata for them or
    # None): vLLM's kernel attends a run that has never compacted (every
    # token in its standard slots from 0), ours over the page tables the others.
    attention_runs: list[tuple[int, int, CPUAttentionMetadata | None]] = dataclasses.field(default_factory=list)


class KVEvictCPUMetadataBuilder(EvictingBuilder, CPUAttentionMetadataBuilder):
    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = active_config(vllm_config)
        kernel = config.kernel_for("cpu") if config is not None else "native"
        if not self.init_eviction(kv_cache_spec, layer_names, vllm_config, device, self.num_heads, kernel):
            return
        self.native = kernel == "native"
        self.page_layout: PageLayout | None = None
        if kernel != "triton":
            self.page_layout = probe_page_layout(
                self.block_size, kv_cache_spec.head_size, kv_cache_spec.dtype, self.isa
            )
        serving = kernel
        if self.native:
            # With head pages, build (or load) our kernel now, while the worker
            # starts, rather than stall the first request for the ~30 s compile.
            if not self.head_paged:
                serving = "vllm"
            else:
                # Its selection too: each row's top k in one call.
                use_native_selection(cpu_ops.load_cpu_ops())
                serving = cpu_ops.serving_kernel()
        self.publish_attention_kernel(serving)

    def segment_backend_data(
        self, cm: CommonAttentionMetadata, batch_index: int, first_token: int,
        start: int, end: int, prefix: int, frontier: int,
    ) -> CPUAttentionMetadata | None:
        """vLLM's kernel metadata for one request's tokens ``[start, end)``
        over ``[0, prefix)`` and ``[frontier, end)`` (native kernel, slots storage)."""
        if self.storage != "slots" or not self.native:
            return None
        num_tokens, length = end - start, prefix + end - frontier
        row = cm.block_table_tensor[batch_index : batch_index + 1]
        return self._sub_batch_metadata(
            cm, [0, num_tokens], [length],
            live_block_table(row, torch.tensor([prefix]) // self.block_size, torch.tensor([frontier]) // self.block_size),
            slice(first_token, first_token + num_tokens),
        )

    def _sub_batch_metadata(
        self, cm: CommonAttentionMetadata, query_start: list[int], seq_lens: list[int],
        block_table: torch.Tensor, tokens: slice,
    ) -> CPUAttentionMetadata:
        """vLLM's kernel metadata for some of the step's requests: their
        queries (``query_start``, from 0) over ``seq_lens`` tokens of
        ``block_table``'s rows, the step's ``tokens``."""
        query_start_loc = torch.tensor(query_start, dtype=cm.query_start_loc.dtype)
        num_tokens = query_start[-1]
        sub_batch = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(cm.query_start_loc.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=cm.seq_lens.dtype, device=cm.seq_lens.device),
            num_reqs=len(seq_lens),
            num_actual_tokens=num_tokens,
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
            max_seq_len=max(seq_lens),
            block_table_tensor=block_table,
            slot_mapping=cm.slot_mapping[tokens],
        )
        return super().build(0, sub_batch)

    def attention_runs(
        self, cm: CommonAttentionMetadata, plan: EvictionStepPlan
    ) -> list[tuple[int, int, CPUAttentionMetadata | None]]:
        """head_pages storage: the batch in runs of consecutive requests, with
        vLLM's metadata for each run that has not compacted yet (region start
        0: every token in its standard slots, nothing in pages or moments),
        which vLLM's kernel attends exactly as it would without eviction (a
        prompt's chunks before its end-of-prompt eviction); None for the runs
        our kernel attends over their page tables."""
        if self.storage != "head_pages" or not self.native:
            return []
        region, starts = plan.region_start.tolist(), plan.query_start
        runs: list[tuple[int, int, CPUAttentionMetadata | None]] = []
        for uncompacted, group in itertools.groupby(range(len(region)), key=lambda i: region[i] == 0):
            requests = list(group)
            first, end = requests[0], requests[-1] + 1
            metadata = self._sub_batch_metadata(
                cm, [q - starts[first] for q in starts[first : end + 1]], plan.seq_lens[first:end],
                cm.block_table_tensor[first:end], slice(starts[first], starts[end]),
            ) if uncompacted else None
            runs.append((first, end, metadata))
        return runs

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CPUAttentionMetadata:
        cm = common_attn_metadata
        batch = self.step_batch(cm)
        if batch is None:  # eviction off, or one of vLLM's dummy/profiling runs
            return super().build(common_prefix_len, cm, fast_build)
        plan = self.plan_step(cm, batch, self.page_layout)
        # vLLM's kernel reads the live slots [0, prefix) and [frontier, seq_len)
        # as one sequence: each block-table row without the blocks between,
        # the sequence shortened accordingly.
        frontier = torch.tensor(plan.frontier_before, dtype=cm.seq_lens.dtype)
        prefix = torch.tensor(plan.protected_prefix, dtype=cm.seq_lens.dtype)
        shifted_lens = cm.seq_lens - (frontier - prefix).to(cm.seq_lens.device)
        shifted = dataclasses.replace(
            cm,
            seq_lens=shifted_lens,
            block_table_tensor=live_block_table(
                cm.block_table_tensor, prefix // self.block_size, frontier // self.block_size
            ),
            max_seq_len=int(shifted_lens.max()) if cm.num_reqs else 0,
        )
        metadata = super().build(common_prefix_len, shifted, fast_build)
        values = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return KVEvictCPUMetadata(**values, eviction=plan, attention_runs=self.attention_runs(cm, plan))


def live_block_table(
    table: torch.Tensor, prefix_blocks: torch.Tensor, first_blocks: torch.Tensor
) -> torch.Tensor:
    """Rows of ``table`` without the columns ``[prefix_blocks, first_blocks)``
    (the blocks freed between the protected prefix and the frontier's block):
    a row's first ``prefix_blocks`` columns, then its columns from
    ``first_blocks`` on.

    Columns past the end repeat the last one; the kernel never reads them.
    """
    width = table.shape[1]
    prefix_blocks = prefix_blocks.to(torch.int64)[:, None]
    columns = torch.arange(width)[None, :]
    columns = torch.where(columns < prefix_blocks, columns, columns - prefix_blocks + first_blocks.to(torch.int64)[:, None])
    return table.gather(1, columns.clamp_(max=width - 1).to(table.device))


def head_paged_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU cache ``[num_blocks, H, block_size, 2 * D]`` as head-pages:
    ``[num_blocks, H, 2 * block_size, D]``, each a K block then a V block."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1)


class KVEvictCPUImpl(TritonEvictingImpl, CPUAttentionBackendImpl):
    """vLLM's CPU Impl with eviction; the Triton hooks it inherits run with
    ``attention_kernel: triton``, the CPU kernels' otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_eviction()
        config = active_config()
        # Which writer fills the cache: ours with the Triton kernels (they
        # read vLLM's logical view), vLLM's ISA page order otherwise.
        self.writes_logical_cache = config is not None and config.kernel_for("cpu") == "triton"

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.writes_logical_cache:
            write_new_tokens(kv_cache, key, value, slot_mapping)
        else:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    # The CPU kernels; ``attention_kernel: triton`` takes the inherited hooks.

    def _layer_cache(self, layer: AttentionLayer, kv_cache: torch.Tensor, plan: EvictionStepPlan) -> CacheOps:
        if plan.kernel == "triton":
            return super()._layer_cache(layer, kv_cache, plan)
        return head_paged_cache(
            head_paged_view(kv_cache), plan.backend_data,
            layer.isa,  # type: ignore[attr-defined]
            layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype,
            # head_pages loaded the extension at start-up; slots storage
            # neither gathers nor writes head-pages, and must not build it here.
            native=plan.kernel == "native" and plan.storage == "head_pages",
        )

    def _pool_cache(self, blocks: torch.Tensor, plan: EvictionStepPlan) -> CacheOps:
        if plan.kernel == "triton":
            return super()._pool_cache(blocks, plan)
        return HeadPagedCache(blocks, plan.backend_data)

    def _attend_step(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, attn_metadata: Any, output: torch.Tensor,
    ) -> None:
        if plan.kernel == "native" and plan.storage == "head_pages":
            return self._attend_head_pages_step(
                plan, layer, layer_index, query, key, value, kv_cache, cache, attn_metadata, output
            )
        if plan.kernel == "triton" or plan.storage != "slots":
            return super()._attend_step(
                plan, layer, layer_index, query, key, value, kv_cache, cache, attn_metadata, output
            )
        if plan.kernel == "native":
            CPUAttentionBackendImpl.forward(
                self, layer, query, key, value, kv_cache, attn_metadata, output
            )
        else:
            starts = plan.slots_region_start()
            for i, seq_len in enumerate(plan.seq_lens):
                tokens = slice(plan.query_start[i], plan.query_start[i + 1])
                prefix = plan.protected_prefix[i] if starts[i] >= plan.protected_prefix[i] else 0
                self._region_attention(plan, cache, i, tokens, prefix, starts[i], seq_len, query, output)

    def _attend_head_pages_step(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, attn_metadata: Any, output: torch.Tensor,
    ) -> None:
        """head_pages, native: each run of the batch through vLLM's kernel
        (not compacted yet) or ours over the page tables."""
        starts = plan.query_start
        for first, end, metadata in attn_metadata.attention_runs:
            tokens = slice(starts[first], starts[end])
            if metadata is not None:
                CPUAttentionBackendImpl.forward(
                    self, layer, query[tokens], key[tokens], value[tokens], kv_cache, metadata, output[tokens]
                )
            else:
                self._attend_head_pages(
                    plan, layer_index, query[tokens], cache, output[tokens],
                    [q - starts[first] for q in starts[first : end + 1]], plan.seq_lens[first:end],
                    slice(first, end), plan.region_start[first:end],
                )

    def _attend_segment(
        self, plan: EvictionStepPlan, layer: AttentionLayer, layer_index: int, ev: EvictionPoint,
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        cache: Any, output: torch.Tensor,
    ) -> None:
        """Attention of the tokens after ``ev.point`` over the region it left."""
        if plan.kernel == "triton" or plan.storage != "slots":
            return super()._attend_segment(
                plan, layer, layer_index, ev, query, key, value, kv_cache, cache, output
            )
        tokens = ev.segment_tokens
        if plan.kernel == "native":
            CPUAttentionBackendImpl.forward(
                self, layer, query[tokens], key[tokens], value[tokens], kv_cache,
                ev.backend_data, output[tokens],
            )
        else:
            prefix, start = ev.slots_segment_region
            self._region_attention(
                plan, cache, ev.batch_index, tokens, prefix, start, ev.segment_end, query, output
            )

    def _region_attention(
        self,
        plan: EvictionStepPlan,
        cache: HeadPagedCache,
        batch_index: int,
        tokens: slice,
        prefix: int,
        region_start: int,
        region_end: int,
        query: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Torch attention: ``tokens`` (the last of the region) over slots
        ``[0, prefix)`` and ``[start, end)``. Every query lies after the
        prefix, so the prefix's keys may stand just before the region's: the
        causal mask sees the one sequence ``[start - prefix, end)``."""
        block_row = plan.block_table[batch_index]
        keys, values = cache.read_slots(block_row, region_start, region_end)
        if prefix:
            prefix_keys, prefix_values = cache.read_slots(block_row, 0, prefix)
            keys, values = torch.cat([prefix_keys, keys], dim=1), torch.cat([prefix_values, values], dim=1)
        output[tokens] = cpu_ops.region_attention(
            query[tokens], keys, values, region_start - prefix, self.scale
        ).to(output.dtype)

    def _attend_head_pages(
        self, plan: EvictionStepPlan, layer_index: int, query: torch.Tensor, cache: Any,
        output: torch.Tensor, query_start: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor,
        requests: slice, region_start: torch.Tensor, block_offset: int = 0,
    ) -> None:
        """Our C++ kernel (or its torch twin) over the page tables of the batch's ``requests``."""
        if plan.kernel == "triton":
            return super()._attend_head_pages(
                plan, layer_index, query, cache, output, query_start, seq_lens, requests,
                region_start, block_offset,
            )
        batch = plan.head_paged_batch(
            layer_index, requests, query_start, seq_lens, region_start, block_offset, query.device
        )
        layout = plan.backend_data
        out, _ = cpu_ops.head_paged_attention(
            query, cache.kv_cache, layout.key_index, layout.value_index,
            batch, self.scale, native=plan.kernel == "native",
        )
        output.copy_(out.view(output.shape).to(output.dtype))
