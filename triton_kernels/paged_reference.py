"""Torch reference ops over a paged KV cache: a request's region of slots.

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

