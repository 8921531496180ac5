"""``head_budget: global`` or ``pyramid``: every layer's streams ranked together
(DBTrimKV's global top-B, or PyramidKV's layer budgets), on head-pages of every
layer's blocks.

The cache is every layer's blocks seen as one pool (layer ``l``'s block ``b``
is block ``offset_l + b``), so a stream's page table may name head-pages of
any layer: a layer that keeps more tokens uses the pages of layers that keep
fewer. Each cached token's log retention ``log β`` (the learned policy's
gate output) sits beside it, one fp32 per head-page slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_kvevict.eviction.allocation import allocate_request_tokens
from vllm_kvevict.eviction.cache_ops import CacheOps, EvictionObserver, Released, WritesHeads, implements
from vllm_kvevict.eviction.head_pages import (
    LiveTokens,
    ScoredTokens,
    block_head_pages,
    gather_live,
    live_addresses,
    log_beta_at,
    page_tables,
    put_where,
    record_kept,
    scores_together,
    token_addresses,
    voting_window,
    window_sizes,
    write_kept,
)
from vllm_kvevict.eviction.point import EvictionPoint, StreamRows
from vllm_kvevict.eviction.select import KeepRule, Selection, choose_kept_many
from vllm_kvevict.policies.base import ScoringInputs
from vllm_kvevict.schedule import cdiv
from vllm_kvevict.top_k import select_top


def gather_log_beta(
    log_beta_pages: torch.Tensor,
    pages: torch.Tensor,
    lens: torch.Tensor,
    block_row: torch.Tensor,
    region_start: int,
    point: int,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """The log β of the tokens :func:`gather_live` returns, in the same order:
    ``[H, S]`` fp32, 0 for padding (``lengths``: ``lens`` as the host knows
    them, or read back).

    ``log_beta_pages [num_head_pages, bs]`` holds one value per slot of every
    head-page (compacted pages in logical order, standard slots by slot), so
    a token's log β sits at its flat address.
    """
    if lengths is None:
        lengths = lens.tolist()
    width = max(lengths, default=0) + point - region_start
    bs = log_beta_pages.shape[1]
    addresses, live = token_addresses(pages, lens, block_row, region_start, point, width, bs)
    return log_beta_at(log_beta_pages, addresses, live)


@dataclass
class PooledEviction:
    """One request's last compacting point of a step, ranked over every
    layer: its side-buffer rows per layer, its block table row, where its
    standard region started and its frontier before the step, and per layer
    the observation queries and their positions (a query-based policy) and
    the model parts the policy scores with (``output_projection``, ``rotary``)."""

    ev: EvictionPoint
    layers: list[StreamRows]
    block_row: torch.Tensor
    region_start: int
    frontier_before: int
    observation: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    parts: list[dict[str, Any]] | None = None


def compact_global(
    cache: CacheOps,
    rule: KeepRule,
    ev: EvictionPoint,
    layers: list[StreamRows],
    layer_block_offset: list[int],
    log_beta_pages: torch.Tensor,
    block_row: torch.Tensor,
    region_start: int,
    frontier_before: int,
    scale: float,
    observer: EvictionObserver,
    observation: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    parts: list[dict[str, Any]] | None = None,
) -> list[list[int]]:
    """One request's ranking (:func:`compact_global_many`); returns each
    layer's per-head counts, read back."""
    request = PooledEviction(ev, layers, block_row, region_start, frontier_before, observation, parts)
    (per_layer,) = compact_global_many(
        cache, rule, [request], layer_block_offset, log_beta_pages, scale, observer
    )
    return torch.stack(per_layer).tolist()


