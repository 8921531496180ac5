"""``slots`` storage: each KV head keeps its tokens in its own slots of the
request's live blocks, so an unmodified paged kernel reads them.

After evicting at point ``P`` every head holds ``P - F`` tokens in the slots
``[F, P)`` (``F``: the schedule's frontier), followed by the slots of tokens
written since. ``positions[h, i]`` is the original position of the token in
slot ``F + i`` below the last point; slots at or after it hold the token of
their own position. A protected prefix (the slots ``[0, p)``, ``p <= F``) is
never a candidate: its tokens stay where they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_kvevict.eviction.allocation import allocate_request_tokens
from vllm_kvevict.eviction.cache_ops import CacheOps, EvictionObserver, Released
from vllm_kvevict.eviction.head_pages import (
    ScoredTokens, compacts_together, score_runs, window_inputs, window_sizes,
)
from vllm_kvevict.eviction.point import EvictionPoint, LayerEviction, ScoringInputsFor, StreamRows
from vllm_kvevict.eviction.select import KeepRule, Selection, choose_kept_many
from vllm_kvevict.schedule import cdiv
from vllm_kvevict.top_k import select_top


def evict_slots(
    cache: CacheOps,
    rule: KeepRule,
    ev: EvictionPoint,
    positions_row: torch.Tensor,
    block_row: torch.Tensor,
    scoring_inputs: ScoringInputsFor,
    layer: int,
    observer: EvictionObserver,
) -> list[int] | None:
    """One request's eviction (:func:`evict_slots_many`)."""
    eviction = LayerEviction(ev, StreamRows(positions_row), block_row, scoring_inputs)
    return evict_slots_many(cache, rule, [eviction], layer, observer)[0]


