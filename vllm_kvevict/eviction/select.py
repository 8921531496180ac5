"""Which tokens a request keeps: the one selection every backend and the
reference decoder run.

policy scores (with sinks and the recent window pinned, padding excluded)
→ allocation (how many tokens each stream keeps: uniform, AdaKV, PyramidKV's
layer budgets or one global ranking) → refinement (a policy's second look once the counts are
fixed: CriticalKV's two stages, MomentKV's rounds) → each stream's top
tokens.

A *stream* is one KV head of one layer. ``layers`` holds the scoring inputs
of one or more layers (``[H, S_l, ...]`` each); their streams are ranked
together, layer-major, which is the global allocation's ``[L * H, S]`` and,
for one layer, the layer's own heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_kvevict.policies.allocation import (
    HeadAllocation,
    allocate_head_tokens,
    select_top,
    stack_streams,
)
from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs

if TYPE_CHECKING:
    from vllm_kvevict.config import EvictionConfig


@dataclass(frozen=True)
class KeepRule:
    """What the settings say about keeping: the policy that scores, the
    allocation that splits, and the tokens that always stay."""

    policy: EvictionPolicy
    allocation: HeadAllocation
    sink_tokens: int
    recent_window: int

    @classmethod
    def from_config(cls, config: EvictionConfig) -> KeepRule:
        return cls(
            config.build_policy(), config.build_allocation(), config.sink_tokens,
            config.recent_window,
        )


def choose_kept(
    rule: KeepRule,
    layers: Sequence[ScoringInputs],
    live: Sequence[torch.Tensor | None],
    point: int,
    total_pages: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens each stream keeps at eviction point ``point``.

    Args:
        layers: per layer, the live tokens' scoring inputs.
        live: per layer, ``[H, S_l]`` bool marking real tokens where heads
            hold different numbers of them (``None``: all real).
        total_pages: pages of ``page_size`` tokens the kept tokens may fill,
            over every stream (``page_size`` 1 with a uniform allocation:
            every head keeps exactly ``total_pages / H`` tokens).

    Returns:
        ``counts [L * H]`` and ``kept [L * H, max(counts)]``: each stream's
        kept indices into its layer's ``S_l``, ascending, ``-1`` padded.
    """
    policy = rule.policy
    scores = [
        policy.masked_scores(inputs, rule.sink_tokens, rule.recent_window, point, mask)
        for inputs, mask in zip(layers, live)
    ]
    stacked = scores[0] if len(scores) == 1 else stack_streams(scores)
    counts = allocate_head_tokens(rule.allocation, stacked, total_pages, page_size, len(scores))
    per_layer = counts.split([score.shape[0] for score in scores])
    refined = [
        torch.where(refined.isnan(), torch.finfo(refined.dtype).min, refined)
        for refined in (
            policy.refine_scores(inputs, score, layer_counts)
            for inputs, score, layer_counts in zip(layers, scores, per_layer)
        )
    ]
    ranked = refined[0] if len(refined) == 1 else stack_streams(refined)
    return counts, select_top(ranked, counts)
