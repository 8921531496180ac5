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
    ``rule.on_fallback``. The serving engine chooses for every request of a
    step at once, with :func:`choose_kept_many`.
    """
    counts, kept = choose_kept_many(rule, [Selection(layers, live, point, total_pages, page_size)])[0]
    return counts, kept[:, : max(int(counts.max()), 0) if counts.numel() else 0]


@dataclass
class Selection:
    """One request's eviction point, as :func:`choose_kept_many` takes it:
    ``layers``, ``live``, ``point``, ``total_pages`` and ``page_size`` as
    :func:`choose_kept` takes them, and optionally ``lengths``: per layer,
    each head's live tokens (``live``'s row sums) as the host knows them."""

    layers: Sequence[ScoringInputs]
    live: Sequence[torch.Tensor | None]
    point: int
    total_pages: int
    page_size: int
    lengths: Sequence[Sequence[int] | None] | None = None

    @property
    def width(self) -> int:
        """The host's bound on any stream's kept tokens: the widest layer's
        tokens, at most every page's."""
        return min(max(inputs.keys.shape[1] for inputs in self.layers), self.total_pages * self.page_size)


def choose_kept_many(
    rule: KeepRule, selections: Sequence[Selection]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`choose_kept` for several requests' eviction points at once.

    Nothing in a selection reads the device, except one read for all of
    them after their scores, allocations and refinements: whether a policy
    scored NaN, and how many pages the heads' counts fill (more than
    ``total_pages`` when the tokens the heads must keep do not fit). A
    selection that falls back (or that raised on the host) is chosen again
    from its tokens' positions, with one more read for those alone.

    Returns each selection's ``counts [L * H]`` and ``kept [L * H, width]``
    (:attr:`Selection.width`, at least ``max(counts)``), ``-1`` padded.
    """
    policy = rule.policy
    refines = policy.refines
    failures: dict[int, BaseException] = {}
    ranked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    # Raised on the host by the allocation or the refinement: what a selection
    # falls back for once its scores are known to be numbers.
    raised: dict[int, tuple[BaseException | None, BaseException | None]] = {}
    flags: list[list[torch.Tensor]] = []  # per scored selection: what it reads back
    for i, selection in enumerate(selections):
        try:
            lengths = selection.lengths or [None] * len(selection.layers)
            raw = [
                score_heads(policy, inputs, mask, heads)
                for inputs, mask, heads in zip(selection.layers, selection.live, lengths)
            ]
        except Exception as exc:  # a policy's failure must not end the engine
            failures[i] = exc
            continue
        checks = [_nan_count(raw)]
        allocation_error = refine_error = None
        try:
            counts, scores = _allocate(rule, selection, raw)
        except Exception as exc:
            allocation_error = exc
        else:
            checks.append(pages_used(counts, selection.page_size))
            if refines:
                try:
                    scores = _refine(rule, selection, scores, counts)
                    checks.append(_nan_count(scores))
                except Exception as exc:
                    refine_error = exc
            if refine_error is None:
                ranked[i] = counts, _streams(scores)
        raised[i] = allocation_error, refine_error
        flags.append(checks)
    # The one host read: per selection, NaN scores, pages used, NaN refined
    # (those it got to), 0 for the others.
    read = iter(torch.stack([check for checks in flags for check in checks]).tolist() if flags else [])
    for i, checks in zip(raised, flags):
        nan_scored, used, nan_refined = [next(read) for _ in checks] + [0] * (3 - len(checks))
        allocation_error, refine_error = raised[i]
        causes = (  # in the order the selection meets them
            NonFiniteScores("a score is NaN") if nan_scored else None,
            allocation_error,
            _too_many_pages(used, selections[i]) if used > selections[i].total_pages else None,
            refine_error,
            NonFiniteScores("a score is NaN") if nan_refined else None,
        )
        cause = next((cause for cause in causes if cause is not None), None)
        if cause is not None:
            failures[i] = cause
    for i, exc in sorted(failures.items()):
        _report_fallback(rule, NON_FINITE if isinstance(exc, NonFiniteScores) else type(exc).__name__, exc)
        selection = selections[i]
        recency = [inputs.key_positions.float().expand_as(inputs.keys[..., 0]) for inputs in selection.layers]
        counts, scores = _allocate(rule, selection, recency)
        ranked[i] = counts, _streams(scores)
    if failures:  # the fallbacks' pages: one more read, where a policy failed
        fallbacks = sorted(failures)
        used_pages = torch.stack([pages_used(ranked[i][0], selections[i].page_size) for i in fallbacks])
        for i, used in zip(fallbacks, used_pages.tolist()):
            if used > selections[i].total_pages:
                raise _too_many_pages(used, selections[i])
    chosen = []
    for i, selection in enumerate(selections):
        counts, scores = ranked[i]
        chosen.append((counts, select_top(scores, counts, width=selection.width)))
    return chosen


def pages_used(counts: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages the streams' ``counts`` fill, a 0-d tensor."""
    return ((counts + (page_size - 1)) // page_size).sum()


def _too_many_pages(used: int, selection: Selection) -> ValueError:
    return ValueError(
        f"the tokens the heads must keep (sinks, recent window, the allocation's floor) fill "
        f"{used} pages of {selection.page_size}, more than the {selection.total_pages} the eviction keeps"
    )


def _nan_count(scores: list[torch.Tensor]) -> torch.Tensor:
    counts = [score.isnan().sum() for score in scores]
    return counts[0] if len(counts) == 1 else torch.stack(counts).sum()


def _streams(scores: list[torch.Tensor]) -> torch.Tensor:
    return scores[0] if len(scores) == 1 else stack_streams(scores)


def _allocate(
    rule: KeepRule, selection: Selection, raw_scores: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each stream's count and the masked scores, per layer."""
    policy = rule.policy
    scores = [
        policy.mask_scores(raw, inputs, rule.sink_tokens, rule.recent_window, selection.point, mask)
        for raw, inputs, mask in zip(raw_scores, selection.layers, selection.live)
    ]
    counts = allocate_head_tokens(
        rule.allocation, _streams(scores), selection.total_pages, selection.page_size, len(scores)
    )
    return counts, scores


def _refine(
    rule: KeepRule, selection: Selection, scores: list[torch.Tensor], counts: torch.Tensor
) -> list[torch.Tensor]:
    """The policy's second look at each layer's scores, the counts fixed."""
    per_layer = counts.split([score.shape[0] for score in scores])
    return [
        rule.policy.refine_scores(inputs, score, layer_counts)
        for inputs, score, layer_counts in zip(selection.layers, scores, per_layer)
    ]


def score_heads(
    policy: EvictionPolicy, inputs: ScoringInputs, live: torch.Tensor | None,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """The policy's fp32 scores ``[H, S]`` of one layer. Where heads hold
    different numbers of live tokens (``live``: each row's real tokens
    first, then padding; ``lengths``: their numbers, when the host knows
    them, else read back) and the policy attends with the observation
    queries, each head is scored over its own tokens alone (padding scores
    0, and :meth:`~EvictionPolicy.mask_scores` drops it).

    A query-based policy scores each KV head from that head's tokens and
    query heads only, so this is the padded score without the work on
    padding: the window attention of a head padded to the longest head costs
    what the longest costs, and every padded column goes through its causal
    mask (on a layer whose heads hold 2,464, 224 and 192 tokens, SnapKV's
    score took 3.3-6.3 ms padded and 0.7 ms head by head). Policies that score
    token by token read padding at the cost of the padding alone, and those
    with ``scores_ragged_heads``, or given the window votes the cache
    computed (``window_votes``), skip it themselves.
    """
    ragged_alone = policy.scores_ragged_heads or inputs.window_votes is not None
    if policy.needs_queries and not ragged_alone and live is not None:
        if lengths is None:
            lengths = live.sum(-1).tolist()
        if min(lengths, default=0) != max(lengths, default=0):
            scores = torch.zeros(live.shape, dtype=torch.float32, device=live.device)
            for h, length in enumerate(lengths):
                if length:
                    scores[h, :length] = policy.score(inputs.head(h, length))[0].float()
            return scores
    return policy.score(inputs).float()


_reported: set[tuple[str, str]] = set()


def _report_fallback(rule: KeepRule, reason: str, exc: BaseException) -> None:
    key = (rule.policy.name, reason)
    if key not in _reported:
        _reported.add(key)
        logger.warning(
            "kvevict: policy %r could not score an eviction (%s: %s); that (request, layer) "
            "kept its sink and most recent tokens instead, and so will others failing the same "
            "way (counted in kvevict_eviction_fallbacks_total{reason=%r}, logged once)",
            rule.policy.name, type(exc).__name__, exc, reason,
            exc_info=None if isinstance(exc, NonFiniteScores) else exc,
        )
    if rule.on_fallback is not None:
        rule.on_fallback(reason)
