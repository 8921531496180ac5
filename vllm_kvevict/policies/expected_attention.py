from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import PADDING_POSITION, EvictionPolicy, RotaryFrequencies, ScoringInputs
from vllm_kvevict.policies.rope import averaged_from, averaged_turn


@dataclass
class ExpectedAttentionPolicy(EvictionPolicy):
    """Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache
    Compression by Estimating Attention from Future Queries Distribution"):
    score a token by the attention the *next* ``num_future`` queries are
    expected to pay it, with queries modelled as a Gaussian.

    Per query head, from the pre-RoPE queries of the observation window
    (cached queries are post-RoPE; RoPE is undone exactly) with mean ``μ`` and
    biased covariance ``Σ``, and ``R̄`` the RoPE rotation averaged over
    positions ``t+1 .. t+T`` (Eq. 6, closed form)::

        log ẑ_i = s μ̄ᵀk_i + s² k_iᵀ Σ̄ k_i / 2      μ̄ = R̄μ, Σ̄ = R̄ΣR̄ᵀ   (Eq. 7)
        â_i     = softmax_i(log ẑ_i)                                   (Eq. 8)
        score_i = (mean over the group's query heads of â_i + ε) ‖v_i‖    (Eq. 9)

    ``s`` is the model's softmax scale (1/√d in the paper). As in the
    authors' kvpress code, the first ``num_sink`` tokens are left out of the
    softmax and of the statistics and always kept. The value norm ‖v‖
    replaces ‖W_O v‖ as in all the paper's experiments. Where the engine
    stacks the KV heads of several requests into one layer (``windows``),
    each request's ``μ`` and ``Σ`` come from its own window.
    """

    name = "expected_attention"
    needs_queries = True
    needs_rotary = True
    scores_ragged_heads = True  # the statistics once per layer, the rest over each head's tokens
    scores_stacked_requests = True  # each request's statistics from its own window, in one pass
    default_prefill_mode = "end_of_prompt"
    default_head_budget = "adaptive"  # kvpress's registry wraps it in AdaKV
    default_observation_window = 128  # the paper's buffer of recent hidden states
    epsilon: float = 0.02
    num_future: int = 512
    num_sink: int = 4
    use_covariance: bool = True

    def __post_init__(self) -> None:
        if self.epsilon < 0:
            raise ValueError(f"expected_attention epsilon must be >= 0, got {self.epsilon}")
        if self.num_future < 1:
            raise ValueError(f"expected_attention num_future must be >= 1, got {self.num_future}")
        if self.num_sink < 0:
            raise ValueError(f"expected_attention num_sink must be >= 0, got {self.num_sink}")
        # The averaged turn of each query age (:meth:`_turns_by_age`): the
        # same for every layer and every eviction point of a window length.
        self._turns: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def expected_probs(self, inputs: ScoringInputs) -> torch.Tensor:
        """``â`` of Eq. 8 per query head, ``[Hq, S]`` float64; sinks and padding 0."""
        return self._by_head(inputs, self._probs).flatten(0, 1)

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return self._by_head(inputs, self._scores)

    def _by_head(self, inputs: ScoringInputs, compute: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``compute(keys, values, positions, μ̄, Σ̄, scale)`` over the layer,
        the statistics taken once: every head at once when none is padded or
        when the rows are several requests' (``windows``: one call, the
        padding scored 0), else each head over its own tokens (real tokens
        first, then padding), so no work is spent on padding, which gets 0."""
        mean_bar, cov_bar = self._statistics(inputs)
        keys, values, positions = inputs.keys, inputs.values, inputs.key_positions
        if inputs.windows is not None:
            return compute(keys, values, positions, mean_bar, cov_bar, inputs.scale)
        num_keys = keys.shape[1]
        lengths = (positions < PADDING_POSITION).sum(-1).tolist()
        if min(lengths, default=0) == num_keys:
            return compute(keys, values, positions, mean_bar, cov_bar, inputs.scale)
        parts = [
            compute(
                keys[h : h + 1, :length], values[h : h + 1, :length], positions[h : h + 1, :length],
                mean_bar[h : h + 1], None if cov_bar is None else cov_bar[h : h + 1], inputs.scale,
            )
            for h, length in enumerate(lengths)
        ]
        out = parts[0].new_zeros(len(parts), *parts[0].shape[1:-1], num_keys)
        for h, (part, length) in enumerate(zip(parts, lengths)):
            out[h, ..., :length] = part[0]
        return out

    def _statistics(self, inputs: ScoringInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``μ̄`` ``[H, G, D]`` and ``Σ̄`` as ``[H, D, G * D]`` (query head
        ``h * G + g`` reads KV head ``h``; None without the covariance term),
        fp32: the cache's precision at most. ``H`` rows of ``R`` requests
        (``windows``) take each request's from its own window."""
        assert inputs.rotary is not None, "expected_attention needs the model's RoPE"
        if inputs.windows is not None:
            queries = inputs.windows.queries  # [R, Hq, W, D]
            positions, in_window = inputs.windows.positions()
            counted = in_window & (positions >= self.num_sink)
            last = inputs.windows.points[:, None] - 1
            oldest = queries.shape[2]  # ages 0 .. W - 1 (padding rows' negative ones are not counted)
        else:
            assert inputs.queries is not None and inputs.query_positions is not None
            queries, positions = inputs.queries[None], inputs.query_positions[None]
            last = positions.max(-1, keepdim=True).values
            counted = positions[0] >= self.num_sink
            if not bool(counted.all()):  # the sinks' own queries leave the statistics
                queries, positions = queries[:, :, counted], positions[:, counted]
            counted = None  # every row left counts
            oldest = int(last.max() - positions.min()) + 1 if positions.numel() else 0
        num_requests, num_q_heads, window, head_dim = queries.shape
        # The statistics of R̄q, which are R̄μ and R̄ΣR̄ᵀ (R̄ is linear): each
        # cached query unrotated and averaged over the future in one turn,
        # which depends on the query's age at its window's last query alone.
        ages = (last - positions).clamp(min=0)  # [R, W]
        cos, sin = self._turns_by_age(inputs.rotary, oldest, queries.device)
        turn = cos[ages][:, None], sin[ages][:, None]  # [R, 1, W, D/2] each
        future = averaged_from(queries, -ages, inputs.rotary, 0, self.num_future, turn)  # [R, Hq, W, D]
        if counted is None:
            num_queries: int | torch.Tensor = max(window, 1)
        else:  # R windows: each request's rows past its length, and its sinks' queries, masked
            counted = counted[:, None, :, None]
            future = future * counted
            num_queries = counted.sum(2, keepdim=True).clamp(min=1)  # [R, 1, 1, 1]
        mean_bar = future.sum(dim=2, keepdim=True) / num_queries  # [R, Hq, 1, D]
        num_kv_heads = inputs.keys.shape[0]
        group = num_requests * num_q_heads // num_kv_heads
        if not self.use_covariance:
            return mean_bar.float().reshape(num_kv_heads, group, head_dim), None
        centred = future - mean_bar if counted is None else (future - mean_bar) * counted
        cov_bar = centred.transpose(-1, -2) @ centred / num_queries  # [R, Hq, D, D], biased, as the paper
        cov_bar = cov_bar.float().reshape(num_kv_heads, group, head_dim, head_dim)
        mean_bar = mean_bar.float().reshape(num_kv_heads, group, head_dim)
        return mean_bar, cov_bar.permute(0, 2, 1, 3).reshape(num_kv_heads, head_dim, -1)

    def _turns_by_age(
        self, rotary: RotaryFrequencies, ages: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`averaged_turn`'s factors for a query ``a`` positions before
        its window's last one, ``a < ages`` (``[ages, D/2]`` each): the turn
        depends on nothing else, so they are computed once per window length
        and model, not per layer and point."""
        key = (ages, id(rotary.inv_freq), rotary.neox, rotary.attention_scaling, str(device))
        turns = self._turns.get(key)
        if turns is None:
            if len(self._turns) >= 8:
                self._turns.clear()
            ago = torch.arange(ages, device=rotary.inv_freq.device)
            cos, sin = averaged_turn(-ago, rotary, 0, self.num_future)
            # inv_freq held with them: its id names no other tensor while cached.
            turns = self._turns[key] = (rotary.inv_freq, cos.to(device), sin.to(device))
        return turns[1], turns[2]

    def _probs(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
        mean_bar: torch.Tensor, cov_bar: torch.Tensor | None, scale: float,
    ) -> torch.Tensor:
        """``â`` (Eq. 8), ``[H, G, S]`` float64, from ``log ẑ`` (Eq. 7): one
        matmul per term, ``k Σ̄_g`` for every ``g`` of a head in one product."""
        keys = keys.float()
        num_kv_heads, num_keys, head_dim = keys.shape
        logits = scale * torch.bmm(mean_bar, keys.transpose(1, 2))
        if cov_bar is not None:
            group = mean_bar.shape[1]
            spread = torch.bmm(keys, cov_bar)  # [H, S, G * D]
            quadratic = (spread.view(num_kv_heads, num_keys, group, head_dim) * keys[:, :, None]).sum(-1)
            logits = logits + scale**2 / 2 * quadratic.transpose(1, 2)
        excluded = (positions < self.num_sink) | (positions >= PADDING_POSITION)
        probs = torch.softmax(logits.double().masked_fill(excluded[:, None], float("-inf")), dim=-1)
        return probs.nan_to_num(0.0)  # a head with nothing to score

    def _scores(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
        mean_bar: torch.Tensor, cov_bar: torch.Tensor | None, scale: float,
    ) -> torch.Tensor:
        """Eq. 9, ``[H, S]`` float64; the sinks ``+inf``."""
        grouped = self._probs(keys, values, positions, mean_bar, cov_bar, scale).mean(dim=1)
        scores = (grouped + self.epsilon) * values.float().norm(dim=-1).double()
        return scores.masked_fill(positions < self.num_sink, float("inf"))
