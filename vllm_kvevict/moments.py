"""MomentKV's statistics of the tokens a KV head has evicted.

MomentKV (arXiv 2606.01563) keeps, for the tokens a head has evicted, their
count ``n``, key mean ``k̄``, value mean ``v̄`` and the value x centred-key
cross-covariance ``C = Σ (v_i - v̄)(k_i - k̄)ᵀ`` (rows: value dims, columns:
key dims), all in fp32. ``C`` is kept centred and merged with Chan et al.'s
parallel update, so the correction never computes ``S - s_v s_kᵀ / n``, which
cancels catastrophically.

At attention time the statistics are one more partial softmax state
(:meth:`EvictedMoments.partial_state`), merged with the retained tokens' like
split-KV partials (:func:`merge_partial_states`)::

    lse_E = log n + τ q·k̄          (Eq. 11, the Jensen bound of Z_E)
    o_E   = v̄ + τ C q / n          (Eq. 9)

``C`` is stored at one of three ranks (``moment_covariance``):

- full, ``[..., D, D]``: the paper's first-order correction, ``4 (D² + 2D + 1)``
  bytes per (request, layer, KV head);
- diagonal, ``[..., D]``: only ``C_dd`` (each value dim against its own key
  dim), ``o_E = v̄ + τ diag(C) ⊙ q / n``; ``4 (3D + 1)`` bytes;
- none, ``[..., 0]``: the zeroth-order correction, ``o_E = v̄``;
  ``4 (2D + 1)`` bytes (``k̄`` still weighs the evicted set).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Covariance = Literal["full", "diagonal", "none"]


def cross_covariance_times(cross_cov: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``C x`` for ``x [*B, S, D]``: ``cross_cov`` is ``[*B, D, D]`` (full),
    ``[*B, D]`` (diagonal) or ``[*B, 0]`` (none: zero). ``[*B, S, D]``.

    The rank is read from ``cross_cov``'s dims relative to ``x``'s, so a
    diagonal ``[H, D]`` and a full ``[D, D]`` are told apart when ``H == D``.
    """
    if cross_cov.shape[-1] == 0:
        return torch.zeros_like(x)
    if cross_cov.dim() == x.dim() - 1:
        return cross_cov.unsqueeze(-2) * x
    if cross_cov.dim() == x.dim():
        return x @ cross_cov.transpose(-1, -2)
    raise ValueError(f"cross_cov {tuple(cross_cov.shape)} is no rank of C for x {tuple(x.shape)}")


