"""Learned global eviction: retention gates and one ranking across all layers
and KV heads (DBTrimKV, "Make Each Token Count": §2.2 token retention, §4.1
gates, §4.2 global eviction). The policy side only: the gate and its inference
score; the global selection is
:func:`~vllm_kvevict.eviction.allocation.global_top_b`. Nothing here knows vLLM.

A small gate per layer reads the layer's normalised hidden state (the input of
``k_proj``) when a token's KV is written and predicts, per KV head, a retention
``β ∈ (0, 1)``: the chance that the token is still useful one step later, so
``β^age`` at a later step (the paper's §2.2). It is computed once and kept (as log β)
with the entry. At an eviction, every cached (layer, head, token) gets the
lookahead score of the paper's §4.2 and the ``B`` best across *all* layers and heads stay:
per-layer and per-head lengths are outputs, not inputs.

The gate is the authors' ``rg10`` (the paper's §4.1): per layer
``u = act(W1 x + b1)``, ``u' = act(W2 u + b2)``, then a readout ``W3 u' + b``
with one row per KV head, tied across layers (``tie_readout``) so that scores
of different layers sit on one scale; ``log β = logsigmoid(·)``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs

# log β is clamped below this before log(1 - β^H) - log(1 - β) (the lookahead score, the paper's §4.2):
# at β = 1 both vanish and the ratio is the horizon H.
LOG_BETA_MAX = -1e-9


@dataclass(frozen=True)
class RetentionGateConfig:
    """Shapes of the gates of one model."""

    hidden_size: int
    num_layers: int
    num_kv_heads: int
    width: int = 512  # retention_gate_intermediate_size
    bias_init: float = 18.0  # σ(18) = 1 - 1.5e-8: the untrained student is the teacher
    activation: str = "silu"  # the model's hidden_act
    tie_readout: bool = True  # one W3, b for every layer (one row per KV head)


class RetentionGates(nn.Module):
    """Every layer's gate; ``forward(layer, hidden)`` gives log β per KV head."""

    def __init__(self, config: RetentionGateConfig) -> None:
        super().__init__()
        self.config = config
        d, w, h = config.hidden_size, config.width, config.num_kv_heads
        self.linear1 = nn.ModuleList(nn.Linear(d, w) for _ in range(config.num_layers))
        self.linear2 = nn.ModuleList(nn.Linear(w, w) for _ in range(config.num_layers))
        readouts = 1 if config.tie_readout else config.num_layers
        self.linear3 = nn.ModuleList(nn.Linear(w, h, bias=False) for _ in range(readouts))
        self.bias = nn.ParameterList(nn.Parameter(torch.empty(h)) for _ in range(readouts))
        self.act = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[config.activation]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The authors' initialisation: N(0, 0.02) weights, zero hidden biases,
        readout bias ``bias_init`` (β ≈ 1 everywhere)."""
        for linear in (*self.linear1, *self.linear2, *self.linear3):
            nn.init.normal_(linear.weight, std=0.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for bias in self.bias:
            nn.init.constant_(bias, self.config.bias_init)

    def readout(self, layer: int) -> tuple[nn.Linear, nn.Parameter]:
        index = 0 if self.config.tie_readout else layer
        return self.linear3[index], self.bias[index]

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """log β ``[..., num_kv_heads]`` in fp32 from ``hidden [..., hidden_size]``
        (the layer's input after its input norm, before RoPE)."""
        u = self.act(self.linear1[layer](hidden))
        u = self.act(self.linear2[layer](u))
        linear3, bias = self.readout(layer)
        return F.logsigmoid((linear3(u) + bias).float())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate at both ends (Mächler, 2012)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def lookahead_log_score(log_beta: torch.Tensor, positions: torch.Tensor, step: int | torch.Tensor,
                        horizon: int = 1) -> torch.Tensor:
    """log of the lookahead score ("Make Each Token Count", §4.2): ``s = Σ_{k=1..horizon} β^(step + k - i)`` for a token at position
    ``i`` with retention β, scored at step ``step`` (the position of the token
    being processed):

        log s = (step + 1 - i) log β + log(1 - β^horizon) - log(1 - β)

    ``horizon`` 1 is the myopic ``β^(step + 1 - i)``; larger horizons favour
    long-lived tokens. fp32 or better in, same dtype out.
    """
    if horizon < 1:
        raise ValueError(f"horizon must be at least 1, not {horizon}")
    log_beta = log_beta.clamp(max=LOG_BETA_MAX)
    age = (step + 1 - positions).to(log_beta.dtype)
    score = age * log_beta
    if horizon > 1:
        score = score + log1mexp(horizon * log_beta) - log1mexp(log_beta)
    return score


@dataclass
class LearnedRetentionPolicy(EvictionPolicy):
    """Learned global eviction (DBTrimKV): a token's worth is its gate's
    retention β raised to the age it will have (the lookahead score, §4.2), one scale for every
    layer and KV head, so the budget is split by one global top-B
    (``head_budget: global``, :class:`~vllm_kvevict.eviction.allocation.GlobalAllocation`).

    Options:
        gates: a folder of gate weights, from ``kvevict train-gates`` (config.json
            + gates.pt) or the authors' (config.json + trimkv_weights.pth);
            None: the gates shipped for the model being served.
        horizon: lookahead steps of the score (§4.2; the authors: 1 in their cache class,
            2 in their lmms-eval runs).
        min_tokens_per_head: each (layer, KV head) keeps at least this many of
            its own best tokens (the authors' ``min_tokens_per_head``, 0).
    """

    name: ClassVar[str] = "learned"
    needs_log_beta: ClassVar[bool] = True
    scores_rows_apart: ClassVar[bool] = True  # each row from its own log β, positions and step
    scores_positions_only: ClassVar[bool] = True  # no key or value read
    global_scores: ClassVar[bool] = True
    default_head_budget: ClassVar[str] = "global"

    gates: str | None = None
    horizon: int = 1
    min_tokens_per_head: int = 0

    def __post_init__(self) -> None:
        if self.horizon < 1:
            raise ValueError(f"learned: horizon must be at least 1, not {self.horizon}")
        if self.min_tokens_per_head < 0:
            raise ValueError(
                f"learned: min_tokens_per_head must be >= 0, not {self.min_tokens_per_head}"
            )
        if self.gates is not None and not os.path.isdir(self.gates):
            raise ValueError(
                f"learned: gates {self.gates!r} is not a folder; pass the folder written by "
                "kvevict train-gates (config.json + gates.pt) or an authors' checkpoint "
                "(config.json + trimkv_weights.pth), or leave gates unset for the shipped ones"
            )

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.log_beta is None or inputs.step is None:
            raise ValueError("the learned policy scores with log_beta and step; none were given")
        return lookahead_log_score(
            inputs.log_beta.float(), inputs.key_positions, inputs.step, self.horizon
        )
