"""Rotary position embedding algebra for policies that model future queries.

Pure torch on a :class:`RotaryFrequencies`: rotate, undo a rotation, the
closed form of the rotation averaged over a window of future positions
(Expected Attention's R̄, Eq. 6), and a cached vector's rotation undone and
averaged in one turn (what Expected Attention scores with; the others are
the steps it is tested against).
"""

from __future__ import annotations

import torch

from vllm_kvevict.policies.base import RotaryFrequencies


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: RotaryFrequencies) -> torch.Tensor:
    """``R_p x`` for ``x [..., T, D]`` at ``positions [T]`` (float64)."""
    angles = positions.double()[:, None] * rope.inv_freq.double()
    return _turn(x.double(), angles.cos(), angles.sin(), rope.neox) * rope.attention_scaling


def unrotate(x: torch.Tensor, positions: torch.Tensor, rope: RotaryFrequencies) -> torch.Tensor:
    """``R_p⁻¹ x``: the pre-RoPE vector a cached post-RoPE one came from (float64).

    RoPE is a rotation (times the model's attention scaling), so undoing it
    is exact: no need to tap the model before its rotary call.
    """
    angles = -positions.double()[:, None] * rope.inv_freq.double()
    return _turn(x.double(), angles.cos(), angles.sin(), rope.neox) / rope.attention_scaling


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Each pair ``(a, b)`` of ``x``'s last dim to ``(a cos - b sin, b cos + a sin)``,
    ``cos, sin [..., D/2]`` broadcast over ``x``'s leading dims."""
    head_dim = x.shape[-1]
    if neox:
        first, second = slice(0, head_dim // 2), slice(head_dim // 2, head_dim)
    else:
        first, second = slice(0, head_dim, 2), slice(1, head_dim, 2)
    a, b = x[..., first], x[..., second]
    out = torch.empty_like(x)
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def averaged_rotation_pairs(
    rope: RotaryFrequencies, last_position: int, num_future: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``R̄``'s pairs: ``(ρ cos cθ, ρ sin cθ)`` times the attention scaling, ``[D/2]``
    each, where ``c = t + (T+1)/2`` is the window's centre and
    ``ρ = sin(Tθ/2) / (T sin(θ/2))`` the Dirichlet-kernel shrinkage."""
    theta, shrink, centre = _future_window(rope, last_position, num_future)
    return (
        shrink * torch.cos(centre * theta) * rope.attention_scaling,
        shrink * torch.sin(centre * theta) * rope.attention_scaling,
    )


def averaged_from(
    x: torch.Tensor, positions: torch.Tensor, rope: RotaryFrequencies, last_position: int, num_future: int,
    turn: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``R̄ R_p⁻¹ x`` for post-RoPE ``x [..., T, D]`` at ``positions [T]``:
    each vector's pre-RoPE form under the rotation averaged over positions
    ``t+1 .. t+T``, in one turn: per pair ``R̄ = ρ e^{icθ}`` times the
    attention scaling and ``R_p⁻¹ = e^{-ipθ}`` over it, so the product is
    ``ρ e^{i(c-p)θ}``. Equals ``R̄`` applied (:func:`apply_averaged_rotation`)
    to :func:`unrotate`'s output, at one turn's cost instead of two. The
    turn's factors (:func:`averaged_turn`, or ``turn`` when the caller
    holds them) are computed in float64, the turn itself in ``x``'s
    floating dtype (fp32 at least)."""
    cos, sin = averaged_turn(positions, rope, last_position, num_future) if turn is None else turn
    dtype = torch.promote_types(x.dtype, torch.float32)
    return _turn(x.to(dtype), cos.to(dtype), sin.to(dtype), rope.neox)


def averaged_turn(
    positions: torch.Tensor, rope: RotaryFrequencies, last_position: int, num_future: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`averaged_from`'s factors ``ρ cos((c-p)θ)`` and ``ρ sin((c-p)θ)``,
    ``[T, D/2]`` float64 each: the same for every layer that caches the
    same positions."""
    theta, shrink, centre = _future_window(rope, last_position, num_future)
    angles = (centre - positions.double())[:, None] * theta
    return shrink * angles.cos(), shrink * angles.sin()


def _future_window(
    rope: RotaryFrequencies, last_position: int, num_future: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``θ`` (float64), the shrinkage ``ρ = sin(Tθ/2) / (T sin(θ/2))`` (1
    where ``θ`` is 0) and the centre ``c = t + (T+1)/2`` of the window of
    positions ``t+1 .. t+T``."""
    theta = rope.inv_freq.double()
    half_turn = torch.sin(theta / 2)
    shrink = torch.where(
        half_turn.abs() < 1e-12,
        torch.ones_like(theta),
        torch.sin(num_future * theta / 2) / (num_future * half_turn),
    )
    return theta, shrink, last_position + (num_future + 1) / 2


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
    pairs = averaged_rotation_pairs(rope, last_position, num_future)
    identity = torch.eye(2 * pairs[0].numel(), dtype=torch.float64)
    return apply_averaged_rotation(identity, pairs, rope).T  # row j: R̄ e_j


def apply_averaged_rotation(
    x: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor], rope: RotaryFrequencies
) -> torch.Tensor:
    """``R̄ x`` along ``x``'s last dim (float64), ``pairs`` from
    :func:`averaged_rotation_pairs`: :func:`averaged_rotation`'s matrix applied
    pair by pair, in ``O(D)`` per vector rather than ``O(D²)``."""
    return _turn(x.double(), *pairs, rope.neox)
