from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs, grouped_attention_probs


@dataclass
class TOVAPolicy(EvictionPolicy):
    """TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the
    tokens the *last* query attends to most, ``score_i = A[-1, i]``, averaged
    over the query heads that share the KV head (KeyDiff's App. F.2
    convention). The last query is the one just before the eviction point.

    Where the engine passes the window votes of that query alone
    (``window_votes``, ``voting_queries = 1``: the window-score kernel's mean
    over the group of the last query's attention, every request and head of
    a layer at once), the score is the votes themselves.
    """

    name = "tova"
    needs_queries = True
    reads_window_votes = True
    voting_queries = 1
    default_prefill_mode = "end_of_prompt"

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.window_votes is not None:
            return inputs.window_votes.float()
        assert inputs.query_positions is not None
        last = int(torch.argmax(inputs.query_positions))
        probs = grouped_attention_probs(inputs)  # [H, G, W, S]
        return probs[:, :, last].mean(dim=1)
