from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs, grouped_attention_probs


@dataclass
class H2OPolicy(EvictionPolicy):
    """H2O (Zhang et al., 2023, "Heavy-Hitter Oracle"): keep the tokens with the
    largest *accumulated* attention, ``score_i = Σ_t A[t, i]``, summed over
    the observation window's queries and averaged over the query heads of a
    KV head.

    Fused attention kernels (vLLM's, FlashAttention) never materialise past
    attention weights, so, as the CriticalKV paper does for its H2O baseline,
    the sum runs over the last ``observation_window`` queries (256 by
    default) rather than every query since the start. Unlike SnapKV there is
    no pooling, and older tokens collect attention from more queries, the
    recency bias the original method has.

    Where the engine passes the window votes (``window_votes``: the mean
    over the window's ``W`` queries and the group, every request and head of
    a layer at once from the window-score kernel) the score is the votes
    themselves: ``W`` times smaller than the sum for every key of a request,
    so the same order, the same AdaKV split over its heads and the same kept
    tokens.
    """

    name = "h2o"
    needs_queries = True
    reads_window_votes = True
    default_prefill_mode = "end_of_prompt"
    default_observation_window = 256

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.window_votes is not None:
            return inputs.window_votes.float()
        return grouped_attention_probs(inputs).mean(dim=1).sum(dim=1)  # [H, S]
