from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs, grouped_attention_probs


@dataclass
class MomentKVPolicy(EvictionPolicy):
    """MomentKV's moment-informed eviction score (MI; arXiv 2606.01563, Eq. 10,
    Alg. 1 lines 7-13): a token is safe to evict when it draws little
    attention *and* the affine moment model of the evicted set already
    predicts its value::

        r_j     = v_j - v̄ - τ C k_j / n        (C = Σ_E (v - v̄)(k - k̄)ᵀ)
        score_j = α_j ‖r_j‖₂

    where ``n, v̄, C`` are the head's evicted-token statistics before this
    eviction (``r_j = v_j`` while nothing is evicted) and ``α_j`` the attention
    the observation window pays to token j, averaged over the window and the
    query heads of the group: the SnapKV prefill protocol the paper builds on
    (§5.1). The evicted tokens are folded into the statistics and corrected
    for in every attention output (``moment_correction``, A2.7), which this
    policy requires. One scoring pass per eviction, not the paper's
    one-token-at-a-time greedy (infeasible at prefill, A4(a)).
    """

    name = "momentkv"
    needs_queries = True
    needs_moments = True
    default_prefill_mode = "end_of_prompt"

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        assert inputs.evicted is not None, "momentkv needs the evicted-token statistics"
        attention = grouped_attention_probs(inputs).mean(dim=(1, 2))  # [H, S]
        moments = inputs.evicted
        keys, values = inputs.keys.float(), inputs.values.float()
        count = moments.count.float().clamp(min=1.0)[:, None, None]
        predicted = moments.value_mean[:, None, :] + inputs.scale * torch.einsum(
            "hvk,hsk->hsv", moments.cross_cov, keys
        ) / count
        empty = (moments.count <= 0)[:, None, None]
        residual = values - torch.where(empty, torch.zeros_like(predicted), predicted)
        return attention * residual.norm(dim=-1)