@dataclass
class EvictedMoments:
    """The evicted tokens' statistics of ``[*N, H]`` (row, KV head) pairs, fp32.

    ``count [*N, H]``, ``key_mean`` and ``value_mean [*N, H, D]``, ``cross_cov``
    ``Σ (v - v̄)(k - k̄)ᵀ``: ``[*N, H, D, D]`` (full), ``[*N, H, D]``
    (diagonal) or ``[*N, H, 0]`` (none). Indexing gives views: ``m[r]`` (or
    :meth:`row`) is row ``r``'s heads, ``m[r, h]`` one head, and folding into a
    view updates the buffers it views.
    """

    count: torch.Tensor
    key_mean: torch.Tensor
    value_mean: torch.Tensor
    cross_cov: torch.Tensor

    @classmethod
    def zeros(
        cls,
        rows: int | None,
        heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        covariance: Covariance = "full",
    ) -> EvictedMoments:
        """Nothing evicted: ``rows`` x ``heads`` (``rows=None``: ``[H, ...]``)."""
        f32 = dict(dtype=torch.float32, device=device)
        lead = (heads,) if rows is None else (rows, heads)
        cov_shape = {"full": (head_dim, head_dim), "diagonal": (head_dim,), "none": (0,)}
        return cls(
            torch.zeros(*lead, **f32),
            torch.zeros(*lead, head_dim, **f32),
            torch.zeros(*lead, head_dim, **f32),
            torch.zeros(*lead, *cov_shape[covariance], **f32),
        )

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return self.count, self.key_mean, self.value_mean, self.cross_cov

    @property
    def covariance(self) -> Covariance:
        if self.cross_cov.shape[-1] == 0:
            return "none"
        return "full" if self.cross_cov.dim() == self.key_mean.dim() + 1 else "diagonal"

    @property
    def bytes_per_row(self) -> int:
        return sum(b[0].numel() * b.element_size() for b in self._buffers())

    def __getitem__(self, index: int | slice | tuple) -> EvictedMoments:
        return EvictedMoments(*(b[index] for b in self._buffers()))

    def row(self, row: int) -> EvictedMoments:
        """Row ``row``'s heads, ``[H, ...]`` views."""
        return self[row]

    @classmethod
    def stack(cls, rows: Sequence[EvictedMoments]) -> EvictedMoments:
        """``R`` rows' statistics (``[H, ...]`` each) as one ``[R, H, ...]``
        copy: one stack per buffer, however many rows."""
        return cls(*(torch.stack(buffers) for buffers in zip(*(row._buffers() for row in rows))))

    def unstack_into(self, rows: Sequence[EvictedMoments]) -> None:
        """The inverse of :meth:`stack`: row ``r`` of these ``[R, H, ...]``
        statistics into ``rows[r]`` (views of their buffers), in one
        multi-tensor copy."""
        targets = [target for row in rows for target in row._buffers()]
        torch._foreach_copy_(targets, [b[r] for r in range(len(rows)) for b in self._buffers()])

    def heads(self) -> EvictedMoments:
        """``[R, H, ...]`` statistics as ``[R * H, ...]`` (views): the rows of
        ``R`` requests' KV heads stacked as one layer of heads."""
        return EvictedMoments(*(b.flatten(0, 1) for b in self._buffers()))

    def reset(self, row: int) -> None:
        for buffer in self._buffers():
            buffer[row].zero_()

    def folded(
        self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None
    ) -> EvictedMoments:
        """The statistics with the tokens ``keys, values [*L, S, D]`` where
        ``mask [*L, S]`` (default: all) added, ``[*L]`` being this object's
        leading dims; a new object at the same rank.

        Chan et al.'s parallel update of the stored set A with the batch B::

            n = n_A + n_B
            k̄ = (n_A k̄_A + n_B k̄_B) / n            (v̄ alike)
            C = C_A + C_B + (n_A n_B / n)(v̄_B - v̄_A)(k̄_B - k̄_A)ᵀ

        with ``C_B`` the batch's own centred cross-covariance (its diagonal,
        or nothing, at the lower ranks). A head with no masked token keeps its
        statistics exactly.
        """
        keys, values = keys.float(), values.float()
        if mask is None:
            mask = torch.ones(keys.shape[:-1], dtype=torch.bool, device=keys.device)
        weight = mask.float().unsqueeze(-1)  # [*L, S, 1]
        n_a = self.count.float()
        n_b = mask.sum(-1).float()
        n = n_a + n_b
        safe_b = n_b.clamp(min=1.0).unsqueeze(-1)
        k_mean_a, v_mean_a = self.key_mean.float(), self.value_mean.float()
        k_mean_b = (weight * keys).sum(-2) / safe_b
        v_mean_b = (weight * values).sum(-2) / safe_b
        k_c = (keys - k_mean_b.unsqueeze(-2)) * weight
        v_c = (values - v_mean_b.unsqueeze(-2)) * weight
        shift = (n_a * n_b / n.clamp(min=1.0)).unsqueeze(-1)
        dk, dv = k_mean_b - k_mean_a, v_mean_b - v_mean_a
        cov = self.cross_cov.float()
        covariance = self.covariance
        if covariance == "full":
            cov = cov + v_c.transpose(-1, -2) @ k_c + shift.unsqueeze(-1) * dv.unsqueeze(-1) * dk.unsqueeze(-2)
        elif covariance == "diagonal":
            cov = cov + (v_c * k_c).sum(-2) + shift * dv * dk
        safe = n.clamp(min=1.0).unsqueeze(-1)
        some = (n_b > 0).unsqueeze(-1)
        key_mean = torch.where(some, (n_a.unsqueeze(-1) * k_mean_a + n_b.unsqueeze(-1) * k_mean_b) / safe, k_mean_a)
        value_mean = torch.where(some, (n_a.unsqueeze(-1) * v_mean_a + n_b.unsqueeze(-1) * v_mean_b) / safe, v_mean_a)
        return EvictedMoments(n, key_mean, value_mean, cov)

    def fold_(
        self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None
    ) -> None:
        """:meth:`folded`, written into these buffers (through a view, into
        the buffers it views)."""
        for buffer, new in zip(self._buffers(), self.folded(keys, values, mask)._buffers()):
            buffer.copy_(new)

    def partial_state(self, query: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o_E [*L, *Q, D], lse_E [*L, *Q])`` of queries ``query [*L, *Q, D]``
        against these statistics (leading dims ``[*L]``): ``lse_E = log n +
        τ q·k̄`` (Eq. 11), ``o_E = v̄ + τ C q / n`` (Eq. 9).

        ``lse_E = -inf`` (no contribution) where a head has evicted nothing.
        """
        shape = query.shape
        q = query.float().reshape(*shape[: self.count.dim()], -1, shape[-1])  # [*L, S, D]
        count = self.count.unsqueeze(-1)  # [*L, 1]
        lse = torch.log(count) + scale * (q @ self.key_mean.unsqueeze(-1)).squeeze(-1)
        c_q = cross_covariance_times(self.cross_cov, q)
        out = self.value_mean.unsqueeze(-2) + scale * c_q / count.clamp(min=1.0).unsqueeze(-1)
        empty = count <= 0
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
        return out.reshape(shape), lse.masked_fill(empty, float("-inf")).reshape(shape[:-1])


def merge_partial_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial softmax states ``(o, lse)`` (Eq. 12); lse
    natural log.

    Either side may be empty (``lse = -inf``); both empty gives ``(0, -inf)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse
