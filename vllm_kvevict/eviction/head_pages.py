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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_kvevict.eviction.cache_ops import (
    CacheOps, CompactsInPlace, CopiesHeads, EvictionObserver, ReadsTokens, Released, ScoresWindows, WritesHeads,
    implements,
)
from vllm_kvevict.eviction.point import EvictionPoint, LayerEviction, ScoringInputsFor, StreamRows
from vllm_kvevict.eviction.select import KeepRule, Selection, choose_kept_many
from vllm_kvevict.policies.base import PADDING_POSITION, ScoringInputs
from vllm_kvevict.schedule import cdiv
from vllm_kvevict.top_k import select_top


@dataclass
class LiveTokens:
    """Every live token below an eviction point, per head, padded to ``S``."""

    keys: torch.Tensor  # [H, S, D] cache dtype
    values: torch.Tensor  # [H, S, D]
    positions: torch.Tensor  # [H, S] int64, PADDING_POSITION for padding
    live: torch.Tensor  # [H, S] bool
    addresses: torch.Tensor | None = None  # [H, S] flat addresses, where the cache read by them


def gather_live(
    cache: CacheOps,
    pages: torch.Tensor,
    lens: torch.Tensor,
    positions: torch.Tensor,
    block_row: torch.Tensor,
    region_start: int,
    point: int,
    lengths: Sequence[int] | None = None,
) -> LiveTokens:
    """Each head's compacted tokens followed by its standard slots ``[region_start, point)``.

    Args:
        pages: ``[H, max_pages]`` the heads' page tables.
        lens: ``[H]`` compacted tokens per head; ``lengths``: the same as
            the host knows them (read back when not given), which size the
            result (``S = max(lens) + point - region_start``).
        positions: ``[H, capacity]`` original positions of compacted tokens.
    """
    if lengths is None:
        lengths = lens.tolist()
    longest = max(lengths, default=0)
    width = longest + point - region_start
    device = pages.device
    head_lens = lens.to(device=device, dtype=torch.int64)[:, None]
    column = torch.arange(width, device=device)[None, :]
    compacted = column < head_lens
    addresses = None
    if implements(cache, ReadsTokens):
        bs = cache.block_size
        addresses, live = token_addresses(pages, lens, block_row, region_start, point, width, bs)
        keys, values = cache.read_tokens(addresses, live)
    else:
        live = column < head_lens + (point - region_start)
        if implements(cache, CopiesHeads):
            keys, values = cache.read_heads(pages, lens, block_row, region_start, point, longest)
        else:
            keys, values = _read_heads(cache, pages, lengths, block_row, region_start, point)
    num_heads = keys.shape[0]
    standard = live & ~compacted
    slot = region_start + column - head_lens  # the standard slot of a standard column
    known = min(width, positions.shape[1])
    compacted_positions = torch.full((num_heads, width), PADDING_POSITION, dtype=torch.int64, device=device)
    compacted_positions[:, :known] = positions[:, :known]
    key_positions = torch.where(compacted, compacted_positions, torch.where(standard, slot, PADDING_POSITION))
    return LiveTokens(keys, values, key_positions, live, addresses)


