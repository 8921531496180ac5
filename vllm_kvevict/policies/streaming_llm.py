from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs


@dataclass
class StreamingLLMPolicy(EvictionPolicy):
    """StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models
    with Attention Sinks"): keep the attention sinks and the most recent tokens.

    The sinks are protected by the base class (``sink_tokens``); scoring by
    position gives the rest of the budget to the most recent tokens.
    """

    name = "streamingllm"
    scores_rows_apart = True
    scores_positions_only = True

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return inputs.key_positions.float()
