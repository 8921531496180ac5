"""Attention over per-(request, KV-head) page tables, with the evicted-token
moments folded into the same softmax.

The storage model and the batch are :class:`~vllm_kvevict.triton_kernels.batch.HeadPagedBatch`'s.
This file holds the torch reference (the semantics every kernel is tested
against; its attention is :func:`~vllm_kvevict.triton_kernels.head_paged_torch.attend_head_tokens`,
which the CPU torch path runs too) and the Triton kernel
:func:`head_paged_attention` with the same semantics.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_kvevict.triton_kernels.batch import HeadPagedBatch
from vllm_kvevict.triton_kernels.head_paged_torch import attend_head_tokens


def head_tokens_reference(
    cache: torch.Tensor,
    head: int,
    pages: torch.Tensor,
    length: int,
    block_ids: torch.Tensor,
    region_start: int,
    region_end: int,
) -> torch.Tensor:
    """Head ``head``'s tokens of one request, ``[length + region_end - region_start, D]``:
    its compacted tokens, then its standard-region slots.

    ``cache`` is logical, ``[num_blocks, H, page_size, D]``.
    """
    num_heads, page_size, head_dim = cache.shape[1:]
    flat = cache.reshape(-1, page_size, head_dim)
    num_pages = -(-length // page_size)
    compacted = flat[pages[:num_pages].long()].reshape(-1, head_dim)[:length]
    slots = torch.arange(region_start, region_end, device=cache.device)
    standard = cache[block_ids[slots // page_size].long(), head, slots % page_size]
    return torch.cat([compacted, standard])


def head_paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: HeadPagedBatch,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its head's compacted tokens, standard region
    and evicted-token moments.

    Args:
        query: ``[T, Hq, D]``.
        key_cache, value_cache: logical ``[num_blocks, H, page_size, D]``.
        batch: the requests (every attention field set).

    Returns:
        ``(out [T, Hq, D], lse [T, Hq])`` in fp32; ``lse`` is the natural-log
        partition function including the moments; a head with nothing to read
        gives ``out = 0, lse = -inf``.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    block_table = batch.for_attention()[2]

    def read(r: int, h: int, length: int, start: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        args = (h, batch.head_page_table[r, h], length, block_table[r], start, seq_len)
        return head_tokens_reference(key_cache, *args), head_tokens_reference(value_cache, *args)

    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), device=query.device)
    attend_head_tokens(query, num_kv_heads, batch, read, scale, out, lse)
    return out, lse


# --------------------------------------------------------------------------- Triton

# The kernel below is a real GPU kernel; on machines without one the tests run it
# under ``TRITON_INTERPRET=1``. Importing this module never requires triton: the
# reference above runs anywhere.
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds without triton use the reference
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

LOG2E = 1.4426950408889634  # the kernel works in base 2 (exp2 is one instruction)
LN2 = 0.6931471805599453

if triton is not None:
    # Globals a jitted function reads must be constexpr objects.
    _LN2 = tl.constexpr(LN2)
    _LOG2E = tl.constexpr(LOG2E)

    @triton.jit
    def _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
        """The request owning query tile ``tile``.

        Request ``r``'s tiles are numbered from ``query_start_loc[r] // BLOCK_Q + r``
        (vLLM's unified-attention numbering): increasing in ``r``, at least
        ``cdiv(T_r, BLOCK_Q)`` apart, and computable without a host sync, so the
        grid needs only ``T // BLOCK_Q + R`` programs whatever the query lengths.
        """
        lo = 0
        hi = num_requests
        while lo < hi:
            mid = (lo + hi) // 2
            first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if first_tile <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _attend_tile(
        q,
        m_i,
        l_i,
        acc,
        k_ptrs,
        v_ptrs,
        token_ok,
        d_ok,
        visible,
        scale_log2,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
    ):
        """One online-softmax step over a tile of ``BLOCK_N`` keys (base-2 logits).

        ``k_ptrs [BLOCK_D, BLOCK_N]`` (K transposed, so the logits are one dot),
        ``v_ptrs [BLOCK_N, BLOCK_D]``. Tokens outside ``token_ok`` are never read:
        unreferenced pages may hold anything, NaN included.
        """
        k = tl.load(k_ptrs, mask=d_ok[:, None] & token_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=token_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_UPCAST:
            # Triton's interpreter multiplies bf16 operands as their raw uint16
            # bits; it gets fp32 copies of the same values (never on a GPU).
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; subtracting 0 instead
        # keeps exp2(-inf - -inf) = NaN out of it.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # P is rounded to the cache dtype for the tensor-core dot (flash-attention
        # practice); the interpreter path rounds identically, then upcasts.
        p_low = p.to(v.dtype)
        if DOT_UPCAST:
            p_low = p_low.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_low, v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _head_paged_attention_kernel(
        out_ptr,
        lse_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        head_page_table_ptr,
        head_lens_ptr,
        block_table_ptr,
        region_start_ptr,
        count_ptr,
        key_mean_ptr,
        value_mean_ptr,
        cross_cov_ptr,
        moment_rows_ptr,
        scale,
        scale_log2,
        num_requests,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_vd,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        stride_hpt_r,
        stride_hpt_h,
        stride_hl_r,
        stride_hl_h,
        stride_bt_r,
        stride_cnt_n,
        stride_cnt_h,
        stride_km_n,
        stride_km_h,
        stride_vm_n,
        stride_vm_h,
        stride_cov_n,
        stride_cov_h,
        stride_cov_r,
        stride_cov_c,
        NUM_KV_HEADS: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        HAS_MOMENTS: tl.constexpr,
        COV_MODE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
    ):
        """Program (query tile, KV head, split): the ``BLOCK_Q`` query tokens x
        ``GROUP`` query heads of one request that read KV head ``kv_head``, as
        ``BLOCK_M`` rows of one tile, so each K/V tile is loaded once per group.

        The KV head's keys are numbered ``0 .. head_lens + seq_len - region_start``
        (compacted tokens, then the standard region); split ``s`` of ``NUM_SPLITS``
        takes one contiguous, ``BLOCK_N``-aligned chunk of them and writes its
        normalised partial ``(out, lse)``; with one split that is the result.
        """
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        req = _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q)
        q_first = tl.load(query_start_loc_ptr + req)
        q_count = tl.load(query_start_loc_ptr + req + 1) - q_first
        q_tile = tile - (q_first // BLOCK_Q + req)
        if q_tile * BLOCK_Q >= q_count:
            return  # a spare program of the numbering (or a request with no query)

        seq_len = tl.load(seq_lens_ptr + req)
        start = tl.load(region_start_ptr + req)
        length = tl.load(head_lens_ptr + req * stride_hl_r + kv_head * stride_hl_h)

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        tok = q_tile * BLOCK_Q + offs_m // GROUP  # query index inside the request
        q_head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_count)
        position = seq_len - q_count + tok
        q_rows = (q_first + tok).to(tl.int64)
        q_ptrs = q_ptr + q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh
        q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        if HAS_MOMENTS:
            # The evicted moments are the softmax's starting state (one split owns it):
            # m = lse_E, l = 1, acc = o_E, with lse_E = log n + τ q·k̄ (Eq. 11) and
            # o_E = v̄ + τ C q / n (Eq. 9). Their fp32 statistics cost one extra read.
            row = tl.load(moment_rows_ptr + req)
            if (split == 0) & (row >= 0):
                row64 = row.to(tl.int64)
                n = tl.load(count_ptr + row64 * stride_cnt_n + kv_head * stride_cnt_h)
                if n > 0:
                    k_mean = tl.load(
                        key_mean_ptr + row64 * stride_km_n + kv_head * stride_km_h + offs_d,
                        mask=d_ok,
                        other=0.0,
                    )
                    v_mean = tl.load(
                        value_mean_ptr + row64 * stride_vm_n + kv_head * stride_vm_h + offs_d,
                        mask=d_ok,
                        other=0.0,
                    )
                    q_k_mean = tl.sum(q.to(tl.float32) * k_mean[None, :], 1)
                    cov_base = cross_cov_ptr + row64 * stride_cov_n + kv_head * stride_cov_h
                    c_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                    if COV_MODE == 2:
                        # C q by chunks of key dims: (Q Cᵀ)[m, dv] = Σ_dk Q[m, dk] C[dv, dk].
                        # An fp32 (FMA) dot holds its operands' whole K extent per
                        # thread: 16-wide chunks keep it from spilling (and 16 is the
                        # smallest K every triton 3.x accepts).
                        for dk0 in tl.static_range(0, BLOCK_D, BLOCK_DK):
                            offs_dk = dk0 + tl.arange(0, BLOCK_DK)
                            dk_ok = offs_dk < HEAD_DIM
                            q_chunk = tl.load(
                                q_ptrs + offs_dk[None, :] * stride_qd,
                                mask=row_ok[:, None] & dk_ok[None, :],
                                other=0.0,
                            ).to(tl.float32)
                            cov_t = tl.load(
                                cov_base + offs_dk[:, None] * stride_cov_c + offs_d[None, :] * stride_cov_r,
                                mask=dk_ok[:, None] & d_ok[None, :],
                                other=0.0,
                            )
                            c_q += tl.dot(q_chunk, cov_t, input_precision="ieee")
                    elif COV_MODE == 1:  # diagonal C: diag(C) ⊙ q
                        cov_diag = tl.load(cov_base + offs_d * stride_cov_r, mask=d_ok, other=0.0)
                        c_q = q.to(tl.float32) * cov_diag[None, :]
                    m_i = tl.log2(n) + scale_log2 * q_k_mean
                    l_i = tl.full([BLOCK_M], 1.0, tl.float32)
                    acc = v_mean[None, :] + c_q * (scale / n)

        q = q.to(k_ptr.dtype.element_ty)
        if DOT_UPCAST:
            q = q.to(tl.float32)
        total = length + seq_len - start
        chunk = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, total)
        offs_n = tl.arange(0, BLOCK_N)
        all_rows = offs_m >= 0  # [BLOCK_M] of True, to broadcast column masks

        # 1. Compacted tokens: visible to every query.
        hpt_row = head_page_table_ptr + req * stride_hpt_r + kv_head * stride_hpt_h
        compacted_hi = tl.minimum(hi, length)
        for j0 in range(lo, compacted_hi, BLOCK_N):
            index = j0 + offs_n
            token_ok = index < compacted_hi
            page = tl.load(hpt_row + index // PAGE_SIZE, mask=token_ok, other=0).to(tl.int64)
            block = page // NUM_KV_HEADS
            slot = page % NUM_KV_HEADS
            offset = index % PAGE_SIZE
            k_tok = block * stride_kb + slot * stride_kh + offset * stride_kt
            v_tok = block * stride_vb + slot * stride_vh + offset * stride_vt
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                k_ptr + k_tok[None, :] + offs_d[:, None] * stride_kd,
                v_ptr + v_tok[:, None] + offs_d[None, :] * stride_vd,
                token_ok,
                d_ok,
                all_rows[:, None] & token_ok[None, :],
                scale_log2,
                DOT_PRECISION,
                DOT_UPCAST,
            )

        # 2. Standard region, causal: slots past the tile's last query position are
        # skipped, not just masked.
        last_position = seq_len - q_count + tl.minimum((q_tile + 1) * BLOCK_Q, q_count) - 1
        slot_lo = tl.maximum(lo, length) - length + start
        slot_hi = tl.minimum(hi - length + start, last_position + 1)
        bt_row = block_table_ptr + req * stride_bt_r
        for s0 in range(slot_lo, slot_hi, BLOCK_N):
            slots = s0 + offs_n
            token_ok = slots < slot_hi
            block = tl.load(bt_row + slots // PAGE_SIZE, mask=token_ok, other=0).to(tl.int64)
            offset = slots % PAGE_SIZE
            k_tok = block * stride_kb + kv_head * stride_kh + offset * stride_kt
            v_tok = block * stride_vb + kv_head * stride_vh + offset * stride_vt
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                k_ptr + k_tok[None, :] + offs_d[:, None] * stride_kd,
                v_ptr + v_tok[:, None] + offs_d[None, :] * stride_vd,
                token_ok,
                d_ok,
                token_ok[None, :] & (slots[None, :] <= position[:, None]),
                scale_log2,
                DOT_PRECISION,
                DOT_UPCAST,
            )

        # A row with nothing to read (and an empty split) gives out = 0, lse = -inf.
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
        out_rows = split * stride_os + q_rows * stride_ot + q_head * stride_oh
        tl.store(
            out_ptr + out_rows[:, None] + offs_d[None, :],
            out,
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(lse_ptr + split * stride_ls + q_rows * stride_lt + q_head, lse, mask=row_ok)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,
        lse_ptr,
        part_out_ptr,
        part_lse_ptr,
        query_start_loc_ptr,
        num_requests,
        stride_ot,
        stride_oh,
        stride_lt,
        stride_pos,
        stride_pot,
        stride_poh,
        stride_pls,
        stride_plt,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """Program (query token, query head): the LSE merge of the splits' partial
        states. Rows no request owns get the reference's ``(0, -inf)``."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        if (t < tl.load(query_start_loc_ptr)) | (t >= tl.load(query_start_loc_ptr + num_requests)):
            tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, tl.zeros([BLOCK_D], tl.float32), mask=d_ok)
            tl.store(lse_ptr + t * stride_lt + h, float("-inf"))
            return
        s_ok = offs_s < NUM_SPLITS
        part_lse = tl.load(
            part_lse_ptr + offs_s * stride_pls + t * stride_plt + h, mask=s_ok, other=float("-inf")
        )
        m = tl.max(part_lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2((part_lse - m_safe) * _LOG2E)
        part_out = tl.load(
            part_out_ptr + offs_s[:, None] * stride_pos + t * stride_pot + h * stride_poh + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        w_sum = tl.sum(w, 0)
        empty = w_sum == 0.0
        out = tl.sum(w[:, None] * part_out, 0) / tl.where(empty, 1.0, w_sum)
        lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, w_sum)))
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out, mask=d_ok)
        tl.store(lse_ptr + t * stride_lt + h, lse)


