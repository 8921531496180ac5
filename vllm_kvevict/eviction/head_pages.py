"""``head_pages`` storage: per-(layer, KV head) page tables, so heads keep
different numbers of tokens.

A request's KV head ``h`` keeps:

* its *compacted* tokens in head-pages listed by its page table, of any slot
  (a head that keeps more tokens uses the pages of heads that keep fewer);
* its *standard region*: the slots ``[region_start, seq_len)`` where the
  backend's cache writer puts new tokens; ``region_start`` is the last point
  at which the request compacted.

Compaction at point ``P`` (when the frontier moves from ``F0`` to ``F``)
reads every live token below ``P`` (compacted pages and standard slots
``[region_start, P)``), lets the policy and the head allocation choose, and
writes the survivors to the head-pages of the blocks ``[F, P // bs)``, all of
which the request keeps. So the request holds ``sum_h pages_h / H`` blocks of
compacted tokens plus the blocks of its standard region, as the scheduler
computes from the schedule alone. With the MomentKV correction the tokens a
head drops are folded into its moments.

A protected prefix (the slots ``[0, p)``, whole blocks, shared through vLLM's
prefix cache) is never gathered, rewritten or freed: the kernels read it in
place from the block table, before the compacted tokens
(:class:`~vllm_kvevict.triton_kernels.batch.HeadPagedBatch`'s ``prefix_lens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.eviction.cache_ops import (
    CacheOps, CompactsInPlace, CopiesHeads, EvictionObserver, Released,
)
from vllm_kvevict.eviction.point import EvictionPoint, ScoringInputsFor, StreamRows
from vllm_kvevict.eviction.select import KeepRule, choose_kept
from vllm_kvevict.policies.base import PADDING_POSITION
from vllm_kvevict.schedule import cdiv
from vllm_kvevict.top_k import select_top


@dataclass
class LiveTokens:
    """Every live token below an eviction point, per head, padded to ``S``."""

    keys: torch.Tensor  # [H, S, D] cache dtype
    values: torch.Tensor  # [H, S, D]
    positions: torch.Tensor  # [H, S] int64, PADDING_POSITION for padding
    live: torch.Tensor  # [H, S] bool


def gather_live(
    cache: CacheOps,
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
    if isinstance(cache, CopiesHeads):
        keys, values = cache.read_heads(pages, lens, block_row, region_start, point)
    else:
        keys, values = _read_heads(cache, pages, lens, block_row, region_start, point)
    num_heads, width, _ = keys.shape
    device = keys.device
    lens = lens.to(device=device, dtype=torch.int64)[:, None]
    column = torch.arange(width, device=device)[None, :]
    compacted = column < lens
    live = column < lens + (point - region_start)
    standard = live & ~compacted
    slot = region_start + column - lens  # the standard slot of a standard column
    known = min(width, positions.shape[1])
    compacted_positions = torch.full((num_heads, width), PADDING_POSITION, dtype=torch.int64, device=device)
    compacted_positions[:, :known] = positions[:, :known]
    key_positions = torch.where(compacted, compacted_positions, torch.where(standard, slot, PADDING_POSITION))
    return LiveTokens(keys, values, key_positions, live)


def live_addresses(
    tokens: LiveTokens, pages: torch.Tensor, lens: torch.Tensor, block_row: torch.Tensor,
    region_start: int, point: int, block_size: int,
) -> torch.Tensor:
    """The flat address (``head_page * bs + offset``) of each of ``tokens``
    (:func:`gather_live`'s, same arguments), ``[H, S]`` int64, 0 for padding."""
    num_heads, width = tokens.live.shape
    device, bs = tokens.live.device, block_size
    lens = lens.to(device=device, dtype=torch.int64)[:, None]
    column = torch.arange(width, device=device)[None, :]
    compacted = column < lens
    addresses = torch.zeros(num_heads, width, dtype=torch.int64, device=device)
    if pages.shape[1]:
        page = pages.to(device).long()[:, (column[0] // bs).clamp(max=pages.shape[1] - 1)]
        addresses = torch.where(compacted, page * bs + column % bs, addresses)
    if point > region_start:
        slot = tokens.positions.clamp(min=region_start, max=point - 1)  # a standard column's slot
        heads = torch.arange(num_heads, device=device)[:, None]
        blocks = block_row.to(device).long()[slot // bs]
        standard = tokens.live & ~compacted
        addresses = torch.where(standard, (blocks * num_heads + heads) * bs + slot % bs, addresses)
    return addresses


def _read_heads(
    cache: CacheOps, pages: torch.Tensor, lens: torch.Tensor, block_row: torch.Tensor,
    region_start: int, point: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`CopiesHeads.read_heads` through the per-head reads of any cache."""
    std_keys, std_values = cache.read_slots(block_row, region_start, point)
    lengths = lens.tolist()
    longest = max(lengths, default=0)
    if longest == 0:  # nothing compacted yet: the standard slots alone
        return std_keys, std_values
    # Heads hold different numbers of compacted tokens: one read per head
    # (with a handful of heads, faster than one padded read and scatters).
    num_heads, num_standard, head_dim = std_keys.shape
    keys = std_keys.new_zeros(num_heads, longest + num_standard, head_dim)
    values = std_values.new_zeros(num_heads, longest + num_standard, head_dim)
    for h, length in enumerate(lengths):
        if length:
            keys[h, :length], values[h, :length] = cache.read_pages(pages[h], length)
        keys[h, length : length + num_standard] = std_keys[h]
        values[h, length : length + num_standard] = std_values[h]
    return keys, values


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
    slots = torch.arange(num_heads, dtype=torch.int64, device=block_ids.device)
    return (block_ids.long()[:, None] * num_heads + slots[None, :]).flatten().to(torch.int32)


def kept_mask(kept: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[H, S]`` bool of the tokens ``kept`` (``-1`` padded indices) names."""
    mask = torch.zeros_like(like, dtype=torch.bool)
    heads, columns = (kept >= 0).nonzero(as_tuple=True)
    mask[heads, kept[heads, columns]] = True
    return mask


def evicted_tokens(tokens: LiveTokens, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The live tokens not in ``kept``, each head's first: ``(keys, values
    [H, m, D], mask [H, m])``, ``m`` the most any head drops. Folding these
    into the moments reads ``m`` tokens per head where a mask over every
    live token read all of them (at a decode-time eviction, 32 of ~1,000)."""
    evicted = tokens.live & ~kept_mask(kept, tokens.live)
    counts = evicted.sum(-1)
    # Each head's evicted tokens in slot order, -1 padded (read as token 0, masked).
    index = select_top(evicted.float(), counts).clamp(min=0)
    rows = index.unsqueeze(-1).expand(-1, -1, tokens.keys.shape[-1])
    mask = torch.arange(index.shape[1], device=index.device)[None, :] < counts[:, None]
    return tokens.keys.gather(1, rows), tokens.values.gather(1, rows), mask


def page_table_of(new_pages: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The heads' new pages as a page table shaped ``like`` (``[H, max_pages]``), zero padded."""
    table = torch.zeros_like(like)
    for h, head_pages in enumerate(new_pages):
        table[h, : head_pages.numel()] = head_pages
    return table


def write_kept(
    cache: CacheOps, tokens: LiveTokens, kept: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor
) -> None:
    """Each head's kept tokens, in order, into its new pages ``page_table[h]``."""
    if isinstance(cache, CopiesHeads):
        cache.write_heads(tokens.keys, tokens.values, kept, counts, page_table)
        return
    # index_select, not advanced indexing: on CPU a row gather through
    # ``x[h, index]`` took 4x as long (960 rows of 64 floats).
    for h, count in enumerate(counts.tolist()):
        index = kept[h, :count]
        cache.write_pages(
            page_table[h, : cdiv(count, cache.block_size)],
            tokens.keys[h].index_select(0, index), tokens.values[h].index_select(0, index),
        )


def record_kept(
    rows: StreamRows, tokens: LiveTokens, kept: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor
) -> None:
    """The heads' new page tables, kept tokens' positions and lengths into their side buffers."""
    assert rows.pages is not None and rows.lens is not None
    rows.pages.copy_(page_table)
    width = kept.shape[1]
    chosen = tokens.positions.gather(1, kept.clamp(min=0)).to(rows.positions.dtype)
    rows.positions[:, :width] = torch.where(kept >= 0, chosen, rows.positions[:, :width])
    rows.lens.copy_(counts.to(rows.lens.dtype))


def compact_head_pages(
    cache: CacheOps,
    rule: KeepRule,
    ev: EvictionPoint,
    rows: StreamRows,
    block_row: torch.Tensor,
    scoring_inputs: ScoringInputsFor,
    layer: int,
    observer: EvictionObserver,
) -> list[int]:
    """Keep the policy's choice of every live token below ``ev.point``, split
    across heads by the allocation, in the head-pages of the blocks
    ``[frontier_after, point // bs)``; fold the rest into the moments.
    Returns the tokens each head keeps."""
    assert rows.pages is not None and rows.lens is not None
    bs = cache.block_size
    # The protected prefix is never a candidate: the standard slots are
    # gathered from its end (the kernels read it in place, from the block table).
    start = max(ev.region_start, ev.protected_prefix)
    tokens = gather_live(cache, rows.pages, rows.lens, rows.positions, block_row, start, ev.point)
    inputs = scoring_inputs(tokens.keys, tokens.values, tokens.positions, rows.moments)
    free_pages = block_head_pages(block_row[ev.frontier_after // bs : ev.point // bs], cache.num_heads)
    counts, kept = choose_kept(rule, [inputs], [tokens.live], ev.point, free_pages.numel(), bs)
    counts_list = counts.tolist()
    new_pages = assign_pages(free_pages, counts_list, bs)
    page_table = page_table_of(new_pages, rows.pages)
    if isinstance(cache, CompactsInPlace):
        addresses = live_addresses(tokens, rows.pages, rows.lens, block_row, start, ev.point, bs)
        cache.compact(addresses, tokens.live.sum(-1), kept.clamp(min=0), counts, page_table, rows.moments)
    else:
        if rows.moments is not None:
            rows.moments.fold_(*evicted_tokens(tokens, kept))
        write_kept(cache, tokens, kept, counts, page_table)
    record_kept(rows, tokens, kept, counts, page_table)
    used = sum(p.numel() for p in new_pages)
    observer.released(cache, Released(
        unused_pages=free_pages[used:],
        partial_blocks=[(int(block_row[ev.point // bs]), ev.point % bs)] if ev.point % bs else [],
        freed_blocks=block_row[ev.frontier_before // bs : ev.frontier_after // bs],
        layer=layer,
    ))
    return counts_list
