"""The policy interface: tensors in, retained token indices per KV head out.

Policies know nothing of vLLM. The serving backend and the reference decoder
both call :meth:`EvictionPolicy.select` with the same inputs, so a policy is
written once and checked outside vLLM.

Shapes (one request, one layer)::

    keys, values     [H, S, D]   the live tokens of each KV head, in slot order
                                  (post-RoPE keys, as cached)
    key_positions    [H, S]      original token position of each slot
    queries          [Hq, W, D]  the last W queries before the eviction point
                                  (post-RoPE), or None for query-free policies
    query_positions  [W]
    rotary           the model's RoPE frequencies (policies that model future
                     queries: expected_attention), or None
    output_projection [Hq, D, d_model] each query head's slice of the layer's
                     output projection W_O (criticalkv), or None
    evicted          the request's row of the evicted-token statistics
                     (:class:`~vllm_kvevict.moments.EvictedMoments`,
                     count [H]), for policies with needs_moments, or None
    window_votes     [H, S] fp32 the mean attention each key receives from
                     the window queries (SnapKV's votes), when the engine
                     computed them for every request at once
                     (reads_window_votes), or None
    reconstruction   [H, S] fp32 each token's attention while the model
                     repeated the prompt (kvzip), or None
    windows          R requests' observation windows when the rows are
                     R requests' KV heads stacked (StackedWindows, for
                     scores_stacked_requests), or None
    heads_per_request  H where the rows are R requests' KV heads stacked
                     (row r * H + h: request r's KV head h), or None (row
                     h: KV head h)

``H`` KV heads serve ``Hq = H * G`` query heads (GQA); query head ``j`` reads
KV head ``j // G``, as in vLLM and transformers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm_kvevict.moments import EvictedMoments

# Key position of padding when heads hold different numbers of live tokens
# (per-head page tables): after every query, so attention-based scores give it
# nothing, and masked_scores never keeps it.
PADDING_POSITION = 1 << 40


@dataclass(frozen=True)
class RotaryFrequencies:
    """A model's rotary position embedding: pair ``m`` of a head's dimensions
    turns by ``position * inv_freq[m]``, its magnitude scaled by
    ``attention_scaling`` (1 for plain RoPE). ``neox`` pairs dimension ``i``
    with ``i + D/2`` (HF's rotate_half); otherwise ``2i`` with ``2i + 1``."""

    inv_freq: torch.Tensor  # [D / 2], float64
    neox: bool = True
    attention_scaling: float = 1.0


@dataclass
class StackedWindows:
    """The observation windows of ``R`` requests whose KV heads are scored as
    one layer of ``R * H`` rows (request ``r``'s heads the rows ``[r * H,
    (r + 1) * H)``). ``queries [R, Hq, W, D]``: request ``r``'s window is
    its rows ``[0, lens[r])``, the queries at positions ``[points[r] -
    lens[r], points[r])``; its other rows are padding."""

    queries: torch.Tensor  # [R, Hq, W, D]
    lens: torch.Tensor  # [R] int64
    points: torch.Tensor  # [R] int64

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's position and whether it is a query of its window
        (``[R, W]`` each), on the device: nothing read back."""
        row = torch.arange(self.queries.shape[2], device=self.queries.device)[None, :]
        positions = self.points[:, None] - self.lens[:, None] + row
        return positions, row < self.lens[:, None]


@dataclass
class ScoringInputs:
    keys: torch.Tensor
    values: torch.Tensor
    key_positions: torch.Tensor
    queries: torch.Tensor | None
    query_positions: torch.Tensor | None
    scale: float
    evicted: EvictedMoments | None = None  # for policies with needs_moments
    rotary: RotaryFrequencies | None = None  # for policies with needs_rotary
    output_projection: torch.Tensor | None = None  # for needs_output_projection
    log_beta: torch.Tensor | None = None  # [H, S] fp32, for needs_log_beta
    # The eviction point (tokens processed), for needs_log_beta: an int, or
    # [rows, 1] each row's own where the rows are R requests' KV heads stacked.
    step: int | torch.Tensor | None = None
    window_votes: torch.Tensor | None = None  # [H, S] fp32, for reads_window_votes
    reconstruction: torch.Tensor | None = None  # [H, S] fp32, for needs_reconstruction
    windows: StackedWindows | None = None  # R requests' windows, for scores_stacked_requests
    heads_per_request: int | None = None  # H, where the rows are R requests' H KV heads stacked
    memo: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    """Work a policy's :meth:`~EvictionPolicy.score` shares with its
    :meth:`~EvictionPolicy.refine_scores` of the same inputs (one eviction)."""

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    def head(self, h: int, length: int) -> ScoringInputs:
        """KV head ``h``'s first ``length`` tokens as the inputs of a
        one-head layer: its query heads, output projection slice and
        evicted-token statistics (views, and a memo of its own)."""
        tokens = slice(0, length)

        def query_group(per_query_head: torch.Tensor | None) -> torch.Tensor | None:
            if per_query_head is None:
                return None
            group = per_query_head.shape[0] // self.num_kv_heads
            return per_query_head[h * group : (h + 1) * group]

        return ScoringInputs(
            self.keys[h : h + 1, tokens],
            self.values[h : h + 1, tokens],
            self.key_positions[h : h + 1, tokens],
            query_group(self.queries),
            self.query_positions,
            self.scale,
            self.evicted[h : h + 1] if self.evicted is not None else None,
            rotary=self.rotary,
            output_projection=query_group(self.output_projection),
            log_beta=self.log_beta[h : h + 1, tokens] if self.log_beta is not None else None,
            step=self.step,
            window_votes=self.window_votes[h : h + 1, tokens] if self.window_votes is not None else None,
            reconstruction=(
                self.reconstruction[h : h + 1, tokens] if self.reconstruction is not None else None
            ),
        )

    @property
    def requests(self) -> int:
        """``R``, the requests whose KV heads the rows stack with their
        windows (``windows``, for ``scores_stacked_requests``), else 1."""
        return self.windows.queries.shape[0] if self.windows is not None else 1


def finite_scores(scores: torch.Tensor) -> torch.Tensor:
    """NaN and ``-inf`` to the smallest finite score (``+inf`` stays): a
    descending sort then ranks a NaN last instead of first."""
    lowest = torch.finfo(scores.dtype).min
    return torch.nan_to_num(scores, nan=lowest, posinf=float("inf"), neginf=lowest)


@dataclass
class EvictionPolicy(ABC):
    """Base class: a policy scores tokens; the base class keeps the best.

    Subclasses implement :meth:`score` (higher = more worth keeping) and set
    :attr:`needs_queries` when the score reads recent queries.
    """

    name: ClassVar[str]
    needs_queries: ClassVar[bool] = False
    needs_moments: ClassVar[bool] = False
    """Scores with the statistics of the evicted tokens (``moment_correction``)."""
    needs_rotary: ClassVar[bool] = False
    """Scores with the model's RoPE frequencies (:class:`RotaryFrequencies`)."""
    needs_output_projection: ClassVar[bool] = False
    """Scores with the layer's output projection, per query head."""
    needs_log_beta: ClassVar[bool] = False
    """Scores with the log retention each token's gate gave it when it was
    written (:mod:`retention_gate`), passed as ``log_beta`` with ``step``."""
    reads_window_votes: ClassVar[bool] = False
    """Scores from the mean causal attention each key receives from the
    observation window (``window_votes``) where the engine passes it: an
    engine whose cache computes those votes for every (request, KV head) of a
    layer at once (the Triton window-score kernel) passes them, and the
    policy then splits no layer by head and reads nothing but the votes and
    ``key_positions`` (no queries, keys or values: the engine may leave them
    unread), unless it also scores from the tokens (:attr:`scores_rows_apart`,
    :attr:`scores_stacked_requests`: MomentKV's residual). Without them it
    computes the same votes from the queries."""
    voting_queries: ClassVar[int | None] = None
    """With :attr:`reads_window_votes`: the votes are those of the window's
    last ``voting_queries`` queries (TOVA's one), or of all of them (None)."""
    needs_reconstruction: ClassVar[bool] = False
    """Scores with the attention each token received while the model repeated
    the prompt (:mod:`kvzip`), passed as ``reconstruction``: computed by an
    extra pass of the model after the prompt, which the reference decoder
    runs and the served path does not."""
    scores_ragged_heads: ClassVar[bool] = False
    """A layer whose heads hold different numbers of tokens (each row's real
    tokens first, then ``PADDING_POSITION``) is scored whole: the policy does
    no work on the padding itself, so the engine need not split the layer
    into one call per head (:func:`~vllm_kvevict.eviction.select.score_heads`)."""
    scores_rows_apart: ClassVar[bool] = False
    """Each KV head's row is scored from its own keys, values and
    ``key_positions`` alone (no queries, no statistic shared across the
    heads of a layer; padding, at ``PADDING_POSITION`` with zero keys and
    values, changes no other token's score) and the row's KV head
    (``heads_per_request``), so the rows of several requests can be scored as one
    layer of ``R * H`` heads."""
    scores_positions_only: ClassVar[bool] = False
    """Scores from ``key_positions`` (and ``heads_per_request``; the learned
    policy also ``log_beta`` and ``step``, each row's own) alone, never the
    keys or values: an engine that scores rows apart may pass them with no
    columns (``[rows, S, 0]``) instead of reading them."""
    scores_stacked_requests: ClassVar[bool] = False
    """Scores the KV heads of ``R`` requests stacked as one layer of ``R *
    H`` rows, each request's rows with statistics of its own window
    (``windows``: :class:`StackedWindows`, in place of ``queries``) and
    its own ``evicted`` rows, and the rows' padding changes no other token's
    score; :meth:`refine_scores` of the stacked rows refines each request's
    as if alone. The engine may then score and refine every request of a
    layer in one call."""
    global_scores: ClassVar[bool] = False
    """Scores sit on one scale across layers, so one ranking over every
    (layer, KV head) can split the budget (``head_budget: global``)."""
    default_head_budget: ClassVar[str] = "uniform"
    default_observation_window: ClassVar[int] = 32
    """Recent queries the policy reads when the config sets no
    ``observation_window`` (see :meth:`observation_window_for`)."""
    default_prefill_mode: ClassVar[str] = "per_chunk"
    """Query-based scorers default to ``end_of_prompt`` so that the question at
    the end of the prompt chooses what stays (measured: SnapKV found 0/6
    needles in ~3.8k-token prompts at 50% budget evicting per chunk, 6/6 at the
    end of the prompt; benchmarks/README.md)."""

    @classmethod
    def observation_window_for(cls, options: dict[str, Any]) -> int:
        """The ``observation_window`` of a config that sets none, given its
        ``policy_options`` (a policy built on another one reads that one's)."""
        return cls.default_observation_window

    @abstractmethod
    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        """Importance of each live token, shape ``[H, S]``."""

    def masked_scores(
        self,
        inputs: ScoringInputs,
        num_sink: int,
        num_recent: int,
        point: int,
        live: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`score` with the tokens that must stay at ``+inf``: the first
        ``num_sink`` of the sequence and the ``num_recent`` before ``point``.

        ``live [H, S]`` (bool) marks real tokens when heads hold different
        numbers of them (per-head page tables pad the shorter ones); padding
        scores ``-inf`` and is never kept. A score that is not a number (a NaN
        key or value) ranks below every other token, as does ``-inf`` from the
        policy, so only this method's mark means padding (``+inf`` from the
        policy, e.g. Expected Attention's own sinks, still means "must stay").
        """
        return self.mask_scores(self.score(inputs).float(), inputs, num_sink, num_recent, point, live)

    @staticmethod
    def mask_scores(
        scores: torch.Tensor,
        inputs: ScoringInputs,
        num_sink: int,
        num_recent: int,
        point: int,
        live: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``scores [H, S]`` with the marks of :meth:`masked_scores`."""
        scores = finite_scores(scores)
        positions = inputs.key_positions
        protected = (positions < num_sink) | (positions >= point - num_recent)
        scores = scores.masked_fill(protected, float("inf"))
        if live is not None:
            scores = scores.masked_fill(~live, float("-inf"))
        return scores

    @property
    def refines(self) -> bool:
        """Whether the policy overrides :meth:`refine_scores` (the identity
        here), so a selection must run it once the counts are fixed."""
        return type(self).refine_scores is not EvictionPolicy.refine_scores

    def refine_scores(
        self, inputs: ScoringInputs, scores: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The scores each head's top-``counts[h]`` selection keeps by, once the
        allocation has fixed the counts from :meth:`masked_scores`.

        The identity for single-score policies; a two-stage selection whose
        stages depend on a head's budget (criticalkv) overrides it. ``+inf``
        and ``-inf`` entries of ``scores`` must keep their meaning.
        """
        return scores

    def select(
        self,
        inputs: ScoringInputs,
        num_keep: int,
        num_sink: int,
        num_recent: int,
        point: int,
    ) -> torch.Tensor:
        """Indices (into S) of the tokens each head keeps, sorted, ``[H, num_keep]``.

        The first ``num_sink`` tokens of the sequence and the ``num_recent``
        tokens before the eviction ``point`` are always kept; the rest of the
        budget goes to the highest scores.
        """
        num_heads, num_live = inputs.key_positions.shape
        if num_keep >= num_live:
            return (
                torch.arange(num_live, device=inputs.keys.device)
                .unsqueeze(0)
                .expand(num_heads, num_live)
            )
        scores = self.masked_scores(inputs, num_sink, num_recent, point)
        counts = torch.full((num_heads,), num_keep, dtype=torch.long, device=scores.device)
        scores = self.refine_scores(inputs, scores, counts)
        # A stable sort breaks ties (common after SnapKV's max pooling) by slot
        # order, so every implementation keeps the same tokens; topk's
        # tie-breaking is unspecified.
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        return order[:, :num_keep].sort(dim=-1).values


def grouped_attention_probs(inputs: ScoringInputs) -> torch.Tensor:
    """Causal softmax attention of the observation queries, ``[H, G, W, S]``.

    A query attends to a key only when the key's position is not after the
    query's, exactly as during the forward pass.
    """
    assert inputs.queries is not None and inputs.query_positions is not None
    num_kv_heads, num_keys, head_dim = inputs.keys.shape
    num_q_heads, window, _ = inputs.queries.shape
    group = num_q_heads // num_kv_heads
    queries = (inputs.queries.float() * inputs.scale).reshape(num_kv_heads, group * window, head_dim)
    logits = torch.bmm(queries, inputs.keys.float().transpose(1, 2))
    logits = logits.view(num_kv_heads, group, window, num_keys)
    key_positions, query_positions = inputs.key_positions, inputs.query_positions
    if not window:
        return logits
    # Only keys after the oldest query can be in some query's future (at an
    # eviction point: the window's own tokens, and padding): mask those
    # columns alone rather than the whole [H, G, W, S].
    late = (key_positions > query_positions.min()).any(0).nonzero().squeeze(1)
    if late.numel():
        columns = logits.index_select(-1, late)
        future = key_positions[:, late][:, None, None, :] > query_positions[None, None, :, None]
        logits.index_copy_(-1, late, columns.masked_fill_(future, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    # A query older than every key still cached (possible without sinks)
    # attends to none of them: give it zero weight rather than NaN.
    blind = key_positions.min(-1).values[:, None] > query_positions[None, :]  # [H, W]
    if bool(blind.any()):
        probs.masked_fill_(blind[:, None, :, None], 0.0)
    return probs
