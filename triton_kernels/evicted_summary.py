"""The evicted-token summary of one (request, layer, KV head): MomentKV's side buffer.

MomentKV (``momentkv_criticalkv.md`` A2.3-A2.7) keeps, for the tokens a head
has evicted, their count ``n``, key mean ``k̄``, value mean ``v̄`` and the
value x centred-key cross-covariance ``C = Σ (v_i - v̄)(k_i - k̄)ᵀ`` (rows:
value dims, columns: key dims), all in fp32. It is stored centred (Chan's
parallel update, A2.4) so that the correction never computes
``S - s_v s_kᵀ / n``, which cancels catastrophically.

At attention time the summary is one more partial softmax state::

    lse_E = log n + τ q·k̄
    o_E   = v̄ + τ C q / n

merged with the retained tokens' ``(o_R, lse_R)`` like split-KV partials (A2.7).

``C`` is stored at one of three ranks, read off ``cross_cov``'s shape:

- full, ``[N, H, D, D]``: the paper's first-order correction, ``4 (D² + 2D + 1)``
  bytes per (request, layer, KV head);
- diagonal, ``[N, H, D]``: only ``C_dd`` (each value dim against its own key
  dim), ``o_E = v̄ + τ diag(C) ⊙ q / n``; ``4 (3D + 1)`` bytes;
- none, ``[N, H, 0]``: the zeroth-order ablation (A2.9, Table 4),
  ``o_E = v̄``; ``4 (2D + 1)`` bytes (``k̄`` still weighs the evicted set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Covariance = Literal["full", "diagonal", "none"]


def covariance_mode(cross_cov: torch.Tensor, head_dim: int) -> Covariance:
    """Which rank of ``C`` a ``cross_cov`` buffer holds (trailing dims
    ``[D, D]``, ``[D]`` or ``[0]``)."""
    if cross_cov.shape[-1] == 0:
        return "none"
    if cross_cov.shape[-2:] == (head_dim, head_dim) and cross_cov.dim() >= 2:
        return "full"
    if cross_cov.shape[-1] == head_dim:
        return "diagonal"
    raise ValueError(f"cross_cov's trailing shape {tuple(cross_cov.shape)} is not [D, D], [D] or [0]")


def cross_covariance_times(cross_cov: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``C q`` for one head's ``cross_cov`` (``[D, D]``, ``[D]`` or ``[0]``) and
    queries ``[..., D]``."""
    if cross_cov.shape[-1] == 0:
        return torch.zeros_like(query)
    if cross_cov.dim() == 1:
        return query * cross_cov
    return query @ cross_cov.T


@dataclass
class EvictedSummary:
    """Summaries of ``N`` rows (requests) x ``H`` KV heads, fp32."""

    count: torch.Tensor  # [N, H]
    key_mean: torch.Tensor  # [N, H, D]
    value_mean: torch.Tensor  # [N, H, D]
    cross_cov: torch.Tensor  # [N, H, D, D], [N, H, D] or [N, H, 0]  Σ (v - v̄)(k - k̄)ᵀ

    @classmethod
    def zeros(
        cls,
        rows: int,
        heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        covariance: Covariance = "full",
    ) -> EvictedSummary:
        f32 = dict(dtype=torch.float32, device=device)
        cov_shape = {"full": (head_dim, head_dim), "diagonal": (head_dim,), "none": (0,)}
        return cls(
            torch.zeros(rows, heads, **f32),
            torch.zeros(rows, heads, head_dim, **f32),
            torch.zeros(rows, heads, head_dim, **f32),
            torch.zeros(rows, heads, *cov_shape[covariance], **f32),
        )

    @property
    def covariance(self) -> Covariance:
        return covariance_mode(self.cross_cov, self.key_mean.shape[-1])

    def reset(self, row: int) -> None:
        for buffer in (self.count, self.key_mean, self.value_mean, self.cross_cov):
            buffer[row].zero_()

    @property
    def bytes_per_row(self) -> int:
        return sum(
            b[0].numel() * b.element_size()
            for b in (self.count, self.key_mean, self.value_mean, self.cross_cov)
        )


def fold_evicted_reference(
    summary: EvictedSummary, row: int, head: int, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Add the tokens ``keys, values [n, D]`` to the summary of ``(row, head)``.

    Chan's merge of the stored set A with the batch B (A2.4)::

        C = C_A + C_B + (n_A n_B / n)(v̄_B - v̄_A)(k̄_B - k̄_A)ᵀ
    """
    n_b = keys.shape[0]
    if n_b == 0:
        return
    k = keys.float()
    v = values.float()
    k_mean_b = k.mean(0)
    v_mean_b = v.mean(0)
    n_a = float(summary.count[row, head])
    n = n_a + n_b
    k_mean_a = summary.key_mean[row, head].clone()
    v_mean_a = summary.value_mean[row, head].clone()
    mode = summary.covariance
    if mode == "full":
        cov_b = (v - v_mean_b).T @ (k - k_mean_b)
        summary.cross_cov[row, head] += cov_b + (n_a * n_b / n) * torch.outer(
            v_mean_b - v_mean_a, k_mean_b - k_mean_a
        )
    elif mode == "diagonal":  # the same merge, entry (d, d) only
        cov_b = ((v - v_mean_b) * (k - k_mean_b)).sum(0)
        summary.cross_cov[row, head] += cov_b + (n_a * n_b / n) * (
            (v_mean_b - v_mean_a) * (k_mean_b - k_mean_a)
        )
    summary.key_mean[row, head] = (n_a * k_mean_a + n_b * k_mean_b) / n
    summary.value_mean[row, head] = (n_a * v_mean_a + n_b * v_mean_b) / n
    summary.count[row, head] = n


def summary_partial_state(
    query: torch.Tensor,
    count: torch.Tensor,
    key_mean: torch.Tensor,
    value_mean: torch.Tensor,
    cross_cov: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o_E, lse_E)`` of queries ``[..., D]`` against one head's summary
    (``cross_cov`` at any of the three ranks).

    ``lse_E = -inf`` (no contribution) where the head has evicted nothing.
    """
    q = query.float()
    lse = torch.log(count) + scale * (q @ key_mean)
    out = value_mean + scale * cross_covariance_times(cross_cov, q) / count.clamp(min=1.0)
    empty = count <= 0
    return out.masked_fill(empty, 0.0), lse.masked_fill(empty, float("-inf"))


def merge_partial_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial softmax states ``(o, lse)``; lse natural log.

    Either side may be empty (``lse = -inf``); both empty gives ``(0, -inf)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse
