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

from typing import Any

import torch

from vllm_kvevict.eviction.cache_ops import CacheOps, EvictionObserver, Released
from vllm_kvevict.eviction.head_pages import (
    LiveTokens,
    assign_pages,
    block_head_pages,
    gather_live,
    page_table_of,
    record_kept,
    write_kept,
)
from vllm_kvevict.eviction.point import EvictionPoint, StreamRows
from vllm_kvevict.eviction.select import KeepRule, choose_kept
from vllm_kvevict.policies.base import ScoringInputs
from vllm_kvevict.schedule import cdiv


def gather_log_beta(
    log_beta_pages: torch.Tensor,
    pages: torch.Tensor,
    lens: torch.Tensor,
    block_row: torch.Tensor,
    region_start: int,
    point: int,
) -> torch.Tensor:
    """The log β of the tokens :func:`gather_live` returns, in the same order:
    ``[H, S]`` fp32, 0 for padding.

    ``log_beta_pages [num_head_pages, bs]`` holds one value per slot of every
    head-page (compacted pages in logical order, standard slots by slot).
    """
    num_heads = pages.shape[0]
    bs = log_beta_pages.shape[1]
    lengths = lens.tolist()
    num_standard = point - region_start
    out = torch.zeros(
        num_heads, max(lengths) + num_standard, dtype=torch.float32, device=log_beta_pages.device
    )
    slots = torch.arange(region_start, point, device=block_row.device)
    standard_pages = block_head_pages(block_row[slots // bs], num_heads).view(-1, num_heads).T.long()
    standard = log_beta_pages[standard_pages, (slots % bs)[None, :].expand(num_heads, -1)]
    for h, length in enumerate(lengths):
        if length:
            out[h, :length] = log_beta_pages[pages[h, : cdiv(length, bs)].long()].reshape(-1)[:length]
        out[h, length : length + num_standard] = standard[h]
    return out


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
    """Keep the best tokens below ``ev.point`` over every (layer, KV head) of
    the request, in the head-pages of every layer's blocks
    ``[frontier_after, point // bs)``, split by the rule's allocation (one
    global ranking, or PyramidKV's layer budgets). ``observation``: per layer,
    the observation queries and their positions, for a query-based policy;
    ``parts``: per layer, the model parts the policy scores with
    (``output_projection``, ``rotary``).
    Returns each layer's per-head counts."""
    bs, num_heads = cache.block_size, cache.num_heads
    # Gather every layer first: a stream's new pages may be another layer's old ones.
    gathered: list[tuple[LiveTokens, torch.Tensor]] = []
    inputs: list[ScoringInputs] = []
    for index, (rows, offset) in enumerate(zip(layers, layer_block_offset)):
        assert rows.pages is not None and rows.lens is not None
        tokens = gather_live(
            cache, rows.pages, rows.lens, rows.positions, block_row + offset, region_start, ev.point
        )
        log_beta = gather_log_beta(
            log_beta_pages, rows.pages, rows.lens, block_row + offset, region_start, ev.point
        )
        queries, query_positions = (observation[index] if observation else None) or (None, None)
        inputs.append(ScoringInputs(
            tokens.keys, tokens.values, tokens.positions, queries, query_positions, scale,
            log_beta=log_beta, step=ev.point, **(parts[index] if parts else {}),
        ))
        gathered.append((tokens, log_beta))
    kept_blocks = block_row[ev.frontier_after // bs : ev.point // bs]
    free_pages = torch.cat([block_head_pages(kept_blocks + offset, num_heads) for offset in layer_block_offset])
    counts, kept = choose_kept(
        rule, inputs, [tokens.live for tokens, _ in gathered], ev.point, free_pages.numel(), bs
    )
    counts_list = counts.tolist()
    new_pages = assign_pages(free_pages, counts_list, bs)
    per_layer: list[list[int]] = []
    for index, (rows, (tokens, log_beta)) in enumerate(zip(layers, gathered)):
        streams = slice(index * num_heads, (index + 1) * num_heads)
        layer_counts = counts_list[streams]
        table = page_table_of(new_pages[streams], rows.pages)
        write_kept(cache, tokens, kept[streams], counts[streams], table)
        record_kept(rows, tokens, kept[streams], counts[streams], table)
        for h, count in enumerate(layer_counts):
            if count:
                stream_pages = new_pages[index * num_heads + h].long()
                page_rows = log_beta_pages[stream_pages]
                page_rows.view(-1)[:count] = log_beta[h, kept[index * num_heads + h, :count]]
                log_beta_pages[stream_pages] = page_rows
        per_layer.append(layer_counts)
    used = sum(p.numel() for p in new_pages)
    partial = int(block_row[ev.point // bs]) if ev.point % bs else None
    observer.released(cache, Released(
        unused_pages=free_pages[used:],
        partial_blocks=[] if partial is None else [
            (partial + offset, ev.point % bs) for offset in layer_block_offset
        ],
        freed_blocks=block_row[frontier_before // bs : ev.frontier_after // bs],
    ))
    return per_layer
