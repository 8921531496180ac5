from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from vllm_kvevict.moments import EvictedMoments, cross_covariance_times
from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs
from vllm_kvevict.policies.snapkv import SnapKVPolicy


@dataclass
class MomentKVPolicy(EvictionPolicy):
    """MomentKV's moment-informed eviction score (MI; arXiv 2606.01563, Eq. 10,
    Alg. 1 lines 7-13): a token is safe to evict when it draws little
    attention *and* the affine moment model of the evicted set already
    predicts its value::

        r_j     = v_j - v̄ - τ C k_j / n        (C = Σ_E (v - v̄)(k - k̄)ᵀ)
        score_j = α_j ‖r_j‖₂

    where ``n, v̄, C`` are the head's evicted-token statistics before this
    eviction (``r_j = v_j`` while nothing is evicted) and ``α_j`` SnapKV's
    score of token j: the attention the observation window pays to it,
    averaged over the window and the query heads of the group, pooled along
    the sequence (``kernel_size``, ``pooling``; SnapKV's max-pool, kernel 15
    as SnapKV's default here). The paper builds on SnapKV's prefill protocol
    and AdaKV's head budgets (§5.1, this policy's default ``head_budget``) and
    "merges adjacent tokens into chunks of size 4 before scoring"; measured
    on the default model at 4k tokens, narrow pooling (kernel 1, and kernel
    7) loses needles, since a kept number's neighbouring digits are evicted,
    so α is SnapKV's pooled score and AdaKV + SnapKV with the same pooling is
    the base this policy is compared with (the paper's ablation, Table 3, is
    on SnapKV too). The evicted tokens are folded into the statistics and corrected
    for in every attention output (``moment_correction``, Eqs. 9-12), which this
    policy requires. With ``moment_covariance`` diagonal or none, the model
    is the same with ``C`` reduced to its diagonal or dropped. The
    one-token-at-a-time greedy of Alg. 1 is run in ``rounds`` batches (see
    :meth:`refine_scores`).

    Where the engine passes SnapKV's votes (``window_votes``) α is pooled
    from them; every request of a layer can then be scored and refined as
    one layer of ``R * H`` rows (``windows`` given), each request with its
    own moments and its own number of rounds.
    """

    name = "momentkv"
    needs_queries = True
    needs_moments = True
    reads_window_votes = True  # α: SnapKV's pooled votes
    scores_stacked_requests = True  # the residual: each row's tokens and moments; rounds per request
    default_prefill_mode = "end_of_prompt"
    default_head_budget = "adaptive"  # the paper builds on AdaKV (§5.1)
    kernel_size: int = 15
    pooling: Literal["max", "avg"] = "max"
    rounds: int = 8

    def __post_init__(self) -> None:
        self._attention = SnapKVPolicy(self.kernel_size, self.pooling)  # validates both
        if self.rounds < 1:
            raise ValueError(f"momentkv rounds must be at least 1, got {self.rounds}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        assert inputs.evicted is not None, "momentkv needs the evicted-token statistics"
        return self._window_attention(inputs) * moment_residuals(
            inputs.keys, inputs.values, inputs.evicted, inputs.scale
        )

    def _window_attention(self, inputs: ScoringInputs) -> torch.Tensor:
        """α ``[H, S]``, SnapKV's pooled window attention: computed once per
        eviction and shared by :meth:`score` and every round of
        :meth:`refine_scores` (it does not depend on the moments)."""
        key = f"snapkv:{self.kernel_size}:{self.pooling}"
        attention = inputs.memo.get(key)
        if attention is None:
            attention = inputs.memo[key] = self._attention.score(inputs)
        return attention

    def refine_scores(
        self, inputs: ScoringInputs, scores: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Alg. 1 evicts one token at a time, rescoring against the statistics
        that now include it; at an eviction of thousands of tokens that is
        infeasible, and a single pass degenerates to ``α_j ‖v_j - v̄‖`` (with
        nothing evicted yet, ``α_j ‖v_j‖``: the residual never sees the moment
        model). Batched instead: ``rounds`` rounds, each
        evicting the lowest-scoring ``1/rounds`` of what each head must drop,
        folding them into a copy of the statistics, and rescoring the rest.

        A round's batch changes the statistics by about its share of the
        evicted count, so an eviction that adds little to a head's
        statistics needs fewer rounds for the same granularity: it runs
        :meth:`rounds_for` rounds, ``rounds`` at the prompt's end (nothing
        evicted before) and one at a decode-time eviction that adds 32
        tokens to thousands. No round adds more than about ``1/rounds`` of a
        head's evicted count after the eviction, as at the prompt's end.

        Returns scores whose top ``counts[h]`` are the tokens kept: survivors
        keep their last score (``≥ 0``), a token evicted in round ``r`` of
        ``R`` gets ``r - R`` (earlier rounds lower).

        The rows of ``R`` requests stacked (``inputs.windows``) run each
        request's own rounds, as if refined alone; the device is read once
        (each head's evictions and rounds), whatever the requests and rounds.
        """
        assert inputs.evicted is not None
        live = (scores > float("-inf")).sum(-1)
        to_evict = (live - counts).clamp(min=0)  # [H]
        moments = inputs.evicted
        requests = inputs.requests
        per_head = self.rounds_per_request(to_evict, moments.count, requests)  # [H], each its request's
        host_evict, host_rounds = torch.stack([to_evict, per_head]).tolist()  # the one read
        rounds = max(host_rounds, default=1)
        if rounds == 1:
            return scores
        attention = self._window_attention(inputs)
        candidate = torch.isfinite(scores)  # not protected (+inf), not padding (-inf)
        refined = scores.clone()
        remaining = candidate.clone()  # candidates not evicted yet
        done, host_done = torch.zeros_like(to_evict), [0] * len(host_evict)
        for r in range(rounds):
            # ceil, = to_evict at a request's last round and after
            target = torch.minimum((to_evict * (r + 1) + per_head - 1) // per_head, to_evict)
            host_target = [min((n * (r + 1) + k - 1) // k, n) for n, k in zip(host_evict, host_rounds)]
            batch_size = target - done
            largest = max((t - d for t, d in zip(host_target, host_done)), default=0)  # the host's: no read
            if largest <= 0:
                continue
            if r > 0:
                current = attention * moment_residuals(inputs.keys, inputs.values, moments, inputs.scale)
                refined = torch.where(remaining, current, refined)
            ranked = torch.where(remaining, refined, float("inf"))
            # Each head's batch_size[h] lowest remaining candidates (ties to
            # the earlier slot, as a stable sort orders them).
            lowest = torch.sort(ranked, dim=-1, stable=True).indices[:, :largest]  # [H, m]
            in_batch = torch.arange(largest, device=scores.device) < batch_size[:, None]
            in_batch &= remaining.gather(-1, lowest)
            batch = torch.zeros_like(remaining).scatter_(-1, lowest, in_batch)
            refined = torch.where(batch, (r - per_head)[:, None].to(refined.dtype), refined)
            remaining &= ~batch
            done, host_done = target, host_target
            if r + 1 < rounds:  # the last round's statistics are not read
                index = lowest.unsqueeze(-1).expand(-1, -1, inputs.keys.shape[-1])
                moments = moments.folded(
                    inputs.keys.gather(1, index), inputs.values.gather(1, index), in_batch
                )
        # A request of one round keeps by its scores, as refined alone.
        return torch.where((per_head == 1)[:, None], scores, refined)

    def rounds_for(self, to_evict: torch.Tensor, evicted_before: torch.Tensor) -> int:
        """Rounds for an eviction that drops ``to_evict[h]`` tokens of heads
        that have folded ``evicted_before[h]``: ``ceil(rounds * share)`` for
        the largest share ``to_evict / (evicted_before + to_evict)`` of a
        head's statistics the eviction adds, at least 1."""
        needed = self.rounds_per_request(to_evict, evicted_before, 1)
        return int(needed.max()) if needed.numel() else 1

    def rounds_per_request(
        self, to_evict: torch.Tensor, evicted_before: torch.Tensor, requests: int
    ) -> torch.Tensor:
        """:meth:`rounds_for` of each of ``requests`` whose heads are the
        consecutive equal parts of ``to_evict`` and ``evicted_before``, per
        head (``[H]``, each head its request's), on the device."""
        to_evict = to_evict.long()
        after = (evicted_before.round().long() + to_evict).clamp(min=1)
        needed = ((self.rounds * to_evict + after - 1) // after).clamp(min=1)  # ceil, in integers
        if not needed.numel():
            return needed
        return needed.view(requests, -1).amax(-1, keepdim=True).expand(requests, needed.numel() // requests).flatten()


def moment_residuals(
    keys: torch.Tensor, values: torch.Tensor, moments: EvictedMoments, scale: float
) -> torch.Tensor:
    """``‖v_j - v̄ - τ C k_j / n‖`` per token, ``[H, S]`` (``‖v_j‖`` for a head
    that has evicted nothing); ``C`` full, diagonal or absent."""
    keys, values = keys.float(), values.float()
    empty = moments.count <= 0  # [H]: nothing evicted, r_j = v_j
    mean = moments.value_mean.float().masked_fill(empty[:, None], 0.0)
    # τ C / n at C's rank, zero for an empty head
    weight = (scale / moments.count.float().clamp(min=1.0)).masked_fill(empty, 0.0)
    slope = moments.cross_cov.float() * weight.view(-1, *[1] * (moments.cross_cov.dim() - 1))
    residual = values - mean[:, None, :] - cross_covariance_times(slope, keys)
    return torch.linalg.vector_norm(residual, dim=-1)
