"""CriticalKV's value factor for every token of a layer, in one launch.

CriticalKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference
from an Output Perturbation Perspective", footnote 3) and DefensiveKV (Feng et
al., 2026) weigh a token ``j`` of KV head ``h`` by what its value adds to the
attention block's output: ``‖v_j W_O[hq]‖₁`` through the rows of the layer's
output projection that query head ``hq`` owns, averaged over the ``G`` query
heads of the group:

    N[h, j] = (1 / G) Σ_{g < G} Σ_n |(v_j W_O[h G + g])_n|

The product is ``[tokens, G · d_model]`` per KV head, a gigabyte at 16k tokens
of an 8B-shaped layer; the kernel never stores it. Program ``(item, token
tile)`` loads its tile of values once, multiplies it by ``W_O``'s slices one
``[D, BLOCK_N]`` tile at a time and keeps only each row's running ``Σ|·|``.

This file holds the torch reference (:func:`projected_value_norms_reference`,
one einsum, the product materialised) and the Triton kernel
:func:`projected_value_norms`.
"""

from __future__ import annotations

import torch


def _value_norm_inputs(values: torch.Tensor, output_projection: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``values`` as ``[R, H, S, D]`` and the group size ``G``; a one-line
    error for shapes that do not fit."""
    if values.dim() not in (3, 4):
        raise ValueError(f"values must be [H, S, D] or [R, H, S, D], got {tuple(values.shape)}")
    items = values if values.dim() == 4 else values.unsqueeze(0)
    num_kv_heads, head_dim = items.shape[1], items.shape[3]
    if output_projection.dim() != 3 or output_projection.shape[1] != head_dim:
        raise ValueError(
            f"output_projection must be [Hq, D={head_dim}, d_model], got {tuple(output_projection.shape)}"
        )
    if output_projection.shape[0] % max(num_kv_heads, 1):
        raise ValueError(
            f"output_projection's {output_projection.shape[0]} query heads are not a multiple of "
            f"the {num_kv_heads} KV heads"
        )
    return items, output_projection.shape[0] // max(num_kv_heads, 1)


def projected_value_norms_reference(values: torch.Tensor, output_projection: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`projected_value_norms` (same arguments and
    result): the whole ``[R, H, S, G, d_model]`` product in fp32, then its
    L1 norms."""
    items, group = _value_norm_inputs(values, output_projection)
    num_kv_heads, head_dim = items.shape[1], items.shape[3]
    slices = output_projection.float().view(num_kv_heads, group, head_dim, -1)
    norms = torch.einsum("rhsd,hgdn->rhsgn", items.float(), slices).abs().sum(-1).mean(-1)
    return norms if values.dim() == 4 else norms[0]


# --------------------------------------------------------------------------- Triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds without triton use the reference
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

if triton is not None:

    @triton.jit
    def _value_norms_kernel(
        out_ptr,
        v_ptr,
        w_ptr,
        num_tokens,
        d_model,
        stride_vr,
        stride_vh,
        stride_vs,
        stride_vd,
        stride_wq,
        stride_wd,
        stride_wn,
        stride_or,
        stride_oh,
        stride_os,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        """Program (item, token tile): ``BLOCK_T`` tokens of item
        ``r * H + h``, their ``Σ_g Σ_n |v W_O[h G + g]|`` over ``d_model`` by
        tiles of ``BLOCK_N``, divided by ``G``."""
        item = tl.program_id(0)
        tile = tl.program_id(1)
        req = item // NUM_KV_HEADS
        kv_head = item % NUM_KV_HEADS

        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < num_tokens
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        v_ptrs = (
            v_ptr + req.to(tl.int64) * stride_vr + kv_head * stride_vh
            + offs_t.to(tl.int64)[:, None] * stride_vs + offs_d[None, :] * stride_vd
        )
        v = tl.load(v_ptrs, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        else:
            v = v.to(w_ptr.dtype.element_ty)

        offs_n = tl.arange(0, BLOCK_N)
        total = tl.zeros([BLOCK_T], tl.float32)
        for g in range(GROUP):
            w_row = w_ptr + (kv_head * GROUP + g).to(tl.int64) * stride_wq + offs_d[:, None] * stride_wd
            for n0 in range(0, d_model, BLOCK_N):
                n = n0 + offs_n
                w = tl.load(w_row + n[None, :] * stride_wn, mask=d_ok[:, None] & (n < d_model)[None, :], other=0.0)
                if DOT_FP32:
                    projected = tl.dot(v, w.to(tl.float32), input_precision="ieee")
                else:
                    projected = tl.dot(v, w)  # 16-bit operands: exact products, fp32 sums
                total += tl.sum(tl.abs(projected), 1)
        out = out_ptr + req.to(tl.int64) * stride_or + kv_head * stride_oh + offs_t.to(tl.int64) * stride_os
        tl.store(out, total / GROUP, mask=t_ok)

    # Whether the kernel was decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
    _INTERPRETED = not isinstance(_value_norms_kernel, triton.runtime.JITFunction)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def projected_value_norms(values: torch.Tensor, output_projection: torch.Tensor) -> torch.Tensor:
    """``N[..., h, j] = mean over g < G of ‖values[..., h, j] W_O[h G + g]‖₁``,
    one launch; no ``[tokens, G · d_model]`` product is stored.

    Args:
        values: ``[H, S, D]`` or ``[R, H, S, D]`` (R requests' tokens side by
            side, padding included: every token is computed), any strides,
            fp32, bf16 or fp16.
        output_projection: ``[Hq, D, d_model]``, any strides: query head
            ``hq``'s rows of the layer's output projection (``o_proj.weight.T``
            viewed per head), ``Hq = H · G``.

    Returns:
        ``[H, S]`` or ``[R, H, S]`` fp32. Where values and the projection are
        both bf16 (or both fp16) the dots multiply in that type with fp32
        sums (each product of two 16-bit numbers is exact in fp32, as in the
        reference's upcast); otherwise in fp32.
    """
    if triton is None:
        raise RuntimeError("projected_value_norms needs triton; use projected_value_norms_reference")
    items, group = _value_norm_inputs(values, output_projection)
    num_requests, num_kv_heads, num_tokens, head_dim = items.shape
    d_model = output_projection.shape[-1]
    out = torch.empty(num_requests, num_kv_heads, num_tokens, dtype=torch.float32, device=items.device)
    if out.numel() == 0 or d_model == 0:
        return (out.zero_() if values.dim() == 4 else out[0].zero_())

    half = items.dtype in (torch.bfloat16, torch.float16) and output_projection.dtype == items.dtype
    # The interpreter multiplies 16-bit operands at their own precision (a GPU
    # sums in fp32): it gets fp32 copies of the same values.
    dot_fp32 = not half or _INTERPRETED
    block_d = max(16, _next_power_of_2(head_dim))
    if _INTERPRETED:
        block_t, block_n = 64, 128  # the interpreter runs each program as numpy calls: few, large tiles
    elif dot_fp32:
        block_t, block_n = 32, 32  # fp32 dots hold their whole K extent per thread
    else:
        block_t, block_n = 64, 64 if block_d <= 128 else 32
    grid = (num_requests * num_kv_heads, triton.cdiv(num_tokens, block_t))
    _value_norms_kernel[grid](
        out,
        items,
        output_projection,
        num_tokens,
        d_model,
        *items.stride(),
        *output_projection.stride(),
        *out.stride(),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        DOT_FP32=dot_fp32,
        num_warps=4,
    )
    return out if values.dim() == 4 else out[0]