def compact_global_many(
    cache: CacheOps,
    rule: KeepRule,
    requests: Sequence[PooledEviction],
    layer_block_offset: list[int],
    log_beta_pages: torch.Tensor,
    scale: float,
    observer: EvictionObserver,
) -> list[list[torch.Tensor]]:
    """For each request, keep the best tokens below ``ev.point`` over every
    (layer, KV head), in the head-pages of every layer's blocks
    ``[frontier_after, point // bs)``, split by the rule's allocation (one
    global ranking, or PyramidKV's layer budgets). Returns each request's
    per-layer counts, ``[H]`` on the device.

    The device is read twice for all of them: every layer's compacted
    lengths, which size the gathered tokens, and the selection's check
    (:func:`~vllm_kvevict.eviction.select.choose_kept_many`); a cache that
    writes head by head reads the counts back once more. On the device
    path every request and layer is one batch (:func:`pools_together`).
    """
    bs, num_heads = cache.block_size, cache.num_heads
    lens = [rows.lens for request in requests for rows in request.layers]
    lengths = torch.stack(lens).view(len(requests), len(layer_block_offset), -1).tolist() if lens else []
    if requests and pools_together(cache, rule, requests):
        together = _compact_global_together(
            cache, rule, requests, layer_block_offset, log_beta_pages, scale, observer, lengths
        )
        if together is not None:
            return together

    # Gather every layer first: a stream's new pages may be another layer's old ones.
    gathered: list[list[tuple[LiveTokens, torch.Tensor]]] = []
    selections: list[Selection] = []
    free: list[torch.Tensor] = []
    for request, request_lengths in zip(requests, lengths):
        ev, start = request.ev, request.region_start
        layer_tokens, inputs = [], []
        layers = zip(request.layers, layer_block_offset, request_lengths)
        for index, (rows, offset, head_lens) in enumerate(layers):
            assert rows.pages is not None and rows.lens is not None
            block_row = request.block_row + offset
            tokens = gather_live(
                cache, rows.pages, rows.lens, rows.positions, block_row, start, ev.point, head_lens
            )
            addresses = live_addresses(tokens, rows.pages, rows.lens, block_row, start, ev.point, bs)
            log_beta = log_beta_at(log_beta_pages, addresses, tokens.live)
            observation = request.observation[index] if request.observation else None
            queries, query_positions = observation or (None, None)
            inputs.append(ScoringInputs(
                tokens.keys, tokens.values, tokens.positions, queries, query_positions, scale,
                log_beta=log_beta, step=ev.point, **(request.parts[index] if request.parts else {}),
            ))
            layer_tokens.append((tokens, log_beta))
        kept_blocks = request.block_row[ev.frontier_after // bs : ev.point // bs]
        free_pages = torch.cat(
            [block_head_pages(kept_blocks + offset, num_heads) for offset in layer_block_offset]
        )
        selections.append(Selection(
            inputs, [tokens.live for tokens, _ in layer_tokens], ev.point, free_pages.numel(), bs,
            [[n + ev.point - start for n in head_lens] for head_lens in request_lengths],
        ))
        gathered.append(layer_tokens)
        free.append(free_pages)
    chosen = choose_kept_many(rule, selections)
    host_counts: list[list[int] | None] = [None] * len(chosen)
    if not implements(cache, WritesHeads) and chosen:  # head by head: counts on the host
        host_counts = torch.stack([counts for counts, _ in chosen]).tolist()
    results = []
    for request, layer_tokens, free_pages, (counts, kept), known in zip(
        requests, gathered, free, chosen, host_counts
    ):
        ev, width = request.ev, request.layers[0].pages.shape[1]  # type: ignore[union-attr]
        tables = page_tables(free_pages, counts, bs, min(width, cdiv(kept.shape[1], bs)))
        per_layer = []
        for index, (rows, (tokens, log_beta)) in enumerate(zip(request.layers, layer_tokens)):
            streams = slice(index * num_heads, (index + 1) * num_heads)
            table, layer_kept, layer_counts = tables[streams], kept[streams], counts[streams]
            layer_known = None if known is None else known[streams]
            write_kept(cache, tokens, layer_kept, layer_counts, table, layer_known)
            record_kept(rows, tokens, layer_kept, layer_counts, table)
            _write_log_beta(log_beta_pages, log_beta, layer_kept, layer_counts, table)
            per_layer.append(layer_counts)
        block = ev.point // bs
        observer.released(cache, Released(
            freed_blocks=request.block_row[request.frontier_before // bs : ev.frontier_after // bs],
            free_pages=free_pages, counts=counts, page_size=bs,
            point_block=request.block_row[block : block + 1], point_slots=ev.point % bs,
            block_offsets=tuple(layer_block_offset),
        ))
        results.append(per_layer)
    return results


def _write_log_beta(
    log_beta_pages: torch.Tensor, log_beta: torch.Tensor, kept: torch.Tensor, counts: torch.Tensor,
    page_table: torch.Tensor,
) -> None:
    """Each stream's kept tokens' log β, in order, into its new pages (the
    rest of its last page as it was)."""
    bs = log_beta_pages.shape[1]
    column = torch.arange(kept.shape[1], device=kept.device)[None, :]
    pages = page_table.long().gather(1, (column // bs).clamp(max=page_table.shape[1] - 1).expand_as(kept))
    values = log_beta.gather(1, kept.clamp(min=0)).to(log_beta_pages.dtype)
    valid = column < counts[:, None]
    addresses = (pages * bs + column % bs).flatten()
    put_where(log_beta_pages.view(-1), (addresses,), values.flatten(), valid.flatten())


def pools_together(cache: CacheOps, rule: KeepRule, requests: Sequence[PooledEviction]) -> bool:
    """Whether the requests' rankings over every layer run as one batch of
    every request and layer: where the policy scores them in one call per
    layer, or one for all layers (:func:`~vllm_kvevict.eviction.head_pages.scores_together`),
    the allocation splits requests together (the global ranking, PyramidKV)
    and no layer has moments to fold."""
    return (
        scores_together(cache, rule.policy)
        and rule.allocation.splits_requests_together
        and all(rows.moments is None for request in requests for rows in request.layers)
    )


def _compact_global_together(
    cache: CacheOps,
    rule: KeepRule,
    requests: Sequence[PooledEviction],
    layer_block_offset: list[int],
    log_beta_pages: torch.Tensor,
    scale: float,
    observer: EvictionObserver,
    lengths: Sequence[Sequence[Sequence[int]]],
) -> list[list[torch.Tensor]] | None:
    """:func:`compact_global_many` for every request and layer at once: the
    ``R * L`` (request, layer) items' token addresses in the pool padded to
    the longest (``[R * L, H, S]``, request-major), scored in one call for
    every item (:class:`~vllm_kvevict.eviction.head_pages.ScoredTokens`), or
    one per layer where the policy scores with the layer's model parts (the
    output projection, RoPE); each request's streams ``[L * H, S]`` split by
    one allocation, refined in the same calls, one top-k, one compaction
    launch, each side buffer written with one multi-tensor copy. Reads the
    device once (NaN scores, pages used), besides what the policy reads;
    ``None`` where a request's selection must fall back, and the caller
    ranks request by request, which reports and handles it."""
    bs, num_heads, policy = cache.block_size, cache.num_heads, rule.policy
    num_requests, num_layers = len(requests), len(layer_block_offset)
    points = [request.ev.point for request in requests]
    starts = [request.region_start for request in requests]
    width = max(
        max(n, default=0) + p - a for request_lengths, p, a in zip(lengths, points, starts) for n in request_lengths
    )
    first_kept = [request.ev.frontier_after // bs for request in requests]
    kept_blocks = [p // bs - f for p, f in zip(points, first_kept)]
    total_pages = [n * num_heads * num_layers for n in kept_blocks]
    streams = num_layers * num_heads
    floors = [rule.allocation.floor_tokens(n * bs, streams) for n in total_pages]
    rows = [layer for request in requests for layer in request.layers]  # item r * L + l
    pages = torch.stack([r.pages for r in rows])  # type: ignore[misc]  # [R * L, H, P]
    lens = torch.stack([r.lens for r in rows])  # type: ignore[misc]  # [R * L, H]
    positions = torch.stack([r.positions for r in rows])  # [R * L, H, C]
    device = pages.device
    unread = torch.empty(0, device=device)
    windows = []  # each item's window queries and model parts, no token read yet
    for request in requests:
        for layer in range(num_layers):
            queries, query_positions = (request.observation[layer] if request.observation else None) or (None, None)
            parts = request.parts[layer] if request.parts else {}
            windows.append(voting_window(policy, ScoringInputs(
                unread, unread, unread, queries, query_positions, scale, **parts,
            )))
    items = num_requests * num_layers
    host = torch.tensor(
        [[s for s in starts for _ in range(num_layers)], [p for p in points for _ in range(num_layers)],
         [o for _ in requests for o in layer_block_offset], window_sizes(windows)]
        + [values + [0] * (items - num_requests) for values in (first_kept, kept_blocks, total_pages, floors)],
        dtype=torch.int64,
    ).to(device)
    item_starts, item_points, item_offsets, query_lens = host[0], host[1], host[2], host[3]
    block_rows = torch.stack([request.block_row for request in requests])  # [R, NB]
    item_block_rows = block_rows.long().repeat_interleave(num_layers, 0) + item_offsets[:, None]  # in the pool
    # One scoring call for every item, or one per layer where the layers' model parts differ.
    groups = [slice(None)]
    if policy.needs_output_projection or policy.needs_rotary:
        groups = [slice(layer, None, num_layers) for layer in range(num_layers)]
    scored = ScoredTokens.score_runs(
        cache, rule, groups, windows, query_lens, pages, lens, positions, item_block_rows, item_starts, item_points,
        width, log_beta_pages=log_beta_pages,
    )
    if scored is None:
        return None

    def per_item(field: str) -> torch.Tensor:
        """A field of the groups' items, ``[R * L, H, S]`` request-major."""
        parts = [getattr(group, field).view(-1, num_heads, width) for group in scored]
        if len(parts) == 1:
            return parts[0]
        return torch.stack([part.view(num_requests, num_heads, width) for part in parts], dim=1).flatten(0, 1)

    scores = per_item("scores").view(num_requests, streams, width)
    request_pages = host[4 + 2, :num_requests, None]
    counts = allocate_request_tokens(
        rule.allocation, scores, request_pages, host[4 + 3, :num_requests, None], total_pages, bs, num_layers
    )  # [R, L * H]
    used = (counts + (bs - 1)) // bs
    nan = torch.stack([group.raw.isnan().sum() for group in scored]).sum()
    checks = torch.cat([nan.view(1), used.sum(-1)]).tolist()  # the one host read
    if checks[0] or any(n > total for n, total in zip(checks[1:], total_pages)):
        return None
    if policy.refines:
        item_counts = counts.view(num_requests, num_layers, num_heads)
        refined = ScoredTokens.refined_runs(
            scored, policy, [item_counts.flatten(0, 1)] if len(groups) == 1 else list(item_counts.unbind(1))
        )
        if refined is None:
            return None
        scored = [replace(group, scores=scores_of) for group, scores_of in zip(scored, refined)]
        scores = per_item("scores").view(num_requests, streams, width)
    kept = select_top(scores.flatten(0, 1), counts.flatten(), width=min(width, max(total_pages) * bs))
    kept = kept.view(items, num_heads, -1)
    item_counts = counts.view(items, num_heads)
    free_pages = _pooled_head_pages(
        block_rows, host[4, :num_requests], host[4 + 1, :num_requests], max(kept_blocks), num_heads,
        host[2, :num_layers],
    )
    page_table = page_tables(free_pages, counts, bs, pages.shape[-1]).view(items, num_heads, -1)
    addresses, live = per_item("addresses"), per_item("live")
    log_beta = per_item("log_beta").flatten(0, 1) if policy.needs_log_beta else None
    cache.compact_many(addresses, live.sum(-1), kept.clamp(min=0), item_counts, page_table)  # type: ignore[attr-defined]
    if log_beta is not None:
        _write_log_beta(
            log_beta_pages, log_beta, kept.flatten(0, 1), item_counts.flatten(), page_table.flatten(0, 1)
        )
    # The side buffers: each item's rows are views of its own, one copy for all.
    torch._foreach_copy_([r.pages for r in rows], list(page_table.to(pages.dtype).unbind(0)))  # type: ignore[misc]
    columns = min(kept.shape[-1], positions.shape[-1])
    chosen = per_item("positions").gather(2, kept[..., :columns].clamp(min=0)).to(positions.dtype)
    chosen = torch.where(kept[..., :columns] >= 0, chosen, positions[..., :columns])
    torch._foreach_copy_([r.positions[:, :columns] for r in rows], list(chosen.unbind(0)))
    torch._foreach_copy_([r.lens for r in rows], list(item_counts.to(lens.dtype).unbind(0)))  # type: ignore[misc]
    results = []
    for r, request in enumerate(requests):
        ev, block = request.ev, request.ev.point // bs
        observer.released(cache, Released(
            freed_blocks=request.block_row[request.frontier_before // bs : ev.frontier_after // bs],
            free_pages=free_pages[r, : total_pages[r]], counts=counts[r], page_size=bs,
            point_block=request.block_row[block : block + 1], point_slots=ev.point % bs,
            block_offsets=tuple(layer_block_offset),
        ))
        results.append(list(item_counts[r * num_layers : (r + 1) * num_layers].unbind(0)))
    return results


def _pooled_head_pages(
    block_rows: torch.Tensor, first: torch.Tensor, count: torch.Tensor, most: int, num_heads: int,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Each request's head-pages of its kept blocks ``block_rows[r, first[r]
    : first[r] + count[r]]`` in every layer's blocks of the pool (layer
    ``l``'s block ``b`` is ``offsets[l] + b``), layer-major, then
    block-major (:func:`~vllm_kvevict.eviction.head_pages.block_head_pages`
    per layer, concatenated): ``[R, L * most * H]``, 0 past a request's own."""
    num_layers = offsets.shape[0]
    column = torch.arange(num_layers * most * num_heads, device=block_rows.device)[None, :]
    per_layer = (count * num_heads)[:, None]  # [R, 1]
    layer, within = column // per_layer.clamp(min=1), column % per_layer.clamp(min=1)
    index = (first[:, None] + within // num_heads).clamp(max=max(block_rows.shape[1] - 1, 0))
    blocks = block_rows.long().gather(1, index) + offsets[layer.clamp(max=num_layers - 1)]
    head_pages = (blocks * num_heads + within % num_heads).to(torch.int32)
    return head_pages.masked_fill(column >= per_layer * num_layers, 0)