def token_addresses(
    pages: torch.Tensor, lens: torch.Tensor, block_row: torch.Tensor, region_start: int, point: int,
    width: int, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat address (``head_page * bs + offset``) of each head's live
    tokens in :func:`gather_live`'s order, ``[H, width]`` int64 (0 for
    padding), and which are live: column arithmetic, nothing read back."""
    num_heads, bs, device = pages.shape[0], block_size, pages.device
    lens = lens.to(device=device, dtype=torch.int64)[:, None]
    column = torch.arange(width, device=device)[None, :]
    compacted = column < lens
    live = column < lens + (point - region_start)
    addresses = torch.zeros(num_heads, width, dtype=torch.int64, device=device)
    if pages.shape[1]:
        page = pages.long()[:, (column[0] // bs).clamp(max=pages.shape[1] - 1)]
        addresses = torch.where(compacted, page * bs + column % bs, addresses)
    if point > region_start:
        slot = (region_start + column - lens).clamp(min=region_start, max=point - 1)  # a standard column's
        heads = torch.arange(num_heads, device=device)[:, None]
        blocks = block_row.to(device).long()[slot // bs]
        addresses = torch.where(live & ~compacted, (blocks * num_heads + heads) * bs + slot % bs, addresses)
    return addresses, live


def live_addresses(
    tokens: LiveTokens, pages: torch.Tensor, lens: torch.Tensor, block_row: torch.Tensor,
    region_start: int, point: int, block_size: int,
) -> torch.Tensor:
    """The flat address (``head_page * bs + offset``) of each of ``tokens``
    (:func:`gather_live`'s, same arguments), ``[H, S]`` int64, 0 for padding."""
    if tokens.addresses is not None:
        return tokens.addresses
    width = tokens.live.shape[1]
    return token_addresses(pages, lens, block_row, region_start, point, width, block_size)[0]


def _read_heads(
    cache: CacheOps, pages: torch.Tensor, lengths: Sequence[int], block_row: torch.Tensor,
    region_start: int, point: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`CopiesHeads.read_heads` through the per-head reads of any cache."""
    std_keys, std_values = cache.read_slots(block_row, region_start, point)
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


def page_tables(free_pages: torch.Tensor, counts: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """Each stream's ``cdiv(counts[s], block_size)`` pages, consecutive in
    ``free_pages`` in stream order, as page tables ``[S, width]`` (zero
    padded; ``width`` at least every stream's pages, e.g. those of the kept
    tokens' width). The streams' pages must fit in ``free_pages``
    (:func:`~vllm_kvevict.eviction.select.choose_kept_many` checks)."""
    pages = (counts + (block_size - 1)) // block_size
    column = torch.arange(width, device=counts.device)[None, :]
    if not free_pages.numel():
        return torch.zeros(counts.shape[0], width, dtype=free_pages.dtype, device=counts.device)
    index = (pages.cumsum(0) - pages)[:, None] + column
    chosen = free_pages[index.clamp(max=free_pages.numel() - 1)]
    return chosen.masked_fill(column >= pages[:, None], 0)


def block_head_pages(block_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The head-page ids of ``block_ids``, block-major: ``b * H + s``."""
    slots = torch.arange(num_heads, dtype=torch.int64, device=block_ids.device)
    return (block_ids.long()[:, None] * num_heads + slots[None, :]).flatten().to(torch.int32)


def put_where(
    target: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor, valid: torch.Tensor
) -> None:
    """``target[index[0][i], index[1][i], ...] = values[i]`` for the entries
    ``i`` with ``valid[i]`` (``values [N, ...]``), without reading ``valid``
    back: the other entries repeat the first valid entry's write (the same
    value to the same place), or, with none valid, write the first place's
    own value back, so no place gets two different values."""
    if not valid.numel():
        return
    first = valid.to(torch.int8).argmax().view(1)
    index = tuple(torch.where(valid, i, i.index_select(0, first)) for i in index)
    shape = (-1,) + (1,) * (values.dim() - 1)
    first_place = target[tuple(i.index_select(0, first) for i in index)]
    anchor = torch.where(valid.index_select(0, first).view(shape), values.index_select(0, first), first_place)
    target.index_put_(index, torch.where(valid.view(shape), values, anchor))


def kept_mask(kept: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[H, S]`` bool of the tokens ``kept`` (``-1`` padded indices) names."""
    width = like.shape[1]
    mask = torch.zeros(like.shape[0], width + 1, dtype=torch.bool, device=like.device)
    mask.scatter_(1, torch.where(kept >= 0, kept, width), True)  # padding to a spare column
    return mask[:, :width]


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


def write_kept(
    cache: CacheOps, tokens: LiveTokens, kept: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor,
    host_counts: Sequence[int] | None = None,
) -> None:
    """Each head's kept tokens, in order, into its new pages ``page_table[h]``
    (a cache that cannot write every head at once: one write per head, of
    ``host_counts``, the counts as the host knows them, or read back)."""
    if implements(cache, WritesHeads):
        cache.write_heads(tokens.keys, tokens.values, kept, counts, page_table)
        return
    # index_select, not advanced indexing: on CPU a row gather through
    # ``x[h, index]`` took 4x as long (960 rows of 64 floats).
    for h, count in enumerate(counts.tolist() if host_counts is None else host_counts):
        index = kept[h, :count]
        cache.write_pages(
            page_table[h, : cdiv(count, cache.block_size)],
            tokens.keys[h].index_select(0, index), tokens.values[h].index_select(0, index),
        )


def record_kept(
    rows: StreamRows, tokens: LiveTokens, kept: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor
) -> None:
    """The heads' new page tables (``page_table``: their first columns, the
    rest zero), kept tokens' positions and lengths into their side buffers."""
    assert rows.pages is not None and rows.lens is not None
    columns = page_table.shape[1]
    if columns == rows.pages.shape[1]:
        rows.pages.copy_(page_table)
    else:
        rows.pages[:, :columns].copy_(page_table)
        rows.pages[:, columns:].zero_()
    width = kept.shape[1]
    if width > rows.positions.shape[1]:  # past a head's count, kept is -1
        width = rows.positions.shape[1]
        kept = kept[:, :width]
    chosen = tokens.positions.gather(1, kept.clamp(min=0)).to(rows.positions.dtype)
    rows.positions[:, :width] = torch.where(kept >= 0, chosen, rows.positions[:, :width])
    rows.lens.copy_(counts.to(rows.lens.dtype))


def window_votes_many(
    cache: CacheOps, evictions: Sequence[LayerEviction], inputs: Sequence[ScoringInputs], starts: Sequence[int],
) -> list[torch.Tensor]:
    """Each request's window votes ``[H, S]`` (its ``inputs``' live tokens:
    the compacted tokens, then the slots ``[start, point)``), from one call
    of the cache's window-score kernel for every request and head of the
    layer. Sized on the host from the eviction points and the inputs'
    shapes: nothing is read back."""
    assert implements(cache, ScoresWindows)
    first = inputs[0]
    assert first.queries is not None
    num_q_heads, head_dim = first.queries.shape[0], first.queries.shape[2]
    window = max(i.queries.shape[1] for i in inputs)  # type: ignore[union-attr]
    queries = first.queries.new_zeros(len(inputs), num_q_heads, window, head_dim)
    for r, request in enumerate(inputs):
        queries[r, :, : request.queries.shape[1]] = request.queries  # type: ignore[union-attr]
    host = torch.tensor(
        [[i.queries.shape[1] for i in inputs], list(starts), [e.ev.point for e in evictions]],  # type: ignore[union-attr]
        dtype=torch.int32,
    ).to(first.keys.device)
    widths = [i.keys.shape[1] for i in inputs]
    votes = cache.window_votes(
        queries, host[0],
        torch.stack([e.rows.pages for e in evictions]),  # type: ignore[misc]
        torch.stack([e.rows.lens for e in evictions]),  # type: ignore[misc]
        torch.stack([e.rows.positions for e in evictions]),
        torch.stack([e.block_row for e in evictions]),
        host[1], host[2], first.scale, max(widths),
    )
    return [votes[r, :, :width] for r, width in enumerate(widths)]


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
    """One request's compaction (:func:`compact_head_pages_many`); returns
    the tokens each head keeps, read back."""
    assert rows.lens is not None
    eviction = LayerEviction(ev, rows, block_row, scoring_inputs)
    return compact_head_pages_many(cache, rule, [eviction], layer, observer, [rows.lens.tolist()])[0].tolist()


def compact_head_pages_many(
    cache: CacheOps,
    rule: KeepRule,
    evictions: Sequence[LayerEviction],
    layer: int,
    observer: EvictionObserver,
    lengths: Sequence[Sequence[int]] | None = None,
) -> list[torch.Tensor]:
    """For each request, keep the policy's choice of every live token below
    ``ev.point``, split across heads by the allocation, in the head-pages of
    the blocks ``[frontier_after, point // bs)``; fold the rest into the
    moments. Returns each request's kept tokens per head, ``[H]`` on the
    device.

    ``lengths``: each request's compacted tokens per head as the host knows
    them (read back, one read for every request, when not given). With them
    the compaction of every request reads the device once
    (:func:`~vllm_kvevict.eviction.select.choose_kept_many`), on a cache that
    reads by address and compacts in place or writes every head at once
    (the Triton path's); a cache that writes head by head reads the counts
    back once more.
    """
    bs = cache.block_size
    if lengths is None:
        lengths = torch.stack([e.rows.lens for e in evictions]).tolist() if evictions else []
    gathered: list[tuple[LiveTokens, torch.Tensor, int]] = []
    selections: list[Selection] = []
    for eviction, head_lens in zip(evictions, lengths):
        ev, rows = eviction.ev, eviction.rows
        assert rows.pages is not None and rows.lens is not None
        # The protected prefix is never a candidate: the standard slots are
        # gathered from its end (the kernels read it in place, from the block table).
        start = max(ev.region_start, ev.protected_prefix)
        tokens = gather_live(
            cache, rows.pages, rows.lens, rows.positions, eviction.block_row, start, ev.point, head_lens
        )
        inputs = eviction.scoring_inputs(tokens.keys, tokens.values, tokens.positions, rows.moments)
        kept_blocks = eviction.block_row[ev.frontier_after // bs : ev.point // bs]
        free_pages = block_head_pages(kept_blocks, cache.num_heads)
        live_lengths = [n + ev.point - start for n in head_lens]
        selections.append(
            Selection([inputs], [tokens.live], ev.point, free_pages.numel(), bs, [live_lengths])
        )
        gathered.append((tokens, free_pages, start))
    if rule.policy.reads_window_votes and implements(cache, ScoresWindows) and evictions:
        votes = window_votes_many(
            cache, evictions, [sel.layers[0] for sel in selections], [start for _, _, start in gathered]
        )
        for selection, request_votes in zip(selections, votes):
            selection.layers[0].window_votes = request_votes
    chosen = choose_kept_many(rule, selections)
    host_counts: list[list[int] | None] = [None] * len(chosen)
    in_place = implements(cache, CompactsInPlace)
    if not (in_place or implements(cache, WritesHeads)) and chosen:  # head by head: counts on the host
        host_counts = torch.stack([counts for counts, _ in chosen]).tolist()
    for eviction, (tokens, free_pages, start), (counts, kept), known in zip(
        evictions, gathered, chosen, host_counts
    ):
        ev, rows = eviction.ev, eviction.rows
        assert rows.pages is not None
        page_table = page_tables(free_pages, counts, bs, rows.pages.shape[1])
        if in_place:
            addresses = live_addresses(tokens, rows.pages, rows.lens, eviction.block_row, start, ev.point, bs)
            cache.compact(addresses, tokens.live.sum(-1), kept.clamp(min=0), counts, page_table, rows.moments)
        else:
            if rows.moments is not None:
                rows.moments.fold_(*evicted_tokens(tokens, kept))
            write_kept(cache, tokens, kept, counts, page_table, known)
        record_kept(rows, tokens, kept, counts, page_table)
        block = ev.point // bs
        observer.released(cache, Released(
            freed_blocks=eviction.block_row[ev.frontier_before // bs : ev.frontier_after // bs],
            layer=layer, free_pages=free_pages, counts=counts, page_size=bs,
            point_block=eviction.block_row[block : block + 1], point_slots=ev.point % bs,
        ))
    return [counts for counts, _ in chosen]
