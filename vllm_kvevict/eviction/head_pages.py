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
from dataclasses import dataclass, replace

import torch

from vllm_kvevict.eviction.allocation import allocate_request_tokens
from vllm_kvevict.eviction.cache_ops import (
    CacheOps, CompactsInPlace, CopiesHeads, EvictionObserver, ReadsTokens, Released, ScoresWindows, WritesHeads,
    implements,
)
from vllm_kvevict.eviction.point import EvictionPoint, LayerEviction, ScoringInputsFor, StreamRows
from vllm_kvevict.eviction.select import KeepRule, Selection, choose_kept_many
from vllm_kvevict.moments import EvictedMoments
from vllm_kvevict.policies.base import PADDING_POSITION, EvictionPolicy, ScoringInputs, StackedWindows
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
    (:func:`~vllm_kvevict.eviction.select.choose_kept_many` checks). For
    ``R`` requests at once: ``free_pages [R, F]`` (each request's own),
    ``counts [R, S]`` → ``[R, S, width]``."""
    if counts.dim() == 1:
        return page_tables(free_pages[None], counts[None], block_size, width)[0]
    num_requests, num_streams = counts.shape
    if not free_pages.shape[-1]:
        return torch.zeros(num_requests, num_streams, width, dtype=free_pages.dtype, device=counts.device)
    pages = (counts + (block_size - 1)) // block_size
    column = torch.arange(width, device=counts.device)[None, None, :]
    index = (pages.cumsum(-1) - pages)[..., None] + column
    chosen = free_pages.gather(1, index.long().clamp(max=free_pages.shape[1] - 1).flatten(1)).view(index.shape)
    return chosen.masked_fill(column >= pages[..., None], 0)


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
    first = inputs[0]
    host = torch.tensor(
        [window_sizes(inputs), list(starts), [e.ev.point for e in evictions]], dtype=torch.int32,
    ).to(first.keys.device)
    widths = [i.keys.shape[1] for i in inputs]
    votes = stacked_window_votes(
        cache, stacked_queries(inputs, host[0]), host[0], first.scale,
        torch.stack([e.rows.pages for e in evictions]),  # type: ignore[misc]
        torch.stack([e.rows.lens for e in evictions]),  # type: ignore[misc]
        torch.stack([e.rows.positions for e in evictions]), torch.stack([e.block_row for e in evictions]),
        host[1], host[2], max(widths),
    )
    return [votes[r, :, :width] for r, width in enumerate(widths)]


def window_inputs(
    evictions: Sequence[LayerEviction], device: torch.device, policy: EvictionPolicy
) -> list[ScoringInputs]:
    """Each request's scoring inputs for the window queries that vote for
    ``policy`` (:func:`voting_window`) and its scale alone, asked of the
    backend before any token is read (the tokens they are handed are
    empty), so one upload can carry the window sizes with every other size
    the device needs."""
    unread = torch.empty(0, device=device)
    return [voting_window(policy, e.scoring_inputs(unread, unread, unread, None)) for e in evictions]


def voting_window(policy: EvictionPolicy, inputs: ScoringInputs) -> ScoringInputs:
    """``inputs`` with the window queries whose votes ``policy`` scores by:
    the last ``policy.voting_queries`` of them (TOVA's one), or all."""
    last = policy.voting_queries
    if last is None or inputs.queries is None or inputs.query_positions is None:
        return inputs
    return replace(inputs, queries=inputs.queries[:, -last:], query_positions=inputs.query_positions[-last:],
                   memo={})


def window_sizes(windows: Sequence[ScoringInputs]) -> list[int]:
    """Each window's query count (0 for a policy that reads no queries)."""
    return [0 if w.queries is None else w.queries.shape[1] for w in windows]


def stacked_window_votes(
    cache: CacheOps, queries: torch.Tensor, query_lens: torch.Tensor, scale: float, pages: torch.Tensor,
    lens: torch.Tensor, positions: torch.Tensor, block_rows: torch.Tensor, starts: torch.Tensor,
    points: torch.Tensor, width: int,
) -> torch.Tensor:
    """The votes ``[R, H, width]`` of the requests' window ``queries``
    (:func:`stacked_queries`; ``query_lens``: their lengths on the device),
    the rest stacked per request on the device."""
    assert implements(cache, ScoresWindows)
    return cache.window_votes(
        queries, query_lens, pages, lens, positions, block_rows, starts, points, scale, width,
    )


def stacked_queries(inputs: Sequence[ScoringInputs], query_lens: torch.Tensor) -> torch.Tensor:
    """The window queries of the requests' ``inputs`` (``query_lens``: their
    lengths on the device) padded to the longest, ``[R, Hq, W, D]``, by one
    concatenation and one gather (a shorter window's rows past its length
    repeat its last row)."""
    assert inputs[0].queries is not None
    window = max(i.queries.shape[1] for i in inputs)  # type: ignore[union-attr]
    flat = torch.cat([i.queries for i in inputs], dim=1)  # type: ignore[misc]  # [Hq, sum W_r, D]
    sizes = query_lens.to(device=flat.device, dtype=torch.int64)
    row = torch.minimum(torch.arange(window, device=flat.device)[None, :], (sizes - 1).clamp(min=0)[:, None])
    return flat[:, (sizes.cumsum(0) - sizes)[:, None] + row].transpose(0, 1)


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
    if evictions and compacts_together(cache, rule, evictions):
        together = _compact_together(cache, rule, evictions, [layer] * len(evictions), observer, lengths)
        if together is not None:
            return together
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
            cache, evictions, [voting_window(rule.policy, sel.layers[0]) for sel in selections],
            [start for _, _, start in gathered],
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


def compact_layers_many(
    cache: CacheOps,
    rule: KeepRule,
    evictions: Sequence[LayerEviction],
    layers: Sequence[int],
    offsets: Sequence[int],
    observer: EvictionObserver,
    lengths: Sequence[Sequence[int]],
) -> list[torch.Tensor] | None:
    """The evictions of several layers (each eviction's ``layers``, a
    layer's adjacent) as one batch on ``cache``, the pool of every layer's
    blocks (``offsets``: where each eviction's layer's blocks start in it),
    as :func:`compact_head_pages_many` would evict each layer: the step's
    evictions at its end, when no token of the step attends after them.
    ``lengths``: each eviction's compacted tokens per head. Returns each
    eviction's kept tokens per head; ``None``, having written nothing, where
    they do not run as one batch (:func:`compacts_together`) or a selection
    must fall back, and the caller evicts layer by layer."""
    if not evictions or not compacts_together(cache, rule, evictions):
        return None
    return _compact_together(cache, rule, evictions, layers, observer, lengths, offsets)


def compacts_together(cache: CacheOps, rule: KeepRule, evictions: Sequence[LayerEviction]) -> bool:
    """Whether a layer's evictions run as one batch of every request: where
    the policy's scores of them come from one call (:func:`scores_together`),
    split by an allocation that splits requests together (uniform, AdaKV),
    every request with moments to fold, or none."""
    return (
        scores_together(cache, rule.policy)
        and rule.allocation.splits_requests_together
        and len({e.rows.moments is None for e in evictions}) == 1
    )


def scores_together(cache: CacheOps, policy: EvictionPolicy) -> bool:
    """Whether ``policy`` scores (and refines) the requests of a batch in
    one call on ``cache``, which must compact in place (the device path's):
    a policy that scores from the window votes (``reads_window_votes``:
    SnapKV, H2O, TOVA), where the cache computes the votes, and from each
    head's row of tokens alone (``scores_rows_apart``: Knorm, KeyDiff;
    StreamingLLM, random and the learned policy from their positions, no key
    or value read: ``scores_positions_only``) or with its request's window
    (``scores_stacked_requests``: Expected Attention; MomentKV, with the
    votes, its rounds and its moments; CriticalKV, its two stages and value
    factor; DefensiveKV), where the cache reads tokens by address; that
    refines nothing, or refines a request's rows apart from the others'
    (``scores_stacked_requests``)."""
    votes, tokens = policy.reads_window_votes, reads_tokens(policy)
    return bool(
        (votes or tokens)
        and (not votes or implements(cache, ScoresWindows))
        and (not tokens or implements(cache, ReadsTokens))
        and (not policy.refines or policy.scores_stacked_requests)
        and implements(cache, CompactsInPlace)
    )


def reads_tokens(policy: EvictionPolicy) -> bool:
    """Whether ``policy`` scores a batch of requests from their tokens (read
    by address), not from the window votes alone."""
    return policy.scores_rows_apart or policy.scores_stacked_requests


def _compact_together(
    cache: CacheOps,
    rule: KeepRule,
    evictions: Sequence[LayerEviction],
    layers: Sequence[int],
    observer: EvictionObserver,
    lengths: Sequence[Sequence[int]],
    offsets: Sequence[int] | None = None,
) -> list[torch.Tensor] | None:
    """:func:`compact_head_pages_many` for every request at once: the
    requests' token addresses padded to the longest (``[R, H, S]``), one
    call of the window-score kernel (for a policy of the votes alone, the
    only read of the keys; no value is read but the kept ones, by the
    compaction) and/or one gather of the tokens (:class:`ScoredTokens`),
    one scoring, one split (each request's allocation apart), the policy's
    refinement of every request at once, one top-k, one compaction launch
    folding the evicted tokens into the moments, the side buffers written
    with one multi-tensor copy each. Reads the device once (NaN scores,
    pages used), besides what the refinement reads; ``None`` where a
    request's selection must fall back (a NaN score, more pages than it
    keeps, a policy that raised), and the caller evicts request by request,
    which reports and handles it. Besides the host-sized uploads, the work
    per request is the backend's scoring inputs (its observation queries)
    and the stacking of its rows.

    ``layers``: each eviction's layer. With ``offsets`` (where each
    eviction's layer's blocks start in ``cache``, then a pool of every
    layer's blocks) the evictions of several layers run as one batch, the
    evictions of a layer adjacent: the tokens are addressed and moved in the
    pool, the page tables written in the layer's own block ids, and each run
    of evictions with model parts of their own (a layer's output projection,
    its RoPE: the scoring inputs' objects) is scored in a call of its own."""
    bs, num_heads, policy = cache.block_size, cache.num_heads, rule.policy
    points = [e.ev.point for e in evictions]
    starts = [max(e.ev.region_start, e.ev.protected_prefix) for e in evictions]
    width = max(max(n, default=0) + p - a for n, p, a in zip(lengths, points, starts))
    first_kept = [e.ev.frontier_after // bs for e in evictions]
    kept_blocks = [p // bs - f for p, f in zip(points, first_kept)]
    total_pages = [n * num_heads for n in kept_blocks]
    floors = [rule.allocation.floor_tokens(n * bs, num_heads) for n in total_pages]
    rows = [e.rows for e in evictions]
    pages = torch.stack([r.pages for r in rows])  # type: ignore[misc]  # [R, H, P]
    lens = torch.stack([r.lens for r in rows])  # type: ignore[misc]  # [R, H]
    positions = torch.stack([r.positions for r in rows])  # [R, H, C]
    block_rows = torch.stack([e.block_row for e in evictions])  # [R, NB]
    device = pages.device
    windows = window_inputs(evictions, device, policy)
    in_pool = offsets is not None and any(offsets)
    host = torch.tensor(
        [starts, points, first_kept, kept_blocks, total_pages, floors, window_sizes(windows)]
        + ([list(offsets)] if in_pool else []),  # type: ignore[arg-type]
        dtype=torch.int64,
    ).to(device)
    pool_pages, pool_block_rows = pages, block_rows
    if in_pool:  # the layers' own ids, as the pool names them
        pool_block_rows = block_rows.long() + host[7][:, None]
        pool_pages = pages + (host[7] * num_heads)[:, None, None]
    moments = EvictedMoments.stack([r.moments for r in rows]) if rows[0].moments is not None else None  # type: ignore[misc]
    runs = score_runs(policy, windows)
    scored = ScoredTokens.score_runs(
        cache, rule, runs, windows, host[6], pool_pages, lens, positions, pool_block_rows, host[0], host[1], width,
        moments,
    )
    if scored is None:
        return None
    voted = scored[0] if len(scored) == 1 else ScoredTokens.cat(scored)
    num_requests = len(evictions)
    counts = allocate_request_tokens(
        rule.allocation, voted.scores.view(num_requests, num_heads, width), host[4][:, None], host[5][:, None],
        total_pages, bs,
    )
    used = (counts + (bs - 1)) // bs
    checks = torch.cat([voted.raw.isnan().sum().view(1), used.sum(-1)]).tolist()  # the one host read
    if checks[0] or any(n > total for n, total in zip(checks[1:], total_pages)):
        return None
    refined = ScoredTokens.refined_runs(scored, policy, [counts[run] for run in runs])
    if refined is None:
        return None
    scores = refined[0] if len(refined) == 1 else torch.cat(refined)
    kept = select_top(scores, counts.flatten(), width=min(width, max(total_pages) * bs))
    kept = kept.unflatten(0, (num_requests, num_heads))
    free_pages = _kept_head_pages(block_rows, host[2], host[3], max(kept_blocks), num_heads)
    page_table = page_tables(free_pages, counts, bs, pages.shape[-1])
    pool_free_pages, pool_table = free_pages, page_table
    if in_pool:
        pool_free_pages = _kept_head_pages(pool_block_rows, host[2], host[3], max(kept_blocks), num_heads)
        pool_table = page_tables(pool_free_pages, counts, bs, pages.shape[-1])
    cache.compact_many(voted.addresses, voted.live.sum(-1), kept.clamp(min=0), counts, pool_table, moments)  # type: ignore[attr-defined]
    if moments is not None:
        moments.unstack_into([r.moments for r in rows])  # type: ignore[misc]
    # The side buffers: each request's rows are views of its own, one copy for all.
    torch._foreach_copy_([r.pages for r in rows], list(page_table.to(pages.dtype).unbind(0)))  # type: ignore[misc]
    columns = min(kept.shape[-1], positions.shape[-1])
    chosen = voted.positions.gather(2, kept[..., :columns].clamp(min=0)).to(positions.dtype)
    chosen = torch.where(kept[..., :columns] >= 0, chosen, positions[..., :columns])
    torch._foreach_copy_([r.positions[:, :columns] for r in rows], list(chosen.unbind(0)))
    torch._foreach_copy_([r.lens for r in rows], list(counts.to(lens.dtype).unbind(0)))  # type: ignore[misc]
    for r, eviction in enumerate(evictions):
        ev, block = eviction.ev, eviction.ev.point // bs
        observer.released(cache, Released(
            freed_blocks=eviction.block_row[ev.frontier_before // bs : ev.frontier_after // bs],
            layer=layers[r], free_pages=pool_free_pages[r, : total_pages[r]], counts=counts[r], page_size=bs,
            point_block=eviction.block_row[block : block + 1], point_slots=ev.point % bs,
            block_offsets=(offsets[r] if offsets is not None else 0,),
        ))
    return list(counts.unbind(0))


def score_runs(policy: EvictionPolicy, windows: Sequence[ScoringInputs]) -> list[slice]:
    """The runs of adjacent evictions scored in one call: all of them, or,
    where the policy scores with model parts (a layer's output projection,
    its RoPE), each run sharing the same ones (the scoring inputs' objects:
    one layer's evictions)."""
    cuts = [
        i for i in range(1, len(windows))
        if policy.needs_output_projection and windows[i].output_projection is not windows[i - 1].output_projection
        or policy.needs_rotary and windows[i].rotary is not windows[i - 1].rotary
    ]
    return [slice(a, b) for a, b in zip([0, *cuts], [*cuts, len(windows)])]


@dataclass
class ScoredTokens:
    """``R`` requests' live tokens of one layer, padded to ``[R, H, S]``, and
    the policy's scores of them, scored as one layer of ``R * H`` heads."""

    addresses: torch.Tensor  # [R, H, S] flat addresses, 0 for padding
    live: torch.Tensor  # [R, H, S] bool
    positions: torch.Tensor  # [R, H, S] original positions, PADDING_POSITION for padding
    raw: torch.Tensor  # [R * H, S] fp32, the policy's scores
    scores: torch.Tensor  # [R * H, S] the scores with the sinks, the recent window and padding marked
    inputs: ScoringInputs  # what the policy scored, [R * H] rows (its refinement reads them too)

    log_beta: torch.Tensor | None = None  # [R * H, S] fp32 the tokens' log β, where the policy reads them

    @classmethod
    def score(
        cls, cache: CacheOps, rule: KeepRule, windows: Sequence[ScoringInputs], query_lens: torch.Tensor,
        pages: torch.Tensor, lens: torch.Tensor, positions: torch.Tensor, block_rows: torch.Tensor,
        starts: torch.Tensor, points: torch.Tensor, width: int, moments: EvictedMoments | None = None,
        log_beta_pages: torch.Tensor | None = None,
    ) -> ScoredTokens | None:
        """Request ``r``'s tokens as :func:`live_tokens_many` finds them,
        scored by the policy (:func:`compacts_together`): from the votes of
        the window-score kernel (``reads_window_votes``; with nothing else,
        no key or value is read: a compaction moves the kept ones by
        address) and/or the tokens read by address in one gather
        (:func:`reads_tokens`; ``scores_stacked_requests`` with every
        request's window, :class:`StackedWindows`, and its moments
        ``[R, H, ...]``); marked as :meth:`~EvictionPolicy.mask_scores`
        marks them at each request's point. A policy of ``needs_log_beta``
        (the learned one) reads each token's log β from ``log_beta_pages``
        (one value per head-page slot, :func:`log_beta_at`) and its row's
        point as ``step``. ``None`` when the policy raised (the
        request-by-request path reports it and falls back)."""
        addresses, live, key_positions = live_tokens_many(
            pages, lens, positions, block_rows, starts, points, width, cache.block_size
        )
        policy, first = rule.policy, windows[0]
        queries = None
        if (policy.reads_window_votes or policy.scores_stacked_requests) and first.queries is not None:
            queries = stacked_queries(windows, query_lens)
        votes = None
        if policy.reads_window_votes:
            assert queries is not None
            votes = stacked_window_votes(
                cache, queries, query_lens, first.scale, pages, lens, positions, block_rows, starts, points, width
            ).flatten(0, 1)
        if reads_tokens(policy) and not policy.scores_positions_only:
            keys, values = cache.read_tokens(addresses.flatten(0, 1), live.flatten(0, 1))  # type: ignore[attr-defined]
        else:  # no key or value is read
            keys = values = torch.empty(addresses.shape[0] * addresses.shape[1], width, 0, device=addresses.device)
        stacked = None
        if policy.scores_stacked_requests and queries is not None:
            stacked = StackedWindows(queries, query_lens, points)
        point_rows = points[:, None].expand(-1, live.shape[1]).reshape(-1, 1)
        log_beta = None
        if policy.needs_log_beta:
            assert log_beta_pages is not None, f"policy {policy.name!r} scores with log_beta_pages"
            log_beta = log_beta_at(log_beta_pages, addresses.flatten(0, 1), live.flatten(0, 1))
        together = ScoringInputs(
            keys, values, key_positions.flatten(0, 1), None, None, first.scale,
            evicted=moments.heads() if moments is not None else None, rotary=first.rotary,
            output_projection=first.output_projection, window_votes=votes, windows=stacked,
            heads_per_request=live.shape[1], log_beta=log_beta,
            step=point_rows if log_beta is not None else None,
        )
        try:
            raw = policy.score(together).float()
        except Exception:
            return None
        scores = policy.mask_scores(
            raw, together, rule.sink_tokens, rule.recent_window, point_rows, live.flatten(0, 1)
        )
        return cls(addresses, live, key_positions, raw, scores, together, log_beta)

    @classmethod
    def cat(cls, groups: Sequence[ScoredTokens]) -> ScoredTokens:
        """Groups of requests scored apart (each layer's, where the policy
        scores with the layer's model parts), as one: their requests in
        order; ``inputs`` the first group's (refine each group with its own)."""
        def cat(field: str) -> torch.Tensor:
            return torch.cat([getattr(group, field) for group in groups])

        log_beta = cat("log_beta") if groups[0].log_beta is not None else None
        return cls(
            cat("addresses"), cat("live"), cat("positions"), cat("raw"), cat("scores"), groups[0].inputs, log_beta
        )

    @classmethod
    def score_runs(
        cls, cache: CacheOps, rule: KeepRule, runs: Sequence[slice], windows: Sequence[ScoringInputs],
        query_lens: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor, positions: torch.Tensor,
        block_rows: torch.Tensor, starts: torch.Tensor, points: torch.Tensor, width: int,
        moments: EvictedMoments | None = None, log_beta_pages: torch.Tensor | None = None,
    ) -> list[ScoredTokens] | None:
        """:meth:`score` of each run of the requests (``runs``: slices of
        the request dimension of every other argument, e.g. each layer's
        requests, :func:`score_runs`), a call each; ``None`` when one raised."""
        scored = []
        for run in runs:
            group = cls.score(
                cache, rule, windows[run], query_lens[run], pages[run], lens[run], positions[run], block_rows[run],
                starts[run], points[run], width, moments[run] if moments is not None else None, log_beta_pages,
            )
            if group is None:
                return None
            scored.append(group)
        return scored

    @staticmethod
    def refined_runs(
        groups: Sequence[ScoredTokens], policy: EvictionPolicy, counts: Sequence[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """:meth:`refined` of each group, with its requests' ``counts``
        (one ``[R_g, H]`` each); ``None`` when one raised."""
        refined = [group.refined(policy, group_counts) for group, group_counts in zip(groups, counts)]
        return None if any(scores is None for scores in refined) else refined  # type: ignore[return-value]

    def refined(self, policy: EvictionPolicy, counts: torch.Tensor) -> torch.Tensor | None:
        """The scores the heads keep their ``counts [R, H]`` by: the
        policy's refinement of every request at once (its
        :meth:`~EvictionPolicy.refine_scores`, ``scores_stacked_requests``),
        or the scores; ``None`` when the policy raised."""
        if not policy.refines:
            return self.scores
        try:
            return policy.refine_scores(self.inputs, self.scores, counts.flatten())
        except Exception:
            return None


def log_beta_at(log_beta_pages: torch.Tensor, addresses: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The log β of the tokens at the flat ``addresses`` (``log_beta_pages
    [num_head_pages, bs]``: one value per slot of every head-page, so a
    token's sits at its flat address), fp32, 0 where ``live`` is false."""
    return torch.where(live, log_beta_pages.reshape(-1)[addresses].float(), 0.0)


def live_tokens_many(
    pages: torch.Tensor, lens: torch.Tensor, positions: torch.Tensor, block_rows: torch.Tensor,
    starts: torch.Tensor, points: torch.Tensor, width: int, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`token_addresses` and :func:`gather_live`'s positions for ``R``
    requests at once, padded to ``width``: ``(addresses, live, positions)``,
    each ``[R, H, width]``; request ``r``'s standard slots ``[starts[r],
    points[r])`` after its compacted tokens. Column arithmetic, nothing read back."""
    num_requests, num_heads, _ = pages.shape
    bs, device = block_size, pages.device
    column = torch.arange(width, device=device)[None, None, :]
    head_lens = lens.to(torch.int64)[..., None]
    start, point = starts[:, None, None], points[:, None, None]
    compacted = column < head_lens
    live = column < head_lens + (point - start)
    standard = live & ~compacted
    slot = start + column - head_lens  # a standard column's slot
    index = torch.minimum(slot.clamp(min=0), (point - 1).clamp(min=0))
    blocks = block_rows.long().gather(1, (index // bs).flatten(1)).view_as(index)
    heads = torch.arange(num_heads, device=device)[None, :, None]
    addresses = torch.where(standard, (blocks * num_heads + heads) * bs + index % bs, 0)
    key_positions = torch.where(standard, slot, PADDING_POSITION)
    if pages.shape[-1] and positions.shape[-1]:
        in_pages = column.clamp(max=pages.shape[-1] * bs - 1) // bs
        page = pages.long().gather(2, in_pages.expand(num_requests, num_heads, -1))
        addresses = torch.where(compacted, page * bs + column % bs, addresses)
        known = positions.long().gather(2, column.clamp(max=positions.shape[-1] - 1).expand_as(page))
        key_positions = torch.where(compacted, known, key_positions)
    return addresses, live, key_positions


def _kept_head_pages(
    block_rows: torch.Tensor, first: torch.Tensor, count: torch.Tensor, most: int, num_heads: int
) -> torch.Tensor:
    """Each request's head-pages of its kept blocks ``block_rows[r, first[r]
    : first[r] + count[r]]``, block-major (:func:`block_head_pages`), ``[R,
    most * H]``, 0 past a request's own."""
    column = torch.arange(most, device=block_rows.device)[None, :]
    index = (first[:, None] + column).clamp(max=max(block_rows.shape[1] - 1, 0))
    blocks = block_rows.long().gather(1, index) if most else index
    head_pages = block_head_pages(blocks.flatten(), num_heads).view(blocks.shape[0], most * num_heads)
    valid = (column < count[:, None]).repeat_interleave(num_heads, dim=1, output_size=most * num_heads)
    return head_pages.masked_fill(~valid, 0)
