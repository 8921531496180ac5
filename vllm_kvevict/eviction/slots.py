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

from vllm_kvevict.eviction.cache_ops import CacheOps, EvictionObserver, Released
from vllm_kvevict.eviction.point import EvictionPoint, LayerEviction, ScoringInputsFor, StreamRows
from vllm_kvevict.eviction.select import KeepRule, Selection, choose_kept_many


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
    request (:func:`~vllm_kvevict.eviction.select.choose_kept_many`)."""
    bs = cache.block_size
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
