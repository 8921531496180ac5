"""``head_pages`` storage over vLLM's CPU KV cache (one layer).

vLLM's CPU cache of a layer is ``[num_blocks, H, 2 * block_size, D]``: block
``b`` holds one *head-page* per KV-head slot ``s`` (id ``b * H + s``), a K page
then a V page. A request's KV head ``h`` keeps:

* its *compacted* tokens in head-pages listed by its page table, of any slot
  (a head that keeps more tokens uses the pages of heads that keep fewer).
  We write those pages ourselves, in a plain logical order (``[block_size,
  D]`` keys, then values), and only our kernels read them;
* its *standard region*: the slots ``[region_start, seq_len)`` where vLLM's
  cache writer puts new tokens, in vLLM's ISA-specific page order
  (:mod:`cpu_page_layout`); ``region_start`` is the last point at which the
  request compacted.

Compaction at point ``P`` (when the frontier moves from ``F0`` to ``F``)
reads every live token below ``P`` (compacted pages and standard slots
``[region_start, P)``), lets the policy and the head allocation choose, and
writes the survivors to the head-pages of the blocks ``[F, P // bs)``, all of
which the request keeps. So the request holds ``sum_h pages_h / H`` blocks of
compacted tokens plus the blocks of its standard region, as the scheduler
computes from the schedule alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import PADDING_POSITION
from vllm_kvevict.schedule import cdiv
from vllm_kvevict.vllm_glue.cpu_page_layout import PageLayout



@dataclass
class LiveTokens:
    """Every live token below an eviction point, per head, padded to ``S``."""

    keys: torch.Tensor  # [H, S, D] cache dtype
    values: torch.Tensor  # [H, S, D]
    positions: torch.Tensor  # [H, S] int64, PADDING_POSITION for padding
    live: torch.Tensor  # [H, S] bool


@dataclass
class HeadPagedCache:
    kv_cache: torch.Tensor  # [num_blocks, H, 2 * bs, D]
    layout: PageLayout

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

    def read_compacted(self, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of the pages ``pages``, ``([length, D], [length, D])``."""
        head_dim = self.kv_cache.shape[-1]
        chosen = self.head_pages[pages[: cdiv(length, self.block_size)].long()]
        keys = chosen[:, 0].reshape(-1, head_dim)[:length]
        values = chosen[:, 1].reshape(-1, head_dim)[:length]
        return keys, values

    def read_standard(
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

    def write_compacted(self, pages: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
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
        self.head_pages[pages[:num_pages].long()] = (
            tokens.view(2, num_pages, bs, head_dim).transpose(0, 1)
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

    def gather_live(
        self,
        pages: torch.Tensor,
        lens: torch.Tensor,
        positions: torch.Tensor,
        block_row: torch.Tensor,
        region_start: int,
        point: int,
    ) -> LiveTokens:
        """Each head's compacted tokens followed by its standard slots ``[region_start, point)``.

        Args:
            pages: ``[H, max_pages]`` the heads' page tables.
            lens: ``[H]`` compacted tokens per head.
            positions: ``[H, capacity]`` original positions of compacted tokens.
        """
        num_heads, head_dim = self.num_heads, self.kv_cache.shape[-1]
        lengths = lens.tolist()
        num_standard = point - region_start
        width = max(lengths) + num_standard
        dtype = self.kv_cache.dtype
        keys = torch.zeros(num_heads, width, head_dim, dtype=dtype)
        values = torch.zeros(num_heads, width, head_dim, dtype=dtype)
        key_positions = torch.full((num_heads, width), PADDING_POSITION, dtype=torch.int64)
        live = torch.zeros(num_heads, width, dtype=torch.bool)
        std_keys, std_values = self.read_standard(block_row, region_start, point)
        std_positions = torch.arange(region_start, point)
        for h, length in enumerate(lengths):
            if length:
                keys[h, :length], values[h, :length] = self.read_compacted(pages[h], length)
                key_positions[h, :length] = positions[h, :length]
            end = length + num_standard
            keys[h, length:end] = std_keys[h]
            values[h, length:end] = std_values[h]
            key_positions[h, length:end] = std_positions
            live[h, :end] = True
        return LiveTokens(keys, values, key_positions, live)


def assign_pages(free_pages: torch.Tensor, counts: list[int], block_size: int) -> list[torch.Tensor]:
    """Give each head ``cdiv(count, block_size)`` consecutive pages of ``free_pages``."""
    assigned, used = [], 0
    for count in counts:
        num_pages = cdiv(count, block_size)
        assigned.append(free_pages[used : used + num_pages])
        used += num_pages
    if used > free_pages.numel():
        raise RuntimeError(f"compaction needs {used} head-pages, the request holds {free_pages.numel()}")
    return assigned


def block_head_pages(block_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The head-page ids of ``block_ids``, block-major: ``b * H + s``."""
    slots = torch.arange(num_heads, dtype=torch.int64)
    return (block_ids.long()[:, None] * num_heads + slots[None, :]).flatten().to(torch.int32)


def gather_log_beta(
    log_beta_pages: torch.Tensor,
    pages: torch.Tensor,
    lens: torch.Tensor,
    block_row: torch.Tensor,
    region_start: int,
    point: int,
) -> torch.Tensor:
    """The log β of the tokens :meth:`HeadPagedCache.gather_live` returns, in
    the same order: ``[H, S]`` fp32, 0 for padding.

    ``log_beta_pages [num_head_pages, bs]`` holds one value per slot of every
    head-page (compacted pages in logical order, standard slots by slot).
    """
    num_heads = pages.shape[0]
    bs = log_beta_pages.shape[1]
    lengths = lens.tolist()
    num_standard = point - region_start
    out = torch.zeros(num_heads, max(lengths) + num_standard, dtype=torch.float32)
    slots = torch.arange(region_start, point)
    standard_pages = block_head_pages(block_row[slots // bs], num_heads).view(-1, num_heads).T.long()
    standard = log_beta_pages[standard_pages, (slots % bs)[None, :].expand(num_heads, -1)]
    for h, length in enumerate(lengths):
        if length:
            out[h, :length] = log_beta_pages[pages[h, : cdiv(length, bs)].long()].reshape(-1)[:length]
        out[h, length : length + num_standard] = standard[h]
    return out
