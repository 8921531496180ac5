from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs
from vllm_kvevict.policies.options import build_with_options
from vllm_kvevict.policies.expected_attention import ExpectedAttentionPolicy
from vllm_kvevict.policies.snapkv import SnapKVPolicy
from vllm_kvevict.top_k import top_k_mask

BASES: dict[str, type[EvictionPolicy]] = {
    "snapkv": SnapKVPolicy,
    "expected_attention": ExpectedAttentionPolicy,
}


def projected_value_norms(
    values: torch.Tensor, output_projection: torch.Tensor, tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """``mean over the group's query heads of ‖v_j W_O[hq]‖₁``, ``[H, S]`` fp32
    (``[R, H, S]`` for ``R`` requests' values).

    ``values [H, S, D]`` or ``[R, H, S, D]``; ``output_projection [Hq, D,
    d_model]``: query head ``hq``'s rows of the layer's output projection
    (``o_proj.weight.T``). ``tokens [H, S]`` (``[R, H, S]``) bool: only these
    are computed, the rest are 0 (default: all). On a GPU, Triton's one-launch kernel
    (:func:`vllm_kvevict.triton_kernels.value_norms.projected_value_norms`,
    which never stores the product). Otherwise one KV head at a time, on a
    CPU 128 tokens at a time: the ``[128, G * d_model]`` product stays in the
    CPU's cache (the whole ``[G, S, d_model]`` would not; 3x faster on the
    default model), elsewhere at most ``_PRODUCT_BYTES`` of it at a time.
    """
    if _fused_value_norms(values):
        from vllm_kvevict.triton_kernels.value_norms import projected_value_norms as fused

        norms = fused(values, output_projection)
        return norms if tokens is None else norms.masked_fill_(~tokens, 0.0)
    if values.dim() == 4:  # request by request, each as if alone
        return torch.stack([
            projected_value_norms_torch(values[r], output_projection, None if tokens is None else tokens[r])
            for r in range(values.shape[0])
        ]) if values.shape[0] else values.new_zeros(values.shape[:3], dtype=torch.float32)
    return projected_value_norms_torch(values, output_projection, tokens)


def projected_value_norms_torch(
    values: torch.Tensor, output_projection: torch.Tensor, tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`projected_value_norms` in torch, on any device."""
    num_kv_heads, num_tokens, head_dim = values.shape
    group = output_projection.shape[0] // num_kv_heads
    d_model = output_projection.shape[-1]
    if tokens is None:
        norms = torch.empty(num_kv_heads, num_tokens, dtype=torch.float32, device=values.device)
    else:
        norms = torch.zeros(num_kv_heads, num_tokens, dtype=torch.float32, device=values.device)
    for h in range(num_kv_heads):
        # [D, G * d_model]: the group's W_O slices side by side
        slices = output_projection[h * group : (h + 1) * group].float().permute(1, 0, 2).reshape(head_dim, -1)
        index = None if tokens is None else tokens[h].nonzero().flatten()
        head_values = (values[h] if index is None else values[h, index]).float()
        count = head_values.shape[0]
        head_norms = norms[h] if index is None else torch.empty(count, dtype=torch.float32, device=values.device)
        if values.device.type == "cpu":
            step = _TOKENS_PER_PRODUCT
        else:
            step = max(1, _PRODUCT_BYTES // (4 * group * d_model))
        for start in range(0, count, step):
            projected = head_values[start : start + step] @ slices
            head_norms[start : start + step] = (
                projected.abs_().view(-1, group, d_model).sum(-1).mean(-1)
            )
        if index is not None:
            norms[h, index] = head_norms
    return norms


_TOKENS_PER_PRODUCT = 128
_PRODUCT_BYTES = 1 << 28  # off the CPU, without Triton: a 256 MiB product at most


def _fused_value_norms(values: torch.Tensor) -> bool:
    """Whether :func:`projected_value_norms` runs Triton's kernel: on a GPU
    where Triton imports."""
    if not values.is_cuda:
        return False
    from vllm_kvevict.triton_kernels import value_norms

    return value_norms.triton is not None


@dataclass
class CriticalKVPolicy(EvictionPolicy):
    """CriticalKV (Feng et al., 2025, "Identify Critical KV Cache in LLM
    Inference from an Output Perturbation Perspective", Alg. 1-2): choose the
    tokens that bound the perturbation of the attention block's *output*
    ``A V W_O``, not only its attention weights.

    A drop-in for the top-k of an attention-score method (``base``:
    Expected Attention's expected attention, the default, or SnapKV's pooled
    window attention, the paper's main setting). With ``b`` the tokens a head
    keeps (uniform, or AdaKV's split, which is made on the base scores alone):

    1. stage 1 keeps the top ``⌊first_stage_ratio · b⌋`` by base score, so the
       kept attention mass exceeds one half and the bound's coefficient
       ``2 - 1/ρ`` is positive (Assumption 3.4); sinks and the recent window
       are part of this stage, as in the authors' code;
    2. stage 2 fills the rest by ``(A_j + ε) ‖v_j W_O‖₁`` (footnote 3), the
       norm averaged over the query heads of the group.

    The default base is Expected Attention because on the default model it is
    the composition that does not lose to its own base: on RULER at 4k
    (paired, ``benchmarks/README.md``) CriticalKV on Expected Attention scores
    above Expected Attention at 20% kept and level with it at 50%, while on
    SnapKV it scores below AdaKV + SnapKV at 20% kept with every stage-2
    variant tried (ε 1e-4 or 1e-6, ``first_stage_ratio`` 0.5 or 0.75,
    pooled or per-token stage 2).

    ``stage_two_kernel_size`` > 1 max-pools stage 2's score along the
    sequence among its candidates, as SnapKV pools its votes (1, the default,
    is the paper's per-token product; pooling over 15 did not lift CriticalKV
    on SnapKV above its base).

    Both stages work row by row, so the KV heads of ``R`` requests stacked as
    one layer (``scores_stacked_requests``) are scored by the base as it
    scores them (Expected Attention from each request's window, SnapKV from
    the window-score kernel's votes: ``reads_window_votes`` is the base's)
    and refined as if alone, the value factor of every request in one call.
    """

    name = "criticalkv"
    needs_queries = True
    needs_output_projection = True
    scores_stacked_requests = True  # row by row; each request's base scores from its own window
    default_prefill_mode = "end_of_prompt"
    default_head_budget = "adaptive"  # the paper's main setting: AdaKV + CriticalKV
    base: Literal["snapkv", "expected_attention"] = "expected_attention"
    base_options: dict[str, Any] = field(default_factory=dict)
    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4
    stage_two_kernel_size: int = 1

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise ValueError(
                f"criticalkv base must be one of {', '.join(BASES)}, got {self.base!r}"
            )
        if not 0.0 <= self.first_stage_ratio <= 1.0:
            raise ValueError(
                f"criticalkv first_stage_ratio must be in [0, 1], got {self.first_stage_ratio}"
            )
        if self.stage_two_kernel_size < 1 or self.stage_two_kernel_size % 2 == 0:
            raise ValueError(
                "criticalkv stage_two_kernel_size must be a positive odd number, got "
                f"{self.stage_two_kernel_size}"
            )
        if not isinstance(self.base_options, dict):
            raise ValueError(f"criticalkv base_options must be a mapping, got {self.base_options!r}")
        try:
            self.base_policy = build_with_options(BASES[self.base], self.base, self.base_options)
        except ValueError as exc:
            raise ValueError(f"criticalkv base_options: {exc}") from None

    @classmethod
    def observation_window_for(cls, options: dict[str, Any]) -> int:
        """The base's window: Expected Attention's query statistics read 128."""
        base = options.get("base", cls.__dataclass_fields__["base"].default)
        return BASES[base].default_observation_window if base in BASES else cls.default_observation_window

    @property
    def needs_rotary(self) -> bool:  # type: ignore[override]
        return self.base_policy.needs_rotary

    @property
    def reads_window_votes(self) -> bool:  # type: ignore[override]
        return self.base_policy.reads_window_votes

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return self.base_policy.score(inputs)

    def refine_scores(
        self, inputs: ScoringInputs, scores: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        assert inputs.output_projection is not None, "criticalkv needs the output projection"
        stage_one = (counts.float() * self.first_stage_ratio).floor().long()
        # The policy's one read of the device (top_k_mask would make it).
        first = top_k_mask(scores, stage_one, at_most=int(stage_one.max()) if stage_one.numel() else 0)
        # Only stage 2's candidates are ranked by the norm: not stage 1, not
        # protected (+inf), not padding (-inf).
        candidates = ~first & torch.isfinite(scores)
        # R requests' heads stacked as rows (windows): each row's KV head is its index mod H.
        values = inputs.values.unflatten(0, (inputs.requests, -1))
        norms = projected_value_norms(values, inputs.output_projection, candidates.view(values.shape[:3]))
        norms = norms.flatten(0, 1)
        refined = torch.where(candidates, (scores.float() + self.epsilon) * norms, 0.0)
        if self.stage_two_kernel_size > 1:
            pad = self.stage_two_kernel_size // 2
            refined = F.max_pool1d(refined[None], self.stage_two_kernel_size, stride=1, padding=pad)[0]
        refined = refined.masked_fill(first | (scores == float("inf")), float("inf"))
        return refined.masked_fill(scores == float("-inf"), float("-inf"))
