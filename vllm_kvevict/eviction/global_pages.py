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
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvevict.eviction.cache_ops import CacheOps, EvictionObserver, Released, WritesHeads, implements
from vllm_kvevict.eviction.head_pages import (
    LiveTokens,
    block_head_pages,
    gather_live,
    live_addresses,
    page_tables,
    put_where,
    record_kept,
    token_addresses,
    write_kept,
)
from vllm_kvevict.eviction.point import EvictionPoint, StreamRows
from vllm_kvevict.eviction.select import KeepRule, Selection, choose_kept_many
from vllm_kvevict.policies.base import ScoringInputs
from vllm_kvevict.schedule import cdiv


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
    return _log_beta_at(log_beta_pages, addresses, live)


def _log_beta_at(log_beta_pages: torch.Tensor, addresses: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    return torch.where(live, log_beta_pages.reshape(-1)[addresses].float(), 0.0)


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
    writes head by head reads the counts back once more.
    """
    bs, num_heads = cache.block_size, cache.num_heads
    lens = [rows.lens for request in requests for rows in request.layers]
    lengths = torch.stack(lens).view(len(requests), len(layer_block_offset), -1).tolist() if lens else []

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
            log_beta = _log_beta_at(log_beta_pages, addresses, tokens.live)
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
