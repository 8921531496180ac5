from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import PADDING_POSITION, EvictionPolicy, ScoringInputs


@dataclass
class KeyDiffPolicy(EvictionPolicy):
    """KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache
    Eviction for Long-Context LLM Inference in Resource-Constrained
    Environments"): keep the keys least similar to the others.

    Eq. 8, the anchor form: ``score_i = -cos(k_i, mean_j k̂_j)`` over each KV
    head's live (post-RoPE, as cached) keys, with the anchor the mean of the
    *normalised* keys, which ranks exactly as the pairwise Eq. 7
    ``-Σ_j cos(k_i, k_j)`` (``Σ_j k̂_i·k̂_j = n ‖μ‖ cos(k_i, μ)``), as kvpress's
    ``KeyDiffPress`` does. ``anchor="raw"`` uses the mean of the raw keys, the
    paper's other reading (its text says the raw mean works equally). Query-free, so it evicts after
    every prefill chunk, the paper's block-wise setting.
    """

    name = "keydiff"
    scores_rows_apart = True
    anchor: str = "normalized"

    def __post_init__(self) -> None:
        if self.anchor not in ("normalized", "raw"):
            raise ValueError(f"keydiff anchor must be 'normalized' or 'raw', got {self.anchor!r}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        keys = inputs.keys.float()  # [H, S, D]
        live = inputs.key_positions < PADDING_POSITION  # padding never joins the anchor
        weights = live.unsqueeze(-1).float()
        source = torch.nn.functional.normalize(keys, dim=-1) if self.anchor == "normalized" else keys
        anchor = (source * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True).clamp(min=1)
        return -torch.nn.functional.cosine_similarity(keys, anchor, dim=-1, eps=1e-8)

