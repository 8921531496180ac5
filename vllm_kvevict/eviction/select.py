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

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vllm_kvevict.eviction.allocation import HeadAllocation, allocate_head_tokens, stack_streams
from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs
from vllm_kvevict.top_k import select_top

logger = logging.getLogger(__name__)


class KeepSettings(Protocol):
    """The settings :meth:`KeepRule.from_config` reads, those of an
    :class:`~vllm_kvevict.config.EvictionConfig` (the config builds on the
    engine, so the engine names what it needs instead of importing it)."""

    @property
    def sink_tokens(self) -> int: ...

    @property
    def recent_window(self) -> int: ...

    def build_policy(self) -> EvictionPolicy: ...

    def build_allocation(self) -> HeadAllocation: ...


@dataclass(frozen=True)
class KeepRule:
    """What the settings say about keeping: the policy that scores, the
    allocation that splits, and the tokens that always stay.

    ``on_fallback(reason)`` hears of every selection that fell back to the
    sinks and the most recent tokens (see :func:`choose_kept`)."""

    policy: EvictionPolicy
    allocation: HeadAllocation
    sink_tokens: int
    recent_window: int
    on_fallback: Callable[[str], None] | None = field(default=None, compare=False)

    @classmethod
    def from_config(cls, config: KeepSettings) -> KeepRule:
        return cls(
            config.build_policy(), config.build_allocation(), config.sink_tokens,
            config.recent_window,
        )


NON_FINITE = "non_finite_scores"


class NonFiniteScores(ArithmeticError):
    """A policy scored a live token NaN."""


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
            hold different numbers of them, each head's real tokens first
            (``None``: all real).
        total_pages: pages of ``page_size`` tokens the kept tokens may fill,
            over every stream (``page_size`` 1 with a uniform allocation:
            every head keeps exactly ``total_pages / H`` tokens).

    Returns:
        ``counts [L * H]`` and ``kept [L * H, max(counts)]``: each stream's
        kept indices into its layer's ``S_l``, ascending, ``-1`` padded.

    A policy whose scoring raises, or scores a live token NaN, does not stop
    the eviction: the streams keep their sinks and most recent tokens instead
    (StreamingLLM's choice, which needs nothing but positions), in the same
    number of pages, so the cache layout and the blocks freed are those the
    scheduler planned. Each cause is logged once and reported to
    ``rule.on_fallback``.
    """
    try:
        scores = [_finite(score_heads(rule.policy, inputs, mask)) for inputs, mask in zip(layers, live)]
        return _select(rule, layers, live, point, total_pages, page_size, scores, refine=True)
    except Exception as exc:  # a policy's failure must not end the engine
        reason = NON_FINITE if isinstance(exc, NonFiniteScores) else type(exc).__name__
        _report_fallback(rule, reason, exc)
    recency = [inputs.key_positions.float().expand_as(inputs.keys[..., 0]) for inputs in layers]
    return _select(rule, layers, live, point, total_pages, page_size, recency, refine=False)


def score_heads(policy: EvictionPolicy, inputs: ScoringInputs, live: torch.Tensor | None) -> torch.Tensor:
    """The policy's fp32 scores ``[H, S]`` of one layer. Where heads hold
    different numbers of live tokens (``live``: each row's real tokens
    first, then padding) and the policy attends with the observation
    queries, each head is scored over its own tokens alone (padding scores
    0, and :meth:`~EvictionPolicy.mask_scores` drops it).

    A query-based policy scores each KV head from that head's tokens and
    query heads only, so this is the padded score without the work on
    padding: the window attention of a head padded to the longest head costs
    what the longest costs, and every padded column goes through its causal
    mask (on a layer whose heads hold 2,464, 224 and 192 tokens, SnapKV's
    score took 3.3-6.3 ms padded and 0.7 ms head by head). Policies that score
    token by token read padding at the cost of the padding alone, and those
    with ``scores_ragged_heads`` skip it themselves.
    """
    if policy.needs_queries and not policy.scores_ragged_heads and live is not None:
        lengths = live.sum(-1).tolist()
        if min(lengths, default=0) != max(lengths, default=0):
            scores = torch.zeros(live.shape, dtype=torch.float32, device=live.device)
            for h, length in enumerate(lengths):
                if length:
                    scores[h, :length] = policy.score(inputs.head(h, length))[0].float()
            return scores
    return policy.score(inputs).float()


def _select(
    rule: KeepRule,
    layers: Sequence[ScoringInputs],
    live: Sequence[torch.Tensor | None],
    point: int,
    total_pages: int,
    page_size: int,
    raw_scores: list[torch.Tensor],
    refine: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    policy = rule.policy
    scores = [
        policy.mask_scores(raw, inputs, rule.sink_tokens, rule.recent_window, point, mask)
        for raw, inputs, mask in zip(raw_scores, layers, live)
    ]
    stacked = scores[0] if len(scores) == 1 else stack_streams(scores)
    counts = allocate_head_tokens(rule.allocation, stacked, total_pages, page_size, len(scores))
    if refine:
        per_layer = counts.split([score.shape[0] for score in scores])
        scores = [
            _finite(policy.refine_scores(inputs, score, layer_counts))
            for inputs, score, layer_counts in zip(layers, scores, per_layer)
        ]
    ranked = scores[0] if len(scores) == 1 else stack_streams(scores)
    return counts, select_top(ranked, counts)


def _finite(scores: torch.Tensor) -> torch.Tensor:
    """``scores``, or :class:`NonFiniteScores` when one is NaN."""
    if bool(scores.isnan().any()):
        raise NonFiniteScores("a score is NaN")
    return scores


_reported: set[tuple[str, str]] = set()


def _report_fallback(rule: KeepRule, reason: str, exc: BaseException) -> None:
    key = (rule.policy.name, reason)
    if key not in _reported:
        _reported.add(key)
        logger.warning(
            "kvevict: policy %r could not score an eviction (%s: %s); that (request, layer) "
            "kept its sink and most recent tokens instead, and so will others failing the same "
            "way (counted in kvevict_eviction_fallbacks_total{reason=%r}, logged once)",
            rule.policy.name, type(exc).__name__, exc, reason, exc_info=not isinstance(exc, NonFiniteScores),
        )
    if rule.on_fallback is not None:
        rule.on_fallback(reason)
