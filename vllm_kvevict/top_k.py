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


def top_k_mask(scores: torch.Tensor, k: torch.Tensor | int, at_most: int | None = None) -> torch.Tensor:
    """``[R, N]`` bool: each row's first ``k[r]`` entries (``k`` for every
    row when an int, clamped to ``[0, N]`` either way) in a stable
    descending sort (the ``k[r]`` highest scores, ties to the earlier entry),
    which is what every selection keeps.

    One ``topk`` finds each row's ``k[r]``-th score; the entries above it
    are kept, and as many of the entries equal to it as the count leaves,
    earliest first. A full stable sort costs 10x more at the prompt's end
    (3,843 tokens: 540 against 34 µs a layer). ``scores`` holds no NaN.

    ``at_most``: a bound on ``k`` the caller knows, so the ``topk`` is sized
    without reading ``max(k)`` back from the device (an int ``k`` is its own).
    """
    rows, width = scores.shape
    if isinstance(k, int):
        at_most = k
        k = torch.full((rows,), k, dtype=torch.int64, device=scores.device)
    native = _native_for(scores)
    if native is not None:
        return native.top_k_mask(scores.contiguous(), k.to(torch.int64).contiguous())
    k = k.clamp(0, width)
    if at_most is None:
        largest = int(k.max()) if rows else 0
    else:
        largest = min(max(at_most, 0), width) if rows else 0
    if largest == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    top = torch.topk(scores, largest, dim=-1, sorted=True).values
    kth = top.gather(1, (k - 1).clamp(min=0)[:, None])  # [R, 1]
    above = scores > kth
    tied = scores == kth
    room = k[:, None] - above.sum(-1, keepdim=True)  # 0 where k is 0: no tie is taken
    return above | (tied & (tied.cumsum(-1) <= room))


def select_top(scores: torch.Tensor, counts: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Indices of each head's ``counts[h]`` best tokens, ascending, padded with
    ``-1`` to ``[H, width]``: ``width`` at least ``max(counts)``, given by a
    caller that knows such a bound on the host, or ``max(counts)`` read back.

    Ties go to the earlier slot (:func:`top_k_mask`, a stable sort's order),
    so every implementation keeps the same tokens. Each kept entry's column
    is its rank in its row (a cumulative sum), so nothing depends on how many
    entries are kept in all.
    """
    native = _native_for(scores)
    if native is not None:
        return native.top_k_indices(scores.contiguous(), counts.to(torch.int64).contiguous())
    if width is None:
        width = max(int(counts.max()), 0) if counts.numel() else 0
    keep = top_k_mask(scores, counts, at_most=width)
    rows, columns = scores.shape
    # Entries not kept go to a spare last column, dropped after.
    column = torch.where(keep, keep.cumsum(-1) - 1, width)
    kept = torch.full((rows, width + 1), -1, dtype=torch.long, device=scores.device)
    kept.scatter_(1, column, torch.arange(columns, device=scores.device).expand(rows, -1))
    return kept[:, :width]
