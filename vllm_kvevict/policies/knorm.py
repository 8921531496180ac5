from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs


@dataclass
class KnormPolicy(EvictionPolicy):
    """Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based
    Strategy for KV Cache Compression"): keys with a *low* L2 norm draw high
    attention, so keep the lowest norms: ``score_i = -‖k_i‖``. Query-free."""

    name = "knorm"
    scores_rows_apart = True

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return -inputs.keys.float().norm(dim=-1)
