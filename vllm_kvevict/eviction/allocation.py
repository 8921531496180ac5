"""How a layer's retained tokens are split across its KV heads (or a request's
across every layer and KV head, with one global ranking).

A policy scores tokens; an allocation decides how many each head keeps. With
per-head page tables the memory a request holds follows the *sum* of its
heads' lengths, so a head that needs many tokens can take the pages of heads
that need few: quality at a fixed memory.

Counts are whole pages (``page_size`` tokens): a head's tokens fill its pages,
so no page is shared and none is left partly empty, except when a head has
fewer live tokens than its pages hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.top_k import top_k_mask


@dataclass
class HeadAllocation(ABC):
    name: ClassVar[str]
    # Whether :meth:`request_token_counts` splits several requests' layers at once.
    splits_requests_together: ClassVar[bool] = False

    @abstractmethod
    def token_counts(self, scores: torch.Tensor, total: int, num_layers: int = 1) -> torch.Tensor:
        """Tokens each head would keep, ``[H]`` int64, summing to at most ``total``.

        ``scores [H, S]``: ``+inf`` for tokens that must stay (sinks, recent
        window), ``-inf`` for padding (heads hold different numbers of live
        tokens); a head never gets more than its live tokens. With
        ``num_layers`` > 1 the rows are the streams of that many layers,
        layer-major.
        """

    def floor_tokens(self, total: int, num_heads: int) -> int:
        """Tokens every head keeps at least (when it has them)."""
        return 0

    def request_token_counts(
        self, scores: torch.Tensor, totals: torch.Tensor, host_totals: list[int], num_layers: int = 1
    ) -> torch.Tensor:
        """:meth:`token_counts` of ``R`` requests at once: ``scores [R, H, S]``
        (each request's streams, ``num_layers`` layers of them, layer-major),
        request ``r`` splitting ``totals[r]`` tokens (``[R, 1]`` on the
        device; ``host_totals``, the same on the host) → ``[R, H]``. Only
        where :attr:`splits_requests_together`."""
        raise NotImplementedError(f"{self.name} splits one request at a time")


@dataclass
class UniformAllocation(HeadAllocation):
    """Every head the same share: the classic per-head top-k."""

    name = "uniform"

    splits_requests_together = True

    def token_counts(self, scores: torch.Tensor, total: int, num_layers: int = 1) -> torch.Tensor:
        live = (scores > float("-inf")).sum(-1)
        return live.clamp(max=total // scores.shape[0])

    def request_token_counts(
        self, scores: torch.Tensor, totals: torch.Tensor, host_totals: list[int], num_layers: int = 1
    ) -> torch.Tensor:
        live = (scores > float("-inf")).sum(-1)
        return torch.minimum(live, totals // scores.shape[1])


@dataclass
class AdaKVAllocation(HeadAllocation):
    """AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive
    Budget Allocation"), as in kvpress's ``AdaKVPress``: each head first keeps
    its top ``floor_fraction`` of an equal share (the safeguard), then the
    layer's remaining budget goes to the highest scores across all its heads,
    so heads whose attention is concentrated give their capacity to heads
    whose attention is spread out. Scores must be comparable across heads
    (attention probabilities are).
    """

    name = "adaptive"
    floor_fraction: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor_fraction <= 1.0:
            raise ValueError(
                f"head_budget_floor must be in [0, 1], got {self.floor_fraction}"
            )

    def floor_tokens(self, total: int, num_heads: int) -> int:
        return int(total // num_heads * self.floor_fraction)

    def token_counts(self, scores: torch.Tensor, total: int, num_layers: int = 1) -> torch.Tensor:
        num_heads, num_live = scores.shape
        scores = scores.float()
        safe = self.floor_tokens(total, num_heads)
        if safe > 0:
            forced = top_k_mask(scores, safe)
            scores = scores.masked_fill(forced & (scores > float("-inf")), float("inf"))
        flat = scores.view(1, -1)
        chosen = top_k_mask(flat, total)
        return (chosen & (flat > float("-inf"))).view(num_heads, num_live).sum(-1)

    splits_requests_together = True

    def request_token_counts(
        self, scores: torch.Tensor, totals: torch.Tensor, host_totals: list[int], num_layers: int = 1
    ) -> torch.Tensor:
        """:meth:`token_counts` of each request, as one top-k over each
        request's heads (the floors, then the shared budget)."""
        num_requests, num_heads, num_live = scores.shape
        scores = scores.float()
        safe = [self.floor_tokens(total, num_heads) for total in host_totals]
        if max(safe, default=0) > 0:
            floors = (totals // num_heads).double().mul(self.floor_fraction).long()  # int(total // H * f)
            forced = top_k_mask(
                scores.view(-1, num_live), floors.expand(-1, num_heads).flatten(), at_most=max(safe)
            ).view_as(scores)
            scores = scores.masked_fill(forced & (scores > float("-inf")), float("inf"))
        flat = scores.view(num_requests, -1)
        chosen = top_k_mask(flat, totals.flatten(), at_most=max(host_totals, default=0))
        return (chosen & (flat > float("-inf"))).view(num_requests, num_heads, num_live).sum(-1)


def global_top_b(scores: torch.Tensor, budget: int, floor: int = 0) -> torch.Tensor:
    """Which entries stay: the ``budget`` best over every stream (DBTrimKV's
    global top-B).

    ``scores [S, N]``: one row per (layer, KV head) stream, ``-inf`` where a
    stream has no entry (padding), ``+inf`` for entries that must stay (sinks,
    recent tokens). ``floor``: each stream keeps at least this many of its own
    best (the authors' ``min_tokens_per_head``): the global pass chooses
    ``budget - S * floor`` entries, then each stream keeps its count plus the
    floor, re-chosen by its own scores. Returns a bool mask ``[S, N]`` that
    keeps exactly ``min(budget, live entries)`` entries.
    """
    streams = scores.shape[0]
    if floor * streams > budget:
        raise ValueError(f"floor {floor} x {streams} streams exceeds the budget {budget}")
    return global_top_b_many(scores[None], budget, floor, budget, floor > 0)[0]


def global_top_b_many(
    scores: torch.Tensor, budgets: int | torch.Tensor, floors: int | torch.Tensor, at_most: int, floored: bool,
) -> torch.Tensor:
    """:func:`global_top_b` of ``R`` requests at once: ``scores [R, S, N]``,
    request ``r`` keeping ``budgets[r]`` entries, each of its streams at
    least ``floors[r]`` (ints for every request, or ``[R, 1]`` on the
    device, each floor at most its budget over ``S``); ``at_most``: a bound
    on every budget the host knows; ``floored``: whether any floor is above
    0. Returns ``[R, S, N]`` bool, each request's mask as alone."""
    requests, streams, width = scores.shape
    live = scores > float("-inf")
    flat = scores.reshape(requests, -1)
    # Ties to the earlier entry, as every other selection. Padding ranks last,
    # so a budget above the live entries keeps them all.
    first = budgets - floors * streams
    keep = top_k_mask(flat, first if isinstance(first, int) else first.flatten(), at_most=at_most)
    keep = keep.view(scores.shape)
    if not floored:
        return keep & live
    counts = torch.minimum(keep.sum(-1) + floors, live.sum(-1))  # [R, S]
    keep = top_k_mask(scores.reshape(-1, width), counts.flatten(), at_most=min(at_most, width))
    keep = keep.view(scores.shape) & live
    # The global pass left budget - sum(counts) unused where a stream had fewer
    # live entries than count + floor; hand it out again globally.
    rest = torch.where(keep | ~live, float("-inf"), scores).reshape(requests, -1)
    budget = budgets if isinstance(budgets, int) else budgets.flatten()
    extra = torch.minimum(budget - keep.sum((1, 2)), (rest > float("-inf")).sum(-1)).clamp(min=0)
    return keep | top_k_mask(rest, extra, at_most=at_most).view(scores.shape)


@dataclass
class GlobalAllocation(HeadAllocation):
    """One ranking over every stream it is given (DBTrimKV's global top-B):
    the serving backend and the reference stack every (layer, KV head) of a
    request into ``scores [L * H, S]``, so layers and heads get the capacity
    their scores claim. Scores must sit on one scale across layers (the
    learned policy's). ``floor``: tokens every stream keeps of its own best
    (the authors' ``min_tokens_per_head``)."""

    name = "global"
    floor: int = 0

    def floor_tokens(self, total: int, num_heads: int) -> int:
        return min(self.floor, total // max(num_heads, 1))

    def token_counts(self, scores: torch.Tensor, total: int, num_layers: int = 1) -> torch.Tensor:
        floor = self.floor_tokens(total, scores.shape[0])
        return global_top_b(scores, total, floor).sum(-1)

    splits_requests_together = True

    def request_token_counts(
        self, scores: torch.Tensor, totals: torch.Tensor, host_totals: list[int], num_layers: int = 1
    ) -> torch.Tensor:
        """:meth:`token_counts` of each request: one global top-B over each
        request's streams, its floor from its own total."""
        streams = scores.shape[1]
        floors = torch.clamp(totals // max(streams, 1), max=self.floor)  # floor_tokens on the device
        most = max(host_totals, default=0)
        return global_top_b_many(scores, totals, floors, most, self.floor > 0 and most >= streams).sum(-1)


def pyramid_layer_budgets(mean_tokens: float | torch.Tensor, num_layers: int, beta: float) -> list:
    """PyramidKV's per-layer budgets (Cai et al., 2024, "PyramidKV: Dynamic KV
    Cache Compression based on Pyramidal Information Funneling", §3.2, with
    the authors' and kvpress's arithmetic): an arithmetic sequence falling
    with depth from ``2m - m/β`` at the first layer to ``m/β`` at the last,
    where ``m`` is the mean per-layer budget, so the layers hold ``m`` on
    average: the uniform budget's memory. ``m`` a float64 tensor: the same
    arithmetic on the device, one 0-d tensor per layer."""
    if beta < 1:
        raise ValueError(f"pyramid_beta must be at least 1, got {beta}")
    low = mean_tokens / beta
    high = 2 * mean_tokens - low
    if num_layers == 1:
        return [mean_tokens]
    step = (high - low) / (num_layers - 1)
    return [high - layer * step for layer in range(num_layers)]


@dataclass
class PyramidAllocation(HeadAllocation):
    """PyramidKV: each layer keeps :func:`pyramid_layer_budgets` tokens per
    KV head, more in the first layers and fewer in the last, split equally
    over the layer's heads; the tokens every head must keep (sinks, recent
    window: PyramidKV's observation window) come on top of the pyramid, as
    in the paper. The streams of every layer come together (``num_layers``)
    because layers trade pages: the request holds the uniform budget's
    pages in all."""

    name = "pyramid"
    beta: float  # EvictionConfig.pyramid_beta

    def token_counts(self, scores: torch.Tensor, total: int, num_layers: int = 1) -> torch.Tensor:
        streams = scores.shape[0]
        if streams % num_layers:
            raise ValueError(f"{streams} streams do not split into {num_layers} layers")
        live = (scores > float("-inf")).sum(-1)
        protected = (scores == float("inf")).sum(-1).float()
        # In float64 on the device, as on the host in Python floats.
        free = (total / streams - protected.mean().double()).clamp(min=0.0)
        budgets = torch.stack(pyramid_layer_budgets(free, num_layers, self.beta)).float()
        per_stream = budgets.repeat_interleave(streams // num_layers) + protected
        return torch.minimum(per_stream.floor().long(), live)

    splits_requests_together = True

    def request_token_counts(
        self, scores: torch.Tensor, totals: torch.Tensor, host_totals: list[int], num_layers: int = 1
    ) -> torch.Tensor:
        """:meth:`token_counts` of each request (``scores [R, L * H, S]``),
        each request's pyramid from its own total and protected tokens."""
        streams = scores.shape[1]
        if streams % num_layers:
            raise ValueError(f"{streams} streams do not split into {num_layers} layers")
        live = (scores > float("-inf")).sum(-1)
        protected = (scores == float("inf")).sum(-1).float()
        free = (totals.double() / streams - protected.mean(-1, keepdim=True).double()).clamp(min=0.0)  # [R, 1]
        budgets = torch.cat(pyramid_layer_budgets(free, num_layers, self.beta), dim=-1).float()  # [R, L]
        per_stream = budgets.repeat_interleave(streams // num_layers, dim=-1) + protected
        return torch.minimum(per_stream.floor().long(), live)


def stack_streams(scores: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer scores ``[H, S_l]`` as one ``[L * H, max S_l]`` of streams
    (layer-major), padded with ``-inf``: the input of :class:`GlobalAllocation`."""
    width = max(score.shape[1] for score in scores)
    stacked = torch.full(
        (sum(score.shape[0] for score in scores), width), float("-inf"), device=scores[0].device
    )
    first = 0
    for score in scores:
        stacked[first : first + score.shape[0], : score.shape[1]] = score
        first += score.shape[0]
    return stacked


# The CPU worker rounds on the host (set by its serving glue): there a read
# of the counts costs nothing, and a handful of Python integers take a tenth
# of the time of the tensor ops a device rounds with to avoid reading them.
_host_rounding = False


def round_on_host(enabled: bool) -> None:
    """Round CPU counts (:func:`round_to_pages`) on Python integers, or in
    tensor ops again (``False``); the same pages either way."""
    global _host_rounding
    _host_rounding = enabled


def round_to_pages(
    counts: torch.Tensor,
    live: torch.Tensor,
    min_tokens: torch.Tensor,
    total_pages: int | torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Whole-page token counts per head: at most ``total_pages`` pages in all.

    ``counts``, ``live``, ``min_tokens``: ``[H]``, or ``[R, H]`` for ``R``
    requests rounded apart, each to its ``total_pages[r]`` (``[R, 1]``).

    Each head gets ``counts // page_size`` pages, at least enough for its
    ``min_tokens`` (what it must keep); the pages left go to the heads with
    the largest remainders (largest-remainder rounding). A head keeps
    ``min(pages * page_size, live)`` tokens.

    Tensor ops on the heads' counts, nothing read back (on the CPU worker,
    the same on Python integers: :func:`round_on_host`): where the minimums
    alone need more than ``total_pages`` pages, every head gets its minimum
    and the pages exceed ``total_pages``, which the caller checks
    (:func:`~vllm_kvevict.eviction.select.choose_kept` does, with the
    selection's one host read).
    """
    if _host_rounding and counts.device.type == "cpu" and counts.dim() == 1:
        return _round_to_pages_on_host(counts, live, min_tokens, total_pages, page_size)
    need = (min_tokens + (page_size - 1)) // page_size
    pages = torch.minimum(torch.maximum(counts // page_size, need), (live + (page_size - 1)) // page_size)
    # Enforcing the minimum can overshoot: the pages above the minimums come
    # back one at a time from the head with the most (the first such head on
    # a tie). In closed form: the heads above some level t end at t + 1 and
    # the first of them at t, where t = floor(L), L the level at which the
    # pages above it are the excess (as in a projection onto a simplex).
    # Along the last dimension: ``[..., H]`` rows of heads are rounded apart.
    above = pages - need
    excess = pages.sum(-1, keepdim=True) - total_pages
    ordered = above.sort(dim=-1, descending=True).values
    room = ordered.cumsum(-1) - excess
    heads = (torch.arange(1, above.shape[-1] + 1, device=above.device) * ordered > room).sum(-1, keepdim=True)
    heads = heads.clamp(min=1)
    level = room.gather(-1, heads - 1) // heads  # above every head when nothing is over
    over = above > level
    lowered = torch.where(over, level + 1, above)
    first = over & (over.cumsum(-1) <= excess - (above - lowered).sum(-1, keepdim=True))
    pages = need + (lowered - first.long()).clamp(min=0)  # never below a minimum
    # Largest remainders first, the earlier head on a tie (a stable sort).
    remainder = (counts - pages * page_size).clamp(min=0)
    rank = remainder.sort(dim=-1, descending=True, stable=True).indices.argsort(dim=-1)
    pages = pages + ((rank < total_pages - pages.sum(-1, keepdim=True)) & (remainder > 0)).long()
    return torch.minimum(pages * page_size, live)


def _round_to_pages_on_host(
    counts: torch.Tensor, live: torch.Tensor, min_tokens: torch.Tensor, total_pages: int, page_size: int
) -> torch.Tensor:
    """:func:`round_to_pages` on Python integers, step by step."""
    wanted, available, least = counts.tolist(), live.tolist(), min_tokens.tolist()
    need = [-(-m // page_size) for m in least]
    pages = [
        min(max(c // page_size, n), -(-a // page_size)) for c, n, a in zip(wanted, need, available)
    ]
    # Enforcing the minimum can overshoot: take back from the heads with the
    # most pages above their minimum (the first such head on a tie).
    used = sum(pages)
    while used > total_pages and used > sum(need):
        above = [p - n for p, n in zip(pages, need)]
        pages[above.index(max(above))] -= 1
        used -= 1
    remainder = [c - p * page_size if p * page_size < c else 0 for c, p in zip(wanted, pages)]
    for head in sorted(range(len(pages)), key=lambda h: -remainder[h]):  # stable
        if used >= total_pages or remainder[head] == 0:
            break
        pages[head] += 1
        used += 1
    kept = torch.tensor(pages, dtype=counts.dtype) * page_size
    return torch.minimum(kept, live)


def allocate_request_tokens(
    allocation: HeadAllocation, scores: torch.Tensor, total_pages: torch.Tensor, floors: torch.Tensor,
    host_pages: list[int], page_size: int, num_layers: int = 1,
) -> torch.Tensor:
    """:func:`allocate_head_tokens` of ``R`` requests at once (``scores
    [R, H, S]``, ``H`` the streams of ``num_layers`` layers, layer-major;
    request ``r`` filling ``total_pages[r]`` pages,
    ``[R, 1]`` on the device, ``host_pages`` the same on the host, each head
    keeping at least ``floors[r]`` tokens, the allocation's
    :meth:`~HeadAllocation.floor_tokens`; an allocation that
    :attr:`~HeadAllocation.splits_requests_together`): ``[R, H]``, each row
    what the request alone gets."""
    live = (scores > float("-inf")).sum(-1)
    protected = (scores == float("inf")).sum(-1)
    min_tokens = torch.maximum(protected, torch.minimum(live, floors))
    counts = allocation.request_token_counts(
        scores, total_pages * page_size, [p * page_size for p in host_pages], num_layers
    )
    return round_to_pages(counts, live, min_tokens, total_pages, page_size)


def allocate_head_tokens(
    allocation: HeadAllocation, scores: torch.Tensor, total_pages: int, page_size: int,
    num_layers: int = 1,
) -> torch.Tensor:
    """Tokens each head keeps, ``[H]``: the allocation's split of
    ``total_pages`` whole pages, never below what a head must keep (its
    ``+inf`` tokens) or the allocation's floor (when it has that many)."""
    live = (scores > float("-inf")).sum(-1)
    protected = (scores == float("inf")).sum(-1)
    floor = allocation.floor_tokens(total_pages * page_size, scores.shape[0])
    min_tokens = torch.maximum(protected, torch.clamp(live, max=floor))
    counts = allocation.token_counts(scores, total_pages * page_size, num_layers)
    return round_to_pages(counts, live, min_tokens, total_pages, page_size)
