"""SnapKV's window votes in torch, one (request, KV head) at a time.

SnapKV (Li et al., 2024) scores a token by the attention it receives from the
last ``W`` queries before the eviction point, averaged over those queries and
over the ``G`` query heads that share its KV head, then pooled along the
sequence. :func:`window_votes_torch` is that mean for one KV head's keys (the
pooling is the policy's: :func:`vllm_kvevict.policies.snapkv.pool_votes`). The Triton
kernel :func:`~vllm_kvevict.triton_kernels.window_scores.window_votes` computes
the same votes for a whole batch; the reference there runs this function on the
logical cache. Imports neither Triton nor vLLM.
"""

from __future__ import annotations

import torch

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
