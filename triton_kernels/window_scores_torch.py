"""SnapKV's window votes in torch, one (request, KV head) at a time, and the
pooling that smooths them.

SnapKV (Li et al., 2024) scores a token by the attention it receives from the
last ``W`` queries before the eviction point, averaged over those queries and
over the ``G`` query heads that share its KV head, then pooled along the
sequence. :func:`window_votes_torch` is that mean for one KV head's keys;
:func:`pool_votes` the pooling over many heads' padded rows at once. The Triton
kernel :func:`~vllm_kvevict.triton_kernels.window_scores.window_votes` computes
the same votes for a whole batch; the reference there runs this function on the
logical cache. Imports neither Triton nor vLLM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_kvevict.triton_kernels.batch import HeadPagedBatch


def window_votes_torch(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Mean causal attention each key receives, ``[L]`` fp32.

    Args:
        queries: ``[G, W, D]`` the window queries of the KV head's query heads.
        keys: ``[L, D]``.
        key_positions: ``[L]`` each key's position in the sequence.
        query_positions: ``[W]``.

    A query sees a key when the key's position is not after its own (its own
    token included). A query that sees no key gives every key zero, and still
    counts in the mean over the ``G * W`` queries. No query: zeros.
    """
    group, window, _ = queries.shape
    if window == 0 or group == 0:
        return torch.zeros(keys.shape[0], dtype=torch.float32, device=keys.device)
    logits = torch.einsum("gwd,ld->gwl", queries.float(), keys.float()) * scale
    visible = key_positions[None, :] <= query_positions[:, None]  # [W, L]
    logits = logits.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # -inf where nothing is visible
    probs = torch.exp(logits - lse).nan_to_num(0.0)
    return probs.sum(dim=(0, 1)) / (group * window)


def item_lengths(batch: HeadPagedBatch) -> torch.Tensor:
    """Keys per (request, KV head), ``[R, H]`` int64: the compacted tokens and
    the standard slots ``[region_start, seq_len)``."""
    if batch.seq_lens is None or batch.region_start is None:
        raise ValueError("window votes need the batch's seq_lens and region_start")
    region = (batch.seq_lens.long() - batch.region_start.long()).clamp(min=0)
    return batch.head_lens.long() + region[:, None]


def pool_votes(votes: torch.Tensor, lengths: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV's 1-D pooling of each row's first ``lengths`` votes, fp32, zero past them.

    ``votes [..., width]`` (rows padded past their length), ``lengths [...]``.
    A row is pooled over its own votes alone, as if it were ``lengths`` long:
    odd ``kernel_size``, stride 1, the window clipped at both ends (``max``, or
    ``avg`` over the votes inside it: ``count_include_pad=False``).
    """
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd number, got {kernel_size}")
    if pooling not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    shape, width = votes.shape, votes.shape[-1]
    if votes.numel() == 0:
        return votes.float()
    rows = votes.reshape(-1, 1, width).float()
    inside = torch.arange(width, device=votes.device)[None, None, :] < lengths.reshape(-1, 1, 1).to(votes.device)
    pad = kernel_size // 2
    if pooling == "max":
        pooled = F.max_pool1d(rows.masked_fill(~inside, float("-inf")), kernel_size, stride=1, padding=pad)
    else:
        # Window sums over window counts; a row's tail counts as padding.
        ones = inside.float()
        total = F.avg_pool1d(rows.masked_fill(~inside, 0.0), kernel_size, stride=1, padding=pad)
        count = F.avg_pool1d(ones, kernel_size, stride=1, padding=pad)
        pooled = total / count.clamp(min=1.0 / kernel_size)
    return pooled.masked_fill(~inside, 0.0).reshape(shape)
