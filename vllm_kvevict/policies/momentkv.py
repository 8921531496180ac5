from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

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
    the sequence (``kernel_size``, ``pooling``; SnapKV's max-pool of 7). The
    paper builds on SnapKV's prefill protocol (§5.1) and "merges adjacent
    tokens into chunks of size 4 before scoring"; measured on the default
    model at 4k tokens, scoring single tokens (kernel 1) loses most needles
    at half the cache, since a kept number's neighbouring digits are evicted,
    so α is SnapKV's pooled score and the SnapKV selection with the same
    pooling is the base this policy is compared with (the paper's ablation,
    Table 3, is on SnapKV too). The evicted tokens are folded into the statistics and corrected
    for in every attention output (``moment_correction``, A2.7), which this
    policy requires. With ``moment_covariance`` diagonal or none, the model
    is the same with ``C`` reduced to its diagonal or dropped. One scoring
    pass per eviction, not the paper's one-token-at-a-time greedy (infeasible
    at prefill, A4(a)).
    """

    name = "momentkv"
    needs_queries = True
    needs_moments = True
    default_prefill_mode = "end_of_prompt"
    kernel_size: int = 7
    pooling: Literal["max", "avg"] = "max"

    def __post_init__(self) -> None:
        self._attention = SnapKVPolicy(self.kernel_size, self.pooling)  # validates both

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        assert inputs.evicted is not None, "momentkv needs the evicted-token statistics"
        attention = self._attention.score(inputs)  # [H, S], pooled window attention
        moments = inputs.evicted
        keys, values = inputs.keys.float(), inputs.values.float()
        count = moments.count.float().clamp(min=1.0)[:, None, None]
        cov = moments.cross_cov.float()
        if cov.shape[-1] == 0:  # zeroth-order statistics: the model predicts v̄
            cov_k = torch.zeros_like(keys)
        elif cov.dim() == 2:  # diagonal C: diag(C) ⊙ k
            cov_k = cov[:, None, :] * keys
        else:
            cov_k = torch.einsum("hvk,hsk->hsv", cov, keys)
        predicted = moments.value_mean[:, None, :] + inputs.scale * cov_k / count
        empty = (moments.count <= 0)[:, None, None]
        residual = values - torch.where(empty, torch.zeros_like(predicted), predicted)
        return attention * residual.norm(dim=-1)
