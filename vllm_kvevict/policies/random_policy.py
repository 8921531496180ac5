from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs


@dataclass
class RandomPolicy(EvictionPolicy):
    """Random eviction, the floor any method must beat: each (KV head, token
    position) gets a fixed pseudo-random priority from ``seed``.

    The priority is a hash of the position, not a draw from a generator, so a
    token keeps its priority across evictions and the serving backend and the
    reference decoder keep the same tokens.
    """

    name = "random"
    scores_rows_apart = True  # each row from its positions and its KV head (heads_per_request)
    scores_positions_only = True
    seed: int = 0

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        positions = inputs.key_positions.double()
        heads = torch.arange(positions.shape[0], dtype=torch.float64, device=positions.device)[:, None]
        if inputs.heads_per_request is not None:  # R requests' rows stacked: row r * H + h is head h
            heads = heads % inputs.heads_per_request
        # The classic fract(sin(x) * 43758.5453) hash, in float64.
        x = torch.sin(positions * 12.9898 + heads * 78.233 + self.seed * 37.719) * 43758.5453
        return x - torch.floor(x)
