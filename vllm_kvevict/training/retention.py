"""Training retention gates (learned global eviction, "Make Each Token Count" / DBTrimKV: token retention §2.2, the global capacity loss §4.1, the authors' training recipe):
the frozen model is the teacher; the same model with retention-gated attention
is the student; only the gates learn.

Student attention adds ``(q - i) · log β_i`` to the logit of query ``q`` on key
``i`` (§2.2's retention-gated attention in the authors' FlexAttention form), so ``β^age`` softly evicts.
The loss is the authors' ``fwkl_ntp`` plus the global capacity penalty:

    L = ½ (KL(p_teacher ‖ q_student) + CE(labels, q_student)) + λ · L_cap
    S_t   = Σ_{layers, KV heads} Σ_{i ≤ t} exp((t - i) · log β_i)     (soft cache size)
    c_t   = max(0, (S_t - M·L·H) / max(1, t·L·H - M·L·H))
    L_cap = Σ_t c_t / #{t : c_t > 0}                                  (0 when none)

This module hooks a transformers Llama-family model (SmolLM2, Llama, Qwen2/3:
``model.model.layers[l].self_attn`` fed the layer's normalised hidden state).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from vllm_kvevict.policies.retention_gate import RetentionGates

ATTENTION_NAME = "kvevict_retention"


def retention_bias(log_beta: torch.Tensor, num_queries: int) -> torch.Tensor:
    """``[B, H, Tq, Tk]`` additive logits ``(q - i) · log β_i`` for the last
    ``num_queries`` positions of a ``Tk``-token sequence (0 above the diagonal,
    where the causal mask already removes the key). ``log_beta [B, Tk, H]``."""
    keys = log_beta.shape[1]
    query_pos = torch.arange(keys - num_queries, keys, device=log_beta.device)
    age = (query_pos[:, None] - torch.arange(keys, device=log_beta.device)[None, :]).clamp(min=0)
    return age.to(log_beta.dtype)[None, None] * log_beta.transpose(1, 2)[:, :, None, :]


def soft_cache_sizes(log_betas: torch.Tensor) -> torch.Tensor:
    """``S_t`` for every position: ``log_betas [L, H, T]`` (one sequence) -> ``[T]``."""
    length = log_betas.shape[-1]
    positions = torch.arange(length, device=log_betas.device)
    age = positions[:, None] - positions[None, :]  # [t, i]
    causal = age >= 0
    terms = torch.exp(age.clamp(min=0).to(log_betas.dtype) * log_betas[..., None, :])  # [L, H, t, i]
    return (terms * causal).sum(dim=(0, 1, 3))


def global_capacity_loss(log_betas: torch.Tensor, memory_size: int) -> torch.Tensor:
    """The authors' global capacity penalty (``compute_retention_loss`` with
    ``global_capacity=True``) for one sequence, ``log_betas [L, H, T]``."""
    layers, heads, length = log_betas.shape
    budget = memory_size * layers * heads
    sizes = soft_cache_sizes(log_betas)
    positions = torch.arange(length, device=log_betas.device, dtype=sizes.dtype)
    excess = torch.clamp((sizes - budget) / torch.clamp(positions * layers * heads - budget, min=1.0), min=0.0)
    active = (excess > 0).sum()
    return excess.sum() / active.clamp(min=1)


def distillation_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                       labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(p ‖ q), CE), each averaged over positions whose label is not -100.
    ``labels`` are the next tokens, aligned with the logits."""
    keep = labels != -100
    student = F.log_softmax(student_logits[keep].float(), dim=-1)
    teacher = F.log_softmax(teacher_logits[keep].float(), dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1).mean()
    return kl, F.nll_loss(student, labels[keep])


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      labels: torch.Tensor) -> torch.Tensor:
    """The authors' ``fwkl_ntp``: ½ (KL(p ‖ q) + CE)."""
    kl, ce = distillation_terms(student_logits, teacher_logits, labels)
    return 0.5 * (kl + ce)


def retention_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                        dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention plus the retention bias of this layer's
    gate (``module.kvevict_log_beta``, set by the pre-hook; absent: the teacher)."""
    groups = module.num_key_value_groups
    keys = key.repeat_interleave(groups, dim=1)
    values = value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        logits = logits + attention_mask[:, :, :, : keys.shape[-2]]
    log_beta = getattr(module, "kvevict_log_beta", None)
    if log_beta is not None:
        bias = retention_bias(log_beta, query.shape[-2]).to(logits.dtype)
        logits = logits + bias.repeat_interleave(groups, dim=1)
    weights = F.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


class GatedStudent:
    """Attaches gates to a frozen transformers model: every ``self_attn`` gets
    log β from its input (a forward pre-hook) and attends with the bias."""

    def __init__(self, model: Any, gates: RetentionGates) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        # Our attention is eager attention plus a bias: it takes eager's
        # additive float mask (an unknown name would get sdpa's, often None).
        AttentionInterface.register(ATTENTION_NAME, retention_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
        self.model = model
        self.gates = gates
        self.layers = [layer.self_attn for layer in model.model.layers]
        if len(self.layers) != gates.config.num_layers:
            raise ValueError(f"the model has {len(self.layers)} layers, the gates "
                             f"{gates.config.num_layers}")
        self.enabled = True
        self.log_betas: list[torch.Tensor] = []
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        model.config._attn_implementation = ATTENTION_NAME
        for index, attention in enumerate(self.layers):
            attention.register_forward_pre_hook(self._hook(index), with_kwargs=True)

    def _hook(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.enabled:
                module.kvevict_log_beta = None
                return
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            log_beta = self.gates(index, hidden)  # [B, T, H]
            module.kvevict_log_beta = log_beta
            self.log_betas.append(log_beta)
        return hook

    @contextlib.contextmanager
    def teacher(self) -> Iterator[None]:
        """The model without gates (plain attention)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def loss(self, input_ids: torch.Tensor, memory_size: int,
             capacity_weight: float = 1.0) -> dict[str, torch.Tensor]:
        """The training loss on one batch of token ids ``[B, T]``."""
        labels = input_ids[:, 1:]
        with torch.no_grad(), self.teacher():
            teacher = self.model(input_ids=input_ids).logits[:, :-1]
        self.log_betas = []
        student = self.model(input_ids=input_ids).logits[:, :-1]
        kl, ce = distillation_terms(student, teacher, labels)
        quality = 0.5 * (kl + ce)
        stacked = torch.stack(self.log_betas)  # [L, B, T, H]
        capacity = torch.stack([
            global_capacity_loss(stacked[:, b].permute(0, 2, 1), memory_size)
            for b in range(stacked.shape[1])
        ]).mean()
        return {"loss": quality + capacity_weight * capacity, "kl": kl, "ce": ce, "capacity": capacity}
