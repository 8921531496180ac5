"""The eviction engine's cache operations on vLLM's logical KV cache view,
for the Triton kernels (CUDA, or CPU under Triton's interpreter).

Every attention layer sees its cache as ``[num_blocks, H, block_size, 2 * D]``
(``vllm/v1/kv_cache_interface.py``): key then value of each token; the
physical order behind that view (``LBHNC`` or ``LBNHC``) only changes its
strides. ``kv_cache[..., :D]`` and ``kv_cache[..., D:]`` are the logical
``[num_blocks, H, block_size, D]`` key and value caches the Triton kernels
address through their strides. Head-page ``b * H + s`` is ``cache[b, s]``,
whether it holds standard slots or compacted tokens: one layout for both, so
the engine's flat token addresses (``head_page * bs + offset``) name any token.

Reads and writes are torch indexing, an eviction's reads and writes of
every head one gather and one scatter by flat address, sized on the host
(nothing read back from the device); compaction is the Triton kernel
(:func:`~vllm_kvevict.triton_kernels.compact_head_pages.compact_head_pages`),
which moves kept tokens on the device and folds the evicted ones into
MomentKV's moments in the same launch sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_kvevict.eviction.cache_ops import CacheOps
from vllm_kvevict.eviction.head_pages import put_where
from vllm_kvevict.moments import EvictedMoments
from vllm_kvevict.schedule import cdiv
from vllm_kvevict.triton_kernels.batch import HeadPagedBatch


@dataclass
class TritonPagedCache(CacheOps):
    """:class:`~vllm_kvevict.eviction.cache_ops.CacheOps` (reading by
    address, writing every head at once, compacting in place) over one
    logical ``[num_blocks, H, bs, 2 * D]`` cache: one layer's, or every
    layer's as one pool of blocks. ``compaction``: the compaction kernel,
    the Triton one by default (where Triton cannot run, a function of the
    same arguments: its torch twin); ``window_scores`` likewise SnapKV's
    window votes (:meth:`window_votes`)."""

    kv_cache: torch.Tensor
    compaction: Callable[..., None] | None = None
    window_scores: Callable[..., torch.Tensor] | None = None

    @property
    def head_dim(self) -> int:
        return self.kv_cache.shape[-1] // 2

    @property
    def key_cache(self) -> torch.Tensor:
        """``[num_blocks, H, bs, D]``, a strided view."""
        return self.kv_cache[..., : self.head_dim]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.kv_cache[..., self.head_dim :]

    @property
    def num_heads(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[2]

    def _page_locations(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = pages.long().to(self.kv_cache.device)
        return pages // self.num_heads, pages % self.num_heads

    def read_slots(
        self, block_row: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Standard slots ``[start, end)`` of every head, ``([H, n, D], [H, n, D])``."""
        bs, num_heads, head_dim = self.block_size, self.num_heads, self.head_dim
        blocks = block_row[start // bs : cdiv(end, bs)].long().to(self.kv_cache.device)
        pages = self.kv_cache[blocks]  # [nb, H, bs, 2D]
        tokens = pages.permute(1, 0, 2, 3).reshape(num_heads, -1, 2 * head_dim)
        tokens = tokens[:, start % bs : start % bs + end - start]
        return tokens[..., :head_dim], tokens[..., head_dim:]

    def write_slots(
        self, block_row: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write ``keys, values [H, n, D]`` to slots ``[start, start + n)``."""
        bs = self.block_size
        slots = torch.arange(start, start + keys.shape[1], device=self.kv_cache.device)
        blocks = block_row.to(self.kv_cache.device)[slots // bs].long()
        offsets = slots % bs
        # Advanced indices around a slice: the result is [n, H, D].
        self.key_cache[blocks, :, offsets] = keys.transpose(0, 1).to(self.kv_cache.dtype)
        self.value_cache[blocks, :, offsets] = values.transpose(0, 1).to(self.kv_cache.dtype)

    def read_pages(self, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of the head-pages ``pages``, ``([length, D], [length, D])``."""
        blocks, heads = self._page_locations(pages[: cdiv(length, self.block_size)])
        tokens = self.kv_cache[blocks, heads].reshape(-1, 2 * self.head_dim)[:length]
        return tokens[:, : self.head_dim], tokens[:, self.head_dim :]

    def read_tokens(self, addresses: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens at the flat ``addresses [H, S]``, zeros where ``live`` is
        false: one gather, ``([H, S, D], [H, S, D])``."""
        addresses = addresses.to(self.kv_cache.device)
        blocks, heads = self._page_locations(addresses // self.block_size)
        tokens = self.kv_cache[blocks, heads, addresses % self.block_size]
        tokens = torch.where(live.to(tokens.device)[..., None], tokens, 0)
        return tokens[..., : self.head_dim], tokens[..., self.head_dim :]

    def write_heads(
        self, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, counts: torch.Tensor,
        page_table: torch.Tensor,
    ) -> None:
        """Head ``h``'s rows ``kept[h, :counts[h]]`` of ``keys, values [H, S, D]``
        into its pages ``page_table[h]``, the rest of its last page zeroed
        (:meth:`write_pages` for every head): one scatter, sized by
        ``kept``'s width, not by the counts."""
        bs, device = self.block_size, self.kv_cache.device
        width = cdiv(kept.shape[1], bs) * bs
        if not width:
            return
        column = torch.arange(width, device=device)[None, :]
        counts = counts.to(device=device, dtype=torch.int64)[:, None]
        rows = kept.to(device).gather(1, column.clamp(max=kept.shape[1] - 1).expand(kept.shape[0], -1))
        tokens = torch.cat([keys, values], dim=-1).to(self.kv_cache.dtype)
        tokens = tokens.gather(1, rows.clamp(min=0)[..., None].expand(-1, -1, tokens.shape[-1]))
        tokens = torch.where((column < counts)[..., None], tokens, 0)
        page = page_table.to(device).long().gather(
            1, (column // bs).clamp(max=page_table.shape[1] - 1).expand(kept.shape[0], -1)
        )
        blocks, heads = self._page_locations(page)
        written = column < (counts + (bs - 1)) // bs * bs  # whole pages
        index = (blocks.flatten(), heads.flatten(), (column % bs).expand_as(page).flatten())
        put_where(self.kv_cache, index, tokens.flatten(0, 1), written.flatten())

    def write_pages(self, pages: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``n`` tokens into the head-pages ``pages`` (``cdiv(n, bs)`` of
        them), in order; the rest of the last page is zeroed."""
        num_tokens, head_dim = keys.shape
        bs = self.block_size
        num_pages = cdiv(num_tokens, bs)
        tokens = keys.new_zeros(num_pages * bs, 2 * head_dim, dtype=self.kv_cache.dtype)
        tokens[:num_tokens, :head_dim] = keys
        tokens[:num_tokens, head_dim:] = values
        blocks, heads = self._page_locations(pages[:num_pages])
        self.kv_cache[blocks, heads] = tokens.view(num_pages, bs, 2 * head_dim)

    def compact(
        self,
        addresses: torch.Tensor,
        live_lens: torch.Tensor,
        kept: torch.Tensor,
        kept_lens: torch.Tensor,
        page_table: torch.Tensor,
        moments: EvictedMoments | None,
    ) -> None:
        """One request's compaction by the Triton kernel (see
        :class:`~vllm_kvevict.eviction.cache_ops.CompactsInPlace`)."""
        one = EvictedMoments(*(b.unsqueeze(0) for b in moments._buffers())) if moments is not None else None
        self._compact(
            addresses.unsqueeze(0), live_lens.unsqueeze(0), kept.unsqueeze(0), kept_lens.unsqueeze(0),
            page_table.unsqueeze(0), one,
        )

    def compact_many(
        self, addresses: torch.Tensor, live_lens: torch.Tensor, kept: torch.Tensor, kept_lens: torch.Tensor,
        page_table: torch.Tensor, moments: EvictedMoments | None = None,
    ) -> None:
        """Several requests' compactions, their moments folded, in one launch
        sequence of the Triton kernel (see
        :class:`~vllm_kvevict.eviction.cache_ops.CompactsInPlace`)."""
        self._compact(addresses, live_lens, kept, kept_lens, page_table, moments)

    def _compact(
        self, addresses: torch.Tensor, live_lens: torch.Tensor, kept: torch.Tensor, kept_lens: torch.Tensor,
        page_table: torch.Tensor, moments: EvictedMoments | None,
    ) -> None:
        compaction = self.compaction
        if compaction is None:
            from vllm_kvevict.triton_kernels.compact_head_pages import compact_head_pages as compaction

        device = self.kv_cache.device
        batch = HeadPagedBatch(
            head_page_table=page_table.to(device).contiguous(),
            head_lens=kept_lens.to(device=device, dtype=torch.int32),
            moments=moments,
            moment_rows=(
                torch.arange(addresses.shape[0], dtype=torch.int32, device=device) if moments is not None else None
            ),
        )
        compaction(
            self.key_cache,
            self.value_cache,
            addresses.to(device).contiguous(),
            live_lens.to(device=device, dtype=torch.int32),
            kept.to(device).contiguous(),
            batch,
        )

    def window_votes(
        self, queries: torch.Tensor, query_lens: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor,
        positions: torch.Tensor, block_rows: torch.Tensor, region_start: torch.Tensor, points: torch.Tensor,
        scale: float, width: int,
    ) -> torch.Tensor:
        """Every request's window votes in two launches of the Triton kernel
        (see :class:`~vllm_kvevict.eviction.cache_ops.ScoresWindows`)."""
        window_scores = self.window_scores
        if window_scores is None:
            from vllm_kvevict.triton_kernels.window_scores import window_votes as window_scores

        device = self.kv_cache.device
        batch = HeadPagedBatch(
            head_page_table=pages.to(device),
            head_lens=lens.to(device=device, dtype=torch.int32),
            seq_lens=points.to(device=device, dtype=torch.int32),
            block_table=block_rows.to(device),
            region_start=region_start.to(device=device, dtype=torch.int32),
        )
        return window_scores(
            queries.to(device), self.key_cache, batch, scale,
            query_lens=query_lens.to(device=device, dtype=torch.int32),
            compacted_positions=positions.to(device), max_len=width,
        )

    # The isolation check's writes (``poison_freed_blocks``).

    def clear_slots(self, slots: torch.Tensor) -> None:
        """Zeros into the flat slot ids ``slots`` (``block * bs + offset``), every head."""
        slots = slots.long().to(self.kv_cache.device)
        self.kv_cache[slots // self.block_size, :, slots % self.block_size] = 0

    def poison_pages(self, pages: torch.Tensor) -> None:
        if pages.numel():
            blocks, heads = self._page_locations(pages)
            self.kv_cache[blocks, heads] = float("nan")

    def poison_standard_prefix(self, block: int, num_slots: int) -> None:
        """NaN into the first ``num_slots`` slots of ``block``, every head, K and V."""
        if num_slots > 0:
            self.kv_cache[block, :, :num_slots] = float("nan")


def write_new_tokens(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int | None = None,
) -> None:
    """vLLM's cache write in torch: token ``i`` (``key, value [T, H, D]``) into
    slot ``slot_mapping[i]`` of the logical ``[num_blocks, H, bs, 2 * D]``
    cache. ``num_tokens``: the step's real tokens (those after are padding,
    slot -1), a host count, so no device sync; without it negative slots are
    found and skipped."""
    if num_tokens is not None:
        slots, key, value = slot_mapping[:num_tokens].long(), key[:num_tokens], value[:num_tokens]
    else:
        slots = slot_mapping.long()
        valid = slots >= 0
        key, value = key[: slots.shape[0]], value[: slots.shape[0]]
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
    head_dim = key.shape[-1]
    bs = kv_cache.shape[2]
    blocks, offsets = slots // bs, slots % bs
    kv_cache[blocks, :, offsets, :head_dim] = key.to(kv_cache.dtype)
    kv_cache[blocks, :, offsets, head_dim:] = value.to(kv_cache.dtype)
