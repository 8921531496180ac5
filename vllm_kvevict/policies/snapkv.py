from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from vllm_kvevict.policies.base import (
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
    """

    name = "snapkv"
    needs_queries = True
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
        probs = grouped_attention_probs(inputs)  # [H, G, W, S]
        votes = probs.flatten(1, 2).mean(dim=1)  # [H, S]
        pad = self.kernel_size // 2
        if self.pooling == "max":
            return F.max_pool1d(votes[None], self.kernel_size, stride=1, padding=pad)[0]
        return F.avg_pool1d(
            votes[None], self.kernel_size, stride=1, padding=pad, count_include_pad=False
        )[0]