def evict_slots_many(
    cache: CacheOps,
    rule: KeepRule,
    evictions: Sequence[LayerEviction],
    layer: int,
    observer: EvictionObserver,
) -> list[list[int] | None]:
    """For each request, keep the policy's choice of the live tokens below
    ``ev.point`` in the slots ``[frontier_after, point)``; its positions row
    (``rows.positions [H, capacity]``) follows. Returns the tokens each head
    keeps, or None when nothing moved. One read of the device for every
    request (:func:`~vllm_kvevict.eviction.select.choose_kept_many`).
    Where :func:`~vllm_kvevict.eviction.head_pages.compacts_together` (the
    device path: SnapKV, H2O, TOVA from the window votes; Knorm, KeyDiff,
    StreamingLLM, Expected Attention from the tokens), the requests whose frontier
    moves are evicted as one batch (:func:`_evict_together`)."""
    bs = cache.block_size
    if evictions and compacts_together(cache, rule, evictions):
        together = _evict_together(cache, rule, evictions, [layer] * len(evictions), observer)
        if together is not None:
            return together
    results: list[list[int] | None] = [None] * len(evictions)
    moving: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    selections: list[Selection] = []
    for i, eviction in enumerate(evictions):
        ev, positions_row, block_row = eviction.ev, eviction.rows.positions, eviction.block_row
        # Slots [frontier_before, compacted_end) hold tokens kept at the last
        # point; the protected prefix [0, frontier_before at first) is not a candidate.
        compacted_end = max(ev.last_point_before, ev.frontier_before)
        num_compacted = compacted_end - ev.frontier_before
        num_live = ev.point - ev.frontier_before
        new_positions = torch.arange(compacted_end, ev.point, device=positions_row.device)
        if ev.frontier_after == ev.frontier_before:
            # The frontier stays in its block: every live token is kept where it
            # is; only record where the new ones came from.
            if num_live > num_compacted:
                positions_row[:, num_compacted:num_live] = new_positions
            continue
        keys, values = cache.read_slots(block_row, ev.frontier_before, ev.point)
        num_heads = keys.shape[0]
        positions = torch.cat(
            [positions_row[:, :num_compacted], new_positions.expand(num_heads, -1)], dim=1
        )
        num_keep = ev.point - ev.frontier_after
        inputs = eviction.scoring_inputs(keys, values, positions, None)
        # Every head keeps exactly num_keep tokens: a uniform split of one-token pages.
        selections.append(Selection([inputs], [None], ev.point, num_heads * num_keep, 1))
        moving.append((i, keys, values, positions))
    for (i, keys, values, positions), (_, kept) in zip(moving, choose_kept_many(rule, selections)):
        ev, positions_row, block_row = evictions[i].ev, evictions[i].rows.positions, evictions[i].block_row
        num_keep = ev.point - ev.frontier_after
        kept = kept[:, :num_keep]  # each head's count
        gather_index = kept.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        cache.write_slots(
            block_row, ev.frontier_after, keys.gather(1, gather_index), values.gather(1, gather_index)
        )
        positions_row[:, :num_keep] = positions.gather(1, kept)
        observer.released(cache, Released(
            freed_blocks=block_row[ev.frontier_before // bs : ev.frontier_after // bs], layer=layer
        ))
        results[i] = [num_keep] * keys.shape[0]
    return results


def evict_slots_layers_many(
    cache: CacheOps,
    rule: KeepRule,
    evictions: Sequence[LayerEviction],
    layers: Sequence[int],
    offsets: Sequence[int],
    observer: EvictionObserver,
) -> list[list[int] | None] | None:
    """The evictions of several layers (each eviction's ``layers``, a
    layer's adjacent) as one batch on ``cache``, the pool of every layer's
    blocks (``offsets``: where each eviction's layer's blocks start in it),
    as :func:`evict_slots_many` would evict each layer: the step's
    evictions at its end, when no token of the step attends after them.
    ``None``, having moved no token (the positions of a request whose
    frontier stays in its block may be recorded, as the fallback records
    them again), where they do not run as one batch
    (:func:`~vllm_kvevict.eviction.head_pages.compacts_together`) or a
    request must fall back, and the caller evicts layer by layer."""
    if not evictions or not compacts_together(cache, rule, evictions):
        return None
    return _evict_together(cache, rule, evictions, layers, observer, offsets)


def _evict_together(
    cache: CacheOps, rule: KeepRule, evictions: Sequence[LayerEviction], layers: Sequence[int],
    observer: EvictionObserver, offsets: Sequence[int] | None = None,
) -> list[list[int] | None] | None:
    """:func:`evict_slots_many` for every request whose frontier moves at
    once, as head pages see them: a head's tokens kept at earlier points
    fill whole head-pages from the block ``frontier_before // bs`` (its page
    table, at their original positions), the tokens since its last point
    are its standard slots; the window-score kernel votes for every request
    and head in one call (or one gather reads their tokens,
    :class:`~vllm_kvevict.eviction.head_pages.ScoredTokens`), one scoring
    and one top-k choose, and the
    compaction kernel moves each head's kept tokens, in order, into its
    slots from ``frontier_after`` (whole head-pages of the request's
    blocks), one launch for every request. Nothing else is read but the
    selection's one check (NaN, pages); ``None`` where a request must fall
    back, and the caller evicts request by request. ``layers``: each
    eviction's layer; with ``offsets`` (where each eviction's layer's blocks
    start in ``cache``, a pool of every layer's blocks) several layers'
    evictions run as one batch, scored as
    :func:`~vllm_kvevict.eviction.head_pages.score_runs` splits them."""
    bs, num_heads = cache.block_size, cache.num_heads
    results: list[list[int] | None] = [None] * len(evictions)
    moving = []
    for i, eviction in enumerate(evictions):
        ev, positions_row = eviction.ev, eviction.rows.positions
        if ev.frontier_after == ev.frontier_before:  # kept where they are: positions only
            compacted_end = max(ev.last_point_before, ev.frontier_before)
            num_compacted, num_live = compacted_end - ev.frontier_before, ev.point - ev.frontier_before
            if num_live > num_compacted:
                positions_row[:, num_compacted:num_live] = torch.arange(
                    compacted_end, ev.point, device=positions_row.device
                )
        else:
            moving.append(i)
    if not moving:
        return results
    chosen = [evictions[i] for i in moving]
    evs = [e.ev for e in chosen]
    ends = [max(ev.last_point_before, ev.frontier_before) for ev in evs]  # of the tokens kept before
    compacted = [end - ev.frontier_before for end, ev in zip(ends, evs)]
    keeps = [ev.point - ev.frontier_after for ev in evs]
    width = max(ev.point - ev.frontier_before for ev in evs)
    page_columns = max(1, max(cdiv(n, bs) for n in compacted), max(cdiv(n, bs) for n in keeps))
    block_rows = torch.stack([e.block_row for e in chosen])  # [R, NB]
    positions = torch.stack([e.rows.positions for e in chosen])  # [R, H, C]
    device = block_rows.device
    windows = window_inputs(chosen, device, rule.policy)
    in_pool = offsets is not None and any(offsets)
    host = torch.tensor([
        ends, [ev.point for ev in evs], [ev.frontier_before // bs for ev in evs],
        [ev.frontier_after // bs for ev in evs], compacted, keeps, [num_heads * n for n in keeps],
        window_sizes(windows),
    ] + ([[offsets[i] for i in moving]] if in_pool else []), dtype=torch.int64).to(device)  # type: ignore[index]
    if in_pool:  # the layers' blocks as the pool names them
        block_rows = block_rows.long() + host[8][:, None]
    num_requests = len(chosen)
    # Head h's kept tokens before and after: whole head-pages of the blocks
    # from frontier_before, and from frontier_after.
    column = torch.arange(page_columns, device=device)[None, :]
    heads = torch.arange(num_heads, device=device)[None, :, None]

    def head_pages(first_block: torch.Tensor) -> torch.Tensor:
        index = (first_block[:, None] + column).clamp(max=block_rows.shape[1] - 1)
        return (block_rows.long().gather(1, index)[:, None, :] * num_heads + heads).to(torch.int32)  # [R, H, P]

    pages, lens = head_pages(host[2]), host[4][:, None].expand(-1, num_heads)
    runs = score_runs(rule.policy, windows)
    scored = ScoredTokens.score_runs(
        cache, rule, runs, windows, host[7], pages, lens, positions, block_rows, host[0], host[1], width
    )
    if scored is None:
        return None
    voted = scored[0] if len(scored) == 1 else ScoredTokens.cat(scored)
    # Every head keeps exactly its request's count: one-token pages split uniformly.
    counts = allocate_request_tokens(
        rule.allocation, voted.scores.view(num_requests, num_heads, width), host[6][:, None],
        torch.zeros_like(host[6])[:, None], [num_heads * n for n in keeps], 1,
    )
    checks = torch.cat([voted.raw.isnan().sum().view(1), (counts != host[5][:, None]).sum().view(1)]).tolist()
    if any(checks):  # a NaN score, or a head that cannot keep its count
        return None
    refined = ScoredTokens.refined_runs(scored, rule.policy, [counts[run] for run in runs])
    if refined is None:
        return None
    scores = refined[0] if len(refined) == 1 else torch.cat(refined)
    kept = select_top(scores, counts.flatten(), width=max(keeps)).unflatten(0, (num_requests, num_heads))
    cache.compact_many(voted.addresses, voted.live.sum(-1), kept.clamp(min=0), counts, head_pages(host[3]))  # type: ignore[attr-defined]
    new_positions = voted.positions.gather(2, kept.clamp(min=0)).to(positions.dtype)
    torch._foreach_copy_(
        [e.rows.positions[:, :n] for e, n in zip(chosen, keeps)],
        [new_positions[r, :, :n] for r, n in enumerate(keeps)],
    )
    for i, eviction, keep in zip(moving, chosen, keeps):
        ev = eviction.ev
        observer.released(cache, Released(
            freed_blocks=eviction.block_row[ev.frontier_before // bs : ev.frontier_after // bs], layer=layers[i]
        ))
        results[i] = [keep] * num_heads
    return results
