from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from vllm_kvevict.policies.base import (
    PADDING_POSITION,
    EvictionPolicy,
    ScoringInputs,
    grouped_attention_probs,
)


@dataclass
class SnapKVPolicy(EvictionPolicy):
    """SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for
    Before Generation"): a token's importance is the attention it receives from
    the last ``observation_window`` queries, smoothed along the sequence by a
    1-D pooling of width ``kernel_size`` so that neighbours of important tokens
    are kept with them.

    GQA: the attention of the ``G`` query heads sharing a KV head is averaged
    (as in kvpress and the KeyDiff paper's baselines, App. F.2). The original
    repository's configs use max pooling with kernel 7 and window 32; the
    default kernel here is 15: on the default model, which writes numbers
    digit by digit, kernel 7 keeps a number the window attends to but drops
    its neighbouring digits, and kernel 15 keeps them (RULER at 4k,
    ``benchmarks/README.md``).

    Where the engine passes the votes (``window_votes``: the mean over the
    window queries and the group, computed for every request and head of a
    layer at once by the window-score kernel) they are pooled over each
    head's own tokens (:func:`pool_votes`), the padding after a shorter head's
    tokens left out; the same scores as attending head by head.
    """

    name = "snapkv"
    needs_queries = True
    reads_window_votes = True
    default_prefill_mode = "end_of_prompt"
    kernel_size: int = 15
    pooling: Literal["max", "avg"] = "max"

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(
                f"snapkv kernel_size must be a positive odd number, got {self.kernel_size}"
            )
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv pooling must be 'max' or 'avg', got {self.pooling!r}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.window_votes is not None:
            lengths = (inputs.key_positions < PADDING_POSITION).sum(-1)
            return pool_votes(inputs.window_votes, lengths, self.kernel_size, self.pooling)
        probs = grouped_attention_probs(inputs)  # [H, G, W, S]
        votes = probs.flatten(1, 2).mean(dim=1)  # [H, S]
        pad = self.kernel_size // 2
        if self.pooling == "max":
            return F.max_pool1d(votes[None], self.kernel_size, stride=1, padding=pad)[0]
        return F.avg_pool1d(
            votes[None], self.kernel_size, stride=1, padding=pad, count_include_pad=False
        )[0]


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
