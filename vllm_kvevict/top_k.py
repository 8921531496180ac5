"""Each row's best entries, ties to the earlier one: the ranking every
policy, allocation and backend selects by.

:func:`top_k_mask` and :func:`select_top` run in torch on any device, or,
for CPU float scores once the serving glue has loaded the C++ extension
(:func:`use_native_selection`), in one call of ``csrc/select_top.cpp``
(``top_k_mask``, ``top_k_indices``), which keeps the same entries.
"""

from __future__ import annotations

from types import ModuleType

import torch

# The CPU worker's C++ selection (``csrc/select_top.cpp``), set by the serving
# glue once it has loaded the extension: the same entries as the torch paths
# below, in one call where they run a dozen tensor ops.
_native: ModuleType | None = None


def use_native_selection(module: ModuleType | None) -> None:
    """Serve CPU selections (:func:`top_k_mask`, :func:`select_top`) with
    the C++ extension ``module``, or with torch again (``None``)."""
    global _native
    _native = module


def _native_for(scores: torch.Tensor) -> ModuleType | None:
    if _native is not None and scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return _native
    return None


def top_k_mask(scores: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
    """``[R, N]`` bool: each row's first ``k[r]`` entries (``k`` for every
    row when an int, clamped to ``[0, N]`` either way) in a stable
    descending sort (the ``k[r]`` highest scores, ties to the earlier entry),
    which is what every selection keeps.

    One ``topk`` finds each row's ``k[r]``-th score; the entries above it
    are kept, and as many of the entries equal to it as the count leaves,
    earliest first. A full stable sort costs 10x more at the prompt's end
    (3,843 tokens: 540 against 34 µs a layer). ``scores`` holds no NaN.
    """
    if isinstance(k, int):
        k = torch.full((scores.shape[0],), k, dtype=torch.int64, device=scores.device)
    native = _native_for(scores)
    if native is not None:
        return native.top_k_mask(scores.contiguous(), k.to(torch.int64).contiguous())
    rows, width = scores.shape
    k = k.clamp(0, width)
    largest = int(k.max()) if rows else 0
    if largest == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    top = torch.topk(scores, largest, dim=-1, sorted=True).values
    kth = top.gather(1, (k - 1).clamp(min=0)[:, None])  # [R, 1]
    above = scores > kth
    tied = scores == kth
    room = k[:, None] - above.sum(-1, keepdim=True)  # 0 where k is 0: no tie is taken
    return above | (tied & (tied.cumsum(-1) <= room))


def select_top(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Indices of each head's ``counts[h]`` best tokens, ascending, padded with
    ``-1`` to ``[H, max(counts)]``.

    Ties go to the earlier slot (:func:`top_k_mask`, a stable sort's order),
    so every implementation keeps the same tokens.
    """
    native = _native_for(scores)
    if native is not None:
        return native.top_k_indices(scores.contiguous(), counts.to(torch.int64).contiguous())
    keep = top_k_mask(scores, counts)
    width = max(int(counts.max()), 0) if counts.numel() else 0
    kept = torch.full((scores.shape[0], width), -1, dtype=torch.long, device=scores.device)
    rows, columns = keep.nonzero(as_tuple=True)  # row-major: each row's columns ascending
    if rows.numel():
        sizes = keep.sum(-1)
        first = sizes.cumsum(0) - sizes
        kept[rows, torch.arange(rows.numel(), device=scores.device) - first[rows]] = columns
    return kept
