"""The evicting attention backend for vLLM's CPU platform.

Registered over ``AttentionBackendEnum.CPU_ATTN`` (the CPU platform ignores
``--attention-backend`` but honours overrides). With eviction off every method
falls through to vLLM's own CPU backend.

With eviction on, the builder plans each step and the Impl runs the eviction
engine layer by layer (:mod:`~vllm_kvevict.plugin.backends.evicting_impl`), with
the kernels ``attention_kernel`` names (one object per kernel and storage,
chosen when the Impl is made: :mod:`~vllm_kvevict.plugin.backends.cpu.kernels`):

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
from vllm_kvevict.eviction.allocation import round_on_host
from vllm_kvevict.top_k import use_native_selection
from vllm_kvevict.plugin.compat import check_cpu_backend_contract
from vllm_kvevict.plugin.backends.cpu.kernels import cpu_kernels
from vllm_kvevict.plugin.backends.cpu.page_layout import PageLayout, probe_page_layout
from vllm_kvevict.plugin.backends.evicting_impl import EvictingImpl, Kernels
from vllm_kvevict.plugin.backends.step_plan import (
    EvictingBuilder,
    EvictionStepPlan,
    active_config,
    evicting_spec,
)
from vllm_kvevict.plugin.backends.triton.cache import write_new_tokens

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
        round_on_host(True)  # nothing to wait for in a read of the counts here
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


class KVEvictCPUImpl(EvictingImpl, CPUAttentionBackendImpl):
    """vLLM's CPU Impl with eviction, running the kernels the server's
    ``attention_kernel`` and storage name
    (:func:`~vllm_kvevict.plugin.backends.cpu.kernels.cpu_kernels`), chosen once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_eviction()
        config = active_config()
        # None with eviction off: vLLM's forward and cache writer serve.
        self.kernels: Kernels | None = (  # type: ignore[assignment]
            cpu_kernels(self, config.kernel_for("cpu"), config.storage_name) if config is not None else None
        )

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.kernels is not None and self.kernels.writes_logical_cache:
            write_new_tokens(kv_cache, key, value, slot_mapping)
        else:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
