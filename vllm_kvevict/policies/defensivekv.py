"""DefensiveKV and Layer-DefensiveKV (Feng et al., 2026, "Taming the Fragility
of KV Cache Eviction", ICLR 2026): CriticalKV's importance of a token for the
attention output, aggregated over the observation window by its worst case
instead of its mean."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_kvevict.policies.base import (
    PADDING_POSITION,
    EvictionPolicy,
    ScoringInputs,
    grouped_attention_probs,
)
from vllm_kvevict.policies.criticalkv import projected_value_norms
from vllm_kvevict.top_k import top_k_mask


def stacked_attention_probs(inputs: ScoringInputs) -> torch.Tensor:
    """:func:`~vllm_kvevict.policies.base.grouped_attention_probs` of ``R``
    requests' KV heads stacked as rows (``inputs.windows``): row ``r * H +
    h`` attends with request ``r``'s window, ``[R * H, G, W, S]``; a row
    past a request's window, or a query older than every key of the row,
    has zero weight. Nothing is read back."""
    windows = inputs.windows
    assert windows is not None
    num_rows, num_keys, head_dim = inputs.keys.shape
    requests, num_q_heads, width, _ = windows.queries.shape
    heads = num_rows // requests
    group = num_q_heads // heads
    queries = (windows.queries.float() * inputs.scale).reshape(num_rows, group * width, head_dim)
    logits = torch.bmm(queries, inputs.keys.float().transpose(1, 2)).view(num_rows, group, width, num_keys)
    query_positions, in_window = windows.positions()
    query_positions = query_positions.to(logits.device).repeat_interleave(heads, 0)  # [R * H, W]
    key_positions = inputs.key_positions
    future = key_positions[:, None, None, :] > query_positions[:, None, :, None]
    probs = torch.softmax(logits.masked_fill_(future, float("-inf")), dim=-1)
    blind = key_positions.min(-1).values[:, None] > query_positions
    dead = blind | ~in_window.to(logits.device).repeat_interleave(heads, 0)  # [R * H, W]
    return probs.masked_fill_(dead[:, None, :, None], 0.0)


def defensive_aggregation(importance: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """The paper's two-step aggregation (Alg. 1) of ``importance [H, G, W, S]``
    (each query head ``g`` of KV head ``h`` and each observation query ``w``
    on each key), over the keys ``prefix [H, S]`` (bool) of each head:

        R̃_i = max_{g, w} I_{g,w,i}        worst-case risk
        R̄   = mean_i R̃_i                  prior risk, per KV head
        R_i = max(R̃_i, R̄)                 adaptive prior-risk correction

    Returns ``R [H, S]`` fp32, 0 outside ``prefix``.
    """
    worst = importance.float().amax(dim=(1, 2)).masked_fill(~prefix, 0.0)
    prior = worst.sum(-1, keepdim=True) / prefix.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(prefix, torch.maximum(worst, prior), 0.0)


def value_norm_shares(
    values: torch.Tensor, output_projection: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
    requests: int = 1,
) -> torch.Tensor:
    """``N̂[h, i] = N[h, i] / Σ_h' N[h', i]``, ``[H, S]`` fp32: CriticalKV's
    ``N = mean over the group's query heads of ‖v_i W_O‖₁``
    (:func:`~vllm_kvevict.policies.criticalkv.projected_value_norms`) as a
    share of the sum over the layer's ``H`` KV heads at the same position.
    Where some heads no longer hold the position (evicted earlier), the sum
    is ``H`` times the mean over those that do. Only ``tokens [H, S]`` (bool)
    are computed; the rest are 0. ``requests`` > 1: the rows are that many
    requests' ``H`` heads stacked, each request's positions its own.

    The heads holding a position are found by one stable sort of each
    request's positions (its ``H * S`` entries, equal positions adjacent in
    head order), summed per run of equal positions: fixed sizes, nothing
    read back."""
    num_heads = positions.shape[0] // requests
    norms = projected_value_norms(
        values.unflatten(0, (requests, num_heads)), output_projection, tokens.unflatten(0, (requests, num_heads))
    ).flatten(0, 1)
    # Each request's entries as one row, those not computed after every position.
    keys = torch.where(tokens, positions, PADDING_POSITION).view(requests, -1)
    order = keys.argsort(dim=-1, stable=True)
    ordered = keys.gather(-1, order)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run = starts.cumsum(-1) - 1  # each sorted entry's run of equal positions
    held = tokens.view(requests, -1).gather(-1, order)
    totals = torch.zeros(keys.shape, dtype=norms.dtype, device=norms.device).scatter_add_(
        -1, run, torch.where(held, norms.view(requests, -1).gather(-1, order), 0.0)
    )
    holders = torch.zeros_like(totals).scatter_add_(-1, run, held.to(totals.dtype))
    sums = (totals * (num_heads / holders.clamp(min=1))).gather(-1, run)
    sums = torch.empty_like(sums).scatter_(-1, order, sums).view_as(norms)  # back in the entries' order
    return torch.where(tokens & (sums > 0), norms / sums.clamp(min=torch.finfo(sums.dtype).tiny), 0.0)


@dataclass
class DefensiveKVPolicy(EvictionPolicy):
    """DefensiveKV (Feng et al., 2026, "Taming the Fragility of KV Cache
    Eviction", ICLR 2026, by CriticalKV's authors): averaging a token's
    importance over the observation window assumes the queries to come need
    it as the window did on average, and one query that needs a token the
    mean let go can break the answer. DefensiveKV keeps CriticalKV's
    importance, ``I_{j,i} = A_{j,i} ‖v_i W_O‖``, and aggregates it by its
    worst case: :func:`defensive_aggregation` (Alg. 1).

    Where the paper's text leaves it open or differs, this follows the
    authors' code (``efficient_defensivekv_press.py``), which produced the
    published numbers:

    - ``A`` stays per query head and query, average pooled along the keys
      (``kernel_size``, zero padding counted, each row rescaled to its mass
      before pooling) before the maximum; the window's own keys are not
      scored;
    - the aggregation takes the attention alone and the value factor
      multiplies its result, as a share of the layer's KV heads at the same
      position, ``S_i = R_i · N̂_i`` (:func:`value_norm_shares`), without ε;
    - stage 1 (:meth:`refine_scores`) keeps, per head, the fewest keys by
      unpooled window attention (the mean over queries and group) holding
      ``stage_one_mass − window_bias`` of it, the crossing key excluded, at
      most ``⌊(n − w) b / n − w⌋`` of the ``b`` the head keeps among its
      ``n``. ``window_bias`` is the code's: the attention the window pays
      the ``w`` keys just before it, where the name means the window's own.
      The cap is floored at 0 (budgets below about ``w``), and stage 1
      never takes the places of the sinks and the recent window;
    - the window's keys score the layer's highest ``S``.

    ``w`` is ``observation_window`` (32, the paper's) and ``b`` a head's
    count from the allocation (AdaKV by default), made on ``S`` before stage
    1 as for CriticalKV: the score is computed before the budget is known,
    where the authors' code lifts stage 1 to the layer's maximum before its
    split. The paper compresses once, where every head holds every position;
    later evictions (decoding, ``per_chunk`` prefill) estimate the value
    norms of the heads that dropped a position (:func:`value_norm_shares`).
    fp32 throughout (the authors pool and multiply in bf16, so their ties
    differ).

    The KV heads of ``R`` requests stacked as one layer
    (``scores_stacked_requests``, ``windows``) are scored in one pass, each
    request with its own window's queries, its own positions for the value
    shares and its own stage-1 signal: the same scores as alone up to fp32
    rounding (the window's padded query rows change the order of its sums).
    """

    name = "defensivekv"
    needs_queries = True
    needs_output_projection = True
    scores_ragged_heads = True  # the value shares couple the layer's heads
    scores_stacked_requests = True  # each request's window, positions and stage-1 signal its own
    global_scores = True  # N̂ sums to 1 over a position's KV heads in every layer
    default_prefill_mode = "end_of_prompt"
    default_head_budget = "adaptive"
    kernel_size: int = 5
    stage_one_mass: float = 0.9

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(
                f"{self.name} kernel_size must be a positive odd number, got {self.kernel_size}"
            )
        if not 0.0 <= self.stage_one_mass <= 1.0:
            raise ValueError(f"{self.name} stage_one_mass must be in [0, 1], got {self.stage_one_mass}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        """``S = R · N̂`` on the keys older than the window, the layer's
        maximum ``S`` on the window's keys, 0 on padding, ``[H, S]`` fp32."""
        assert inputs.output_projection is not None, f"{self.name} needs the output projection"
        probs, prefix, window = self._window_attention(inputs)
        if probs.shape[2] == 0:  # no observation query: nothing to rank by
            return torch.zeros(prefix.shape, device=prefix.device)
        risk = defensive_aggregation(self._pooled(probs, prefix), prefix)
        requests = inputs.requests
        shares = value_norm_shares(inputs.values, inputs.output_projection, inputs.key_positions, prefix, requests)
        scores = risk * shares
        # Each request's highest score (0 where it holds no key before its window).
        per_request = scores.unflatten(0, (requests, -1)).flatten(1)
        any_prefix = prefix.unflatten(0, (requests, -1)).flatten(1).any(-1)
        highest = torch.where(any_prefix, per_request.max(-1).values, 0.0)
        highest = highest.repeat_interleave(scores.shape[0] // requests)[:, None]
        return torch.where(window, highest, scores)

    def refine_scores(
        self, inputs: ScoringInputs, scores: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Stage 1 at ``+inf``: each head's mass set within its count (see the
        class docstring); the rest rank by ``S``."""
        if "defensivekv.mass" not in inputs.memo:
            self._window_attention(inputs)
        mass, threshold = inputs.memo["defensivekv.mass"], inputs.memo["defensivekv.threshold"]
        window_length = inputs.memo["defensivekv.window"]  # a scalar, or [H] for stacked requests' rows
        window_length = int(window_length) if window_length.dim() == 0 else window_length
        share = torch.nan_to_num(mass / mass.sum(-1, keepdim=True), nan=0.0)
        order = torch.sort(share, dim=-1, descending=True, stable=True).values
        crossing = order.cumsum(-1) >= threshold
        reached = crossing.int().argmax(-1)  # first crossing; 0 when none crosses
        live = (scores > float("-inf")).sum(-1)
        cap = ((live - window_length) * counts / live.clamp(min=1) - window_length).long()
        fixed = scores == float("inf")
        room = (counts - fixed.sum(-1)).clamp(min=0)
        target = torch.minimum(reached, cap.clamp(min=0))
        most = int(target.max()) if target.numel() else 0  # one read sizes both top-k
        first = top_k_mask(share, target, at_most=most) & (mass > 0)
        first &= ~fixed & (scores > float("-inf"))
        first &= top_k_mask(
            share.masked_fill(~first, float("-inf")), torch.minimum(room, first.sum(-1)), at_most=most
        )
        return scores.masked_fill(first, float("inf"))

    def _window_attention(self, inputs: ScoringInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window attention ``[H, G, W, S]``, the keys older than the
        window and the window's own keys (``[H, S]`` bool each); the stage-1
        signal goes to ``inputs.memo`` for :meth:`refine_scores`."""
        if inputs.windows is not None:
            return self._stacked_window_attention(inputs)
        assert inputs.query_positions is not None
        positions = inputs.key_positions
        probs = grouped_attention_probs(inputs)
        window_length = probs.shape[2]
        first_query = int(inputs.query_positions.min()) if window_length else PADDING_POSITION
        prefix = positions < first_query
        window = (positions >= first_query) & (positions < PADDING_POSITION)
        inputs.memo.update(self._stage_one_signal(probs, positions, prefix, first_query))
        return probs, prefix, window

    def _stacked_window_attention(
        self, inputs: ScoringInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_window_attention` of ``R`` requests' rows stacked: each
        request's rows attend with its own window (``[R * H, G, W, S]``, a
        request's query rows past its window zero), its keys older than its
        window and its window's keys; its stage-1 signal per row (the
        window attention's mean over the group and its own queries, its
        threshold and window length). Nothing is read back."""
        windows = inputs.windows
        assert windows is not None
        probs = stacked_attention_probs(inputs)
        num_rows, group, width, _ = probs.shape
        requests = inputs.requests
        heads = num_rows // requests
        lens = windows.lens.to(probs.device)
        row_lens = lens.repeat_interleave(heads)  # [R * H]: each row's window length
        first_query = (windows.points.to(probs.device) - lens).repeat_interleave(heads)[:, None]  # [R * H, 1]
        positions = inputs.key_positions
        prefix = positions < first_query
        window = (positions >= first_query) & (positions < PADDING_POSITION)
        counted = (lens * group).clamp(min=1).to(torch.float32)  # each request's query rows
        mass = (probs.sum(dim=(1, 2)) / counted.repeat_interleave(heads)[:, None]).masked_fill(~prefix, 0.0)
        before = (positions >= first_query - row_lens[:, None]) & prefix
        before_mass = (probs * before[:, None, None, :]).sum(-1).sum(dim=(1, 2))  # [R * H]
        window_bias = before_mass.view(requests, heads).sum(-1) / (counted * heads)  # [R]
        inputs.memo.update({
            "defensivekv.mass": mass,
            "defensivekv.threshold": (self.stage_one_mass - window_bias).repeat_interleave(heads)[:, None],
            "defensivekv.window": row_lens,
        })
        return probs, prefix, window

    def _stage_one_signal(
        self, probs: torch.Tensor, positions: torch.Tensor, prefix: torch.Tensor, first_query: int
    ) -> dict[str, torch.Tensor]:
        """Stage 1's signal: the unpooled window attention averaged over the
        group and the queries, on the keys older than the window ``[H, S]``;
        the share of it stage 1 must reach (``stage_one_mass − window_bias``);
        and ``w``."""
        window_length = probs.shape[2]
        mass = torch.zeros(positions.shape, device=probs.device)
        window_bias = torch.zeros((), device=probs.device)
        if window_length:
            mass = probs.float().mean(dim=(1, 2)).masked_fill(~prefix, 0.0)
            before = (positions >= first_query - window_length) & prefix
            window_bias = (probs.float() * before[:, None, None, :]).sum(-1).mean()
        return {
            "defensivekv.mass": mass,
            "defensivekv.threshold": self.stage_one_mass - window_bias,
            "defensivekv.window": torch.tensor(window_length),
        }

    def _pooled(self, probs: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """Each (head, group, query) row of ``probs`` over ``prefix``, average
        pooled along the keys (zero padding counted) and rescaled to the
        row's mass before pooling."""
        rows = (probs.float() * prefix[:, None, None, :]).flatten(0, 2)  # [H * G * W, S]
        if self.kernel_size == 1 or rows.numel() == 0:
            return rows.view(probs.shape)
        pad = self.kernel_size // 2
        pooled = F.avg_pool1d(
            rows[:, None, :], self.kernel_size, stride=1, padding=pad, count_include_pad=True
        )[:, 0]
        pooled = pooled * prefix.repeat_interleave(probs.shape[1] * probs.shape[2], dim=0)
        before, after = rows.sum(-1, keepdim=True), pooled.sum(-1, keepdim=True)
        pooled = torch.where(after > 0, pooled * before / after.clamp(min=torch.finfo(after.dtype).tiny), 0.0)
        return pooled.view(probs.shape)


@dataclass
class LayerDefensiveKVPolicy(DefensiveKVPolicy):
    """Layer-DefensiveKV (Feng et al., 2026, "Taming the Fragility of KV Cache
    Eviction", Alg. 2, lines 11-12): DefensiveKV's scores ranked over every
    layer and KV head of the request at once (``head_budget: global``: the
    best ``budget × layers × KV heads``), so layers, not only heads, keep
    what their scores claim.

    The value factor is DefensiveKV's share of the layer's KV heads at each
    position, as in the authors' code for both methods (it sums to 1 at
    every position of every layer, which puts the layers on one scale),
    rather than a per-layer normalisation the text can be read to add. The
    window's keys carry their own layer's highest score into the ranking, as
    in that code; where that code can rank a layer's whole window away, the
    recent window and the sinks stay here (``recent_window``,
    ``sink_tokens``: the paper's protocol never evicts the question or the
    answer). Every layer's cache is held until the last layer has run, as
    in the authors' code.
    """

    name = "layer_defensivekv"
    default_head_budget = "global"