_SM_COUNT: dict[int, int] = {}


def _interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1``."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one split unless asked, the cheapest to emulate
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism


def choose_num_splits(
    num_programs: int, device: torch.device, max_seq_len: int | None = None
) -> int:
    """How many chunks to split each head's keys into (flash decoding).

    Enough programs to fill the GPU about four times over; with few requests
    x heads (small-batch decode) that means splitting the keys. ``max_seq_len``
    (a host-side bound on ``head_lens + seq_len - region_start``, which vLLM's
    metadata has) caps the splits so that none is shorter than
    ``MIN_SPLIT_TOKENS``; without it the splits beyond a short head's keys are
    empty programs that exit after writing ``lse = -inf``.
    """
    target = 4 * _sm_count(device)
    if device.type != "cuda" or num_programs >= target:
        return 1
    splits = min(MAX_SPLITS, -(-target // num_programs))
    if max_seq_len is not None:
        splits = min(splits, max(1, max_seq_len // MIN_SPLIT_TOKENS))
    return max(1, splits)


def prefix_as_pages(batch: HeadPagedBatch, num_kv_heads: int, page_size: int) -> HeadPagedBatch:
    """``batch`` with each request's protected prefix (whole pages, read by
    every query) moved into the front of its heads' page tables: in the
    logical cache a standard block's head-pages are pages like the compacted
    ones. No host sync: the tables widen by the block table's width."""
    assert batch.prefix_lens is not None and batch.block_table is not None
    prefix_pages = (batch.prefix_lens.to(torch.int64) // page_size)[:, None, None]  # [R, 1, 1]
    num_requests, _, width = batch.head_page_table.shape
    max_blocks = batch.block_table.shape[1]
    column = torch.arange(max_blocks + width, device=batch.head_page_table.device)[None, None, :]
    heads = torch.arange(num_kv_heads, device=column.device)[None, :, None]
    from_prefix = batch.block_table.to(torch.int64)[:, None, :] * num_kv_heads + heads  # [R, H, max_blocks]
    padded_prefix = torch.nn.functional.pad(from_prefix, (0, width))
    padded_own = torch.nn.functional.pad(batch.head_page_table.to(torch.int64), (0, max_blocks))
    own_column = (column - prefix_pages).clamp(min=0).expand(num_requests, num_kv_heads, -1)
    table = torch.where(
        column < prefix_pages,
        padded_prefix.expand(num_requests, num_kv_heads, -1),
        padded_own.gather(2, own_column),
    )
    return dataclasses.replace(
        batch,
        head_page_table=table.to(batch.head_page_table.dtype),
        head_lens=batch.head_lens + batch.prefix_lens.to(batch.head_lens.dtype)[:, None],
        prefix_lens=None,
    )


def head_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: HeadPagedBatch,
    scale: float,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel with exactly :func:`head_paged_attention_reference`'s semantics.

    Arguments as the reference's. ``key_cache``/``value_cache`` are the logical
    ``[num_blocks, H, page_size, D]`` and may be strided views of another
    physical layout (vLLM's GPU ``[num_blocks, page_size, H, D]`` permuted):
    the kernel addresses them through their strides. fp16, bf16 or fp32 caches;
    ``query`` may be any of those (it is cast to the cache dtype for the dots).
    Index tensors are int32 or int64. No host sync: decode and prefill chunks
    of any lengths take the same path.

    ``num_splits``: split each head's keys into that many chunks merged by LSE
    (flash decoding); ``None`` chooses from the grid size (see
    :func:`choose_num_splits`, which ``max_seq_len`` bounds). The result does
    not depend on it beyond rounding.

    Returns ``(out [T, Hq, D], lse [T, Hq])``, fp32, ``lse`` in natural log.
    """
    if triton is None:
        raise RuntimeError("head_paged_attention needs triton; use head_paged_attention_reference")
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, num_kv_heads, page_size, cache_dim = key_cache.shape
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    if cache_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not match cache {tuple(key_cache.shape)}")
    group = num_q_heads // num_kv_heads
    if batch.prefix_lens is not None:
        batch = prefix_as_pages(batch, num_kv_heads, page_size)
    query_start_loc, seq_lens, block_table, region_start = batch.for_attention()
    head_page_table, head_lens = batch.head_page_table, batch.head_lens
    num_requests = seq_lens.shape[0]
    device = query.device
    moments = batch.moments if batch.has_moments else None
    if moments is not None:
        for name in ("key_mean", "value_mean"):
            if getattr(moments, name).stride(-1) != 1:
                raise ValueError(f"moments.{name} must be contiguous in its last dim")

    f32 = dict(dtype=torch.float32, device=device)
    if num_tokens == 0 or num_requests == 0:
        return torch.zeros(num_tokens, num_q_heads, head_dim, **f32), torch.full(
            (num_tokens, num_q_heads), float("-inf"), **f32
        )

    block_d = _next_power_of_2(head_dim)
    # Decode rows are one token x G heads: the smallest dot tile (16 rows) holds
    # them. Prefill chunks stack BLOCK_M // G tokens x G heads per tile. T <= R
    # is a host-side test (no sync) that catches pure decode batches. fp32
    # caches: fp32 dots run on the FMA units and hold their whole K extent per
    # thread, so the 16-bit tile sizes spill on sm_90; these do not. Prefill
    # tiles (32-64 rows) with a D=128 fp32 accumulator spill on 4 warps: 8.
    fp32 = key_cache.dtype == torch.float32
    block_m = 16 if num_tokens <= num_requests else (32 if fp32 else 64)
    block_m = max(block_m, _next_power_of_2(group))
    if fp32:
        block_n = 16 if block_d >= 128 else 32
    else:
        block_n = 64 if block_d <= 128 else 32
    if _interpreted(_head_paged_attention_kernel):
        # The interpreter runs each program as numpy calls: fewer, larger
        # tiles are what makes it fast (there are no registers to spill).
        block_m = max(block_m, 128 if num_tokens > num_requests else 16)
        block_n = 128
    block_q = block_m // group
    num_warps = 4 if block_m <= 16 else 8
    num_tiles = num_tokens // block_q + num_requests
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles * num_kv_heads, device, max_seq_len)
    num_splits = max(1, int(num_splits))

    if num_splits == 1:
        # Rows no request owns keep the reference's (0, -inf); the kernel writes the rest.
        out = torch.zeros(num_tokens, num_q_heads, head_dim, **f32)
        lse = torch.full((num_tokens, num_q_heads), float("-inf"), **f32)
        part_out, part_lse = out.unsqueeze(0), lse.unsqueeze(0)
    else:  # the merge kernel writes every row
        out = torch.empty(num_tokens, num_q_heads, head_dim, **f32)
        lse = torch.empty(num_tokens, num_q_heads, **f32)
        part_out = torch.empty(num_splits, *out.shape, **f32)
        part_lse = torch.empty(num_splits, *lse.shape, **f32)

    if moments is not None:
        count, key_mean, value_mean, cross_cov = (
            moments.count,
            moments.key_mean,
            moments.value_mean,
            moments.cross_cov,
        )
        rows = batch.moment_rows
        cov_mode = {"none": 0, "diagonal": 1, "full": 2}[moments.covariance]
        if cov_mode == 0:  # an empty C: hand the kernel a placeholder it never reads
            cross_cov = out.unsqueeze(0)
    else:  # never read (HAS_MOMENTS is a constexpr): placeholders of the right rank
        count, key_mean, value_mean, cross_cov = lse, out, out, out.unsqueeze(0)
        rows = seq_lens
        cov_mode = 2
    # Strides of C as (row, head, value dim, key dim); a diagonal C has one
    # dim per (row, head), an absent one none (never read).
    cov_strides = (tuple(cross_cov.stride()) + (0, 0))[:4]

    # fp32 caches: keep the dots in fp32 (the default TF32 would cost ~1e-3).
    precision = "ieee" if key_cache.dtype == torch.float32 else "tf32"
    grid = (num_tiles, num_kv_heads, num_splits)
    _head_paged_attention_kernel[grid](
        part_out,
        part_lse,
        query,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        head_page_table,
        head_lens,
        block_table,
        region_start,
        count,
        key_mean,
        value_mean,
        cross_cov,
        rows,
        float(scale),
        float(scale) * LOG2E,
        num_requests,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        head_page_table.stride(0),
        head_page_table.stride(1),
        head_lens.stride(0),
        head_lens.stride(1),
        block_table.stride(0),
        count.stride(0),
        count.stride(1),
        key_mean.stride(0),
        key_mean.stride(1),
        value_mean.stride(0),
        value_mean.stride(1),
        *cov_strides,
        NUM_KV_HEADS=num_kv_heads,
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_DK=16,
        NUM_SPLITS=num_splits,
        HAS_MOMENTS=moments is not None,
        COV_MODE=cov_mode,
        DOT_PRECISION=precision,
        DOT_UPCAST=key_cache.dtype == torch.bfloat16 and _interpreted(_head_paged_attention_kernel),
        num_warps=num_warps,
        num_stages=2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            lse,
            part_out,
            part_lse,
            query_start_loc,
            num_requests,
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=_next_power_of_2(num_splits),
            num_warps=4,
        )
    return out, lse
