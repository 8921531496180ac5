"""The eviction engine's cache operations on vLLM's CPU KV cache.

vLLM's CPU cache of a layer is ``[num_blocks, H, 2 * block_size, D]``: block
``b`` holds one *head-page* per KV-head slot ``s`` (id ``b * H + s``), a K page
then a V page. Standard slots (where vLLM's cache writer puts new tokens) are
in vLLM's ISA-specific page order (:mod:`cpu_page_layout`), read through the
probed offsets and written through vLLM's own op. Compacted head-pages hold
their tokens in a plain logical order (``[block_size, D]`` keys, then values)
that only our kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from vllm import _custom_ops as ops

from vllm_kvevict import cpu_ops
from vllm_kvevict.eviction.cache_ops import CacheOps, CopiesHeads
from vllm_kvevict.schedule import cdiv
from vllm_kvevict.plugin.backends.cpu.page_layout import PageLayout


@dataclass
class HeadPagedCache(CacheOps):
    """:class:`~vllm_kvevict.eviction.cache_ops.CacheOps` over one
    ``[num_blocks, H, 2 * bs, D]`` cache (one layer's, or every layer's as one
    pool of blocks)."""

    kv_cache: torch.Tensor  # [num_blocks, H, 2 * bs, D]
    layout: PageLayout
    # vLLM's cache writer for this layer (slots storage writes survivors with it)
    isa: str = "vec"
    k_scale: float = 1.0
    v_scale: float = 1.0
    kv_cache_dtype: str = "auto"

    @property
    def num_heads(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def head_pages(self) -> torch.Tensor:
        """Every head-page as ``[num_blocks * H, 2, bs, D]`` (compacted pages' order)."""
        return self.kv_cache.view(-1, 2, self.block_size, self.kv_cache.shape[-1])

    def read_pages(self, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of the pages ``pages``, ``([length, D], [length, D])``."""
        head_dim = self.kv_cache.shape[-1]
        chosen = self.head_pages.index_select(0, pages[: cdiv(length, self.block_size)].long())
        keys = chosen[:, 0].reshape(-1, head_dim)[:length]
        values = chosen[:, 1].reshape(-1, head_dim)[:length]
        return keys, values

    def read_slots(
        self, block_row: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Standard slots ``[start, end)`` of every head, ``([H, n, D], [H, n, D])``."""
        bs = self.block_size
        blocks = block_row[start // bs : cdiv(end, bs)]
        key_cache, value_cache = self.kv_cache.chunk(2, dim=2)
        offset = start % bs
        keys = self.layout.read_pages(key_cache, blocks, is_key=True)
        values = self.layout.read_pages(value_cache, blocks, is_key=False)
        return keys[:, offset : offset + end - start], values[:, offset : offset + end - start]

    def write_pages(self, pages: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``n`` tokens into the pages ``pages`` (``cdiv(n, bs)`` of them), in order.

        The rest of the last page is zeroed: nothing reads it (``head_lens``
        ends before it), and zeros keep stale bytes out of it.
        """
        num_tokens, head_dim = keys.shape
        bs = self.block_size
        num_pages = cdiv(num_tokens, bs)
        tokens = keys.new_zeros(2, num_pages * bs, head_dim)
        tokens[0, :num_tokens] = keys
        tokens[1, :num_tokens] = values
        self.head_pages.index_copy_(
            0, pages[:num_pages].long(), tokens.view(2, num_pages, bs, head_dim).transpose(0, 1)
        )

    def write_slots(
        self, block_row: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write ``keys, values [H, n, D]`` to slots ``[start, start + n)``
        through vLLM's own cache-write op, so they land in its page order."""
        bs = self.block_size
        slots = torch.arange(start, start + keys.shape[1])
        key_cache, value_cache = self.kv_cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys.transpose(0, 1).contiguous(),
            values.transpose(0, 1).contiguous(),
            key_cache,
            value_cache,
            block_row[slots // bs].long() * bs + slots % bs,
            self.isa,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def clear_slots(self, slots: torch.Tensor) -> None:
        """Zeros into the flat slot ids ``slots`` (``block * bs + offset``), every head."""
        zeros = self.kv_cache.new_zeros(slots.numel(), self.num_heads, self.kv_cache.shape[-1])
        key_cache, value_cache = self.kv_cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            zeros, zeros, key_cache, value_cache, slots.long(), self.isa,
            k_scale=self.k_scale, v_scale=self.v_scale, kv_cache_dtype=self.kv_cache_dtype,
        )

    def poison_pages(self, pages: torch.Tensor) -> None:
        if pages.numel():
            self.head_pages[pages.long()] = float("nan")

    def poison_standard_prefix(self, block: int, num_slots: int) -> None:
        """NaN into the first ``num_slots`` slots of ``block``, every head, K and V."""
        if num_slots <= 0:
            return
        head_dim = self.kv_cache.shape[-1]
        size = self.block_size * head_dim
        flat = self.kv_cache[block].view(self.num_heads, 2 * size)
        flat[:, self.layout.key_index[: num_slots * head_dim]] = float("nan")
        flat[:, size + self.layout.value_index[: num_slots * head_dim]] = float("nan")


@dataclass
class NativeHeadPagedCache(HeadPagedCache, CopiesHeads):
    """:class:`HeadPagedCache` whose compactions read and write every KV head
    in one call of the C++ extension (:func:`~vllm_kvevict.cpu_ops.gather_heads`,
    :func:`~vllm_kvevict.cpu_ops.write_heads`): the same bytes as the per-head
    reads and writes, without a handful of torch calls per head."""

    module: ModuleType | None = None  # load_cpu_ops()'s extension

    def read_heads(
        self, pages: torch.Tensor, lens: torch.Tensor, block_row: torch.Tensor, start: int, end: int,
        longest: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_ops.gather_heads(
            self.module, self.kv_cache, pages, lens, block_row, start, end,
            self.layout.key_index, self.layout.value_index, longest,
        )

    def write_heads(
        self, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, counts: torch.Tensor,
        page_table: torch.Tensor,
    ) -> None:
        cpu_ops.write_heads(self.module, self.kv_cache, keys, values, kept, counts, page_table)


def head_paged_cache(kv_cache: torch.Tensor, layout: PageLayout, *args: object, native: bool) -> HeadPagedCache:
    """A :class:`HeadPagedCache` over ``kv_cache``; with ``native`` and the C++
    extension built, one whose compactions copy every head in one call."""
    module = cpu_ops.load_cpu_ops() if native else None
    if module is None:
        return HeadPagedCache(kv_cache, layout, *args)  # type: ignore[arg-type]
    return NativeHeadPagedCache(kv_cache, layout, *args, module=module)  # type: ignore[arg-type, misc]
