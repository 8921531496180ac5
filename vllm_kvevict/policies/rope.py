"""Rotary position embedding algebra for policies that model future queries.

Pure torch on a :class:`RotaryFrequencies`: rotate, undo a rotation, and the
closed form of the rotation averaged over a window of future positions
(Expected Attention's R̄, Eq. 6).
"""

from __future__ import annotations

import torch

from vllm_kvevict.policies.base import RotaryFrequencies


def rotary_pairs(head_dim: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the two coordinates of each frequency pair, ``[D/2]`` each."""
    half = torch.arange(head_dim // 2)
    if neox:
        return half, half + head_dim // 2
    return 2 * half, 2 * half + 1


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: RotaryFrequencies) -> torch.Tensor:
    """``R_p x`` for ``x [..., T, D]`` at ``positions [T]`` (float64)."""
    return _turn(x.double(), positions.double()[:, None] * rope.inv_freq.double(), rope) * (
        rope.attention_scaling
    )


def unrotate(x: torch.Tensor, positions: torch.Tensor, rope: RotaryFrequencies) -> torch.Tensor:
    """``R_p⁻¹ x``: the pre-RoPE vector a cached post-RoPE one came from (float64).

    RoPE is a rotation (times the model's attention scaling), so undoing it
    is exact: no need to tap the model before its rotary call.
    """
    return _turn(x.double(), -positions.double()[:, None] * rope.inv_freq.double(), rope) / (
        rope.attention_scaling
    )


def _turn(x: torch.Tensor, angles: torch.Tensor, rope: RotaryFrequencies) -> torch.Tensor:
    first, second = rotary_pairs(x.shape[-1], rope.neox)
    cos, sin = angles.cos(), angles.sin()  # [T, D/2]
    a, b = x[..., first], x[..., second]
    out = torch.empty_like(x)
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def averaged_rotation(
    rope: RotaryFrequencies, last_position: int, num_future: int
) -> torch.Tensor:
    """``R̄ = (1/T) Σ_{j=1..T} R_{t+j}``, ``[D, D]`` float64, in closed form.

    Per frequency pair the mean of ``e^{i(t+j)θ}`` over ``j = 1..T`` is
    ``ρ e^{icθ}`` with ``c = t + (T+1)/2`` (the window's centre) and the
    Dirichlet-kernel shrinkage ``ρ = sin(Tθ/2) / (T sin(θ/2))``: pairs that
    turn fast over the window average out (ρ ≈ 0), slow ones keep ρ ≈ 1.
    R̄ is not a rotation; it must not be renormalised.
    """
    theta = rope.inv_freq.double()
    half_turn = torch.sin(theta / 2)
    shrink = torch.where(
        half_turn.abs() < 1e-12,
        torch.ones_like(theta),
        torch.sin(num_future * theta / 2) / (num_future * half_turn),
    )
    centre = last_position + (num_future + 1) / 2
    cos = shrink * torch.cos(centre * theta) * rope.attention_scaling
    sin = shrink * torch.sin(centre * theta) * rope.attention_scaling
    head_dim = 2 * theta.numel()
    first, second = rotary_pairs(head_dim, rope.neox)
    matrix = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    matrix[first, first] = cos
    matrix[first, second] = -sin
    matrix[second, first] = sin
    matrix[second, second] = cos
    return matrix
