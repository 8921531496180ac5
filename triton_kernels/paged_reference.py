"""Torch reference ops over vLLM's paged KV cache (CPU layout).

These are the semantics every later kernel (Triton on GPU, C++ on CPU) is
tested against, and the ``cpu_attention="torch"`` serving path.

Layout: a *logical* paged cache ``[num_blocks, H, block_size, D]`` (callers
whose kernels store pages in another order convert first). A request's
*region* is a run of consecutive token slots starting at a block boundary,
addressed through the request's block-table row.
"""

from __future__ import annotations

import torch


def region_slots(block_ids: torch.Tensor, length: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) of the first ``length`` slots of a region."""
    slots = torch.arange(length, device=block_ids.device)
    return block_ids[slots // block_size].long(), slots % block_size


def gather_region(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Copy the first ``length`` slots of a region out of the cache: ``[H, length, D]``."""
    num_heads, block_size, head_dim = cache.shape[1:]
    pages = cache.index_select(0, block_ids.long())  # [nb, H, bs, D]
    tokens = pages.permute(1, 0, 2, 3).reshape(num_heads, -1, head_dim)
    return tokens[:, :length]


def scatter_region(cache: torch.Tensor, block_ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """Write ``tokens [H, L, D]`` into the first ``L`` slots of a region."""
    num_heads, length, _ = tokens.shape
    block, offset = region_slots(block_ids, length, cache.shape[2])
    heads = torch.arange(num_heads, device=cache.device)[:, None]
    cache[block[None, :], heads, offset[None, :]] = tokens.to(cache.dtype)


def region_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    region_start: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one request's queries over its live region.

    Args:
        query: ``[T, Hq, D]``, the queries of the last ``T`` positions
            ``seq_len - T .. seq_len - 1`` where ``seq_len = region_start + S``.
        keys, values: ``[H, S, D]``, the tokens in slots
            ``[region_start, seq_len)``: the retained tokens (in original order)
            followed by the new ones at their true slots.

    A slot never holds a token later than its own index, and every retained
    token precedes every new one, so "slot <= query position" is exactly the
    causal mask. GQA: query head ``j`` reads KV head ``j // G``. Returns
    ``[T, Hq, D]`` in fp32.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, length, _ = keys.shape
    group = num_q_heads // num_kv_heads
    seq_len = region_start + length
    q = query.float().reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    logits = torch.einsum("hgtd,hsd->hgts", q, keys.float()) * scale
    key_slots = torch.arange(region_start, seq_len, device=query.device)
    query_positions = torch.arange(seq_len - num_tokens, seq_len, device=query.device)
    future = key_slots[None, :] > query_positions[:, None]  # [T, S]
    logits = logits.masked_fill(future, float("-inf"))
    out = torch.einsum("hgts,hsd->hgtd", torch.softmax(logits, dim=-1), values.float())
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)
