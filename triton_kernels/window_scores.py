"""SnapKV's window votes over per-(request, KV head) page tables, for many
(request, KV head) items in one launch per pass.

SnapKV (Li et al., 2024) scores each key by the causal softmax attention it
receives from the last ``W`` queries before the eviction point, averaged over
those queries and the ``G`` query heads of its KV head. The storage and the
batch are :class:`~vllm_kvevict.triton_kernels.batch.HeadPagedBatch`'s, read as
an eviction reads them: request ``r``'s KV head ``h`` (one *item*) has ``L``
keys numbered ``0 .. L - 1``, its ``head_lens[r, h]`` compacted tokens, then its
standard slots ``[region_start[r], seq_lens[r])`` (``seq_lens`` is the eviction
point; the protected prefix, never a candidate, is not read: ``prefix_lens`` is
ignored, and the caller's ``region_start`` starts after it).

Causal rule. Request ``r``'s ``W_r`` window queries sit at the positions
``[seq_lens[r] - W_r, seq_lens[r])``; a standard slot's position is its slot, a
compacted token's is ``compacted_positions[r, h, j]`` (without that tensor:
before every window query). Query ``i`` sees key ``k`` when
``pos(k) <= pos(i)``: its own token and earlier ones, never a later one. A query
that sees no key gives zero everywhere and still counts in the mean over
``G * W_r``. This is the rule of ``grouped_attention_probs``
(``vllm_kvevict/policies/base.py``) on the keys an eviction gathers.

This file holds the torch reference (:func:`window_votes_reference`, which
runs :func:`~vllm_kvevict.triton_kernels.window_scores_torch.window_votes_torch`
item by item on the logical cache) and the Triton kernel :func:`window_votes`.
Pooling is not fused: the policy pools the votes it is given
(:func:`vllm_kvevict.policies.snapkv.pool_votes`, a torch op per request).
"""

from __future__ import annotations

import torch

from vllm_kvevict.triton_kernels.batch import HeadPagedBatch
from vllm_kvevict.triton_kernels.head_paged_attention import (
    LOG2E,
    choose_num_splits,
    head_tokens_reference,
)
from vllm_kvevict.triton_kernels.window_scores_torch import item_lengths, window_votes_torch


def _window_inputs(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    batch: HeadPagedBatch,
    query_lens: torch.Tensor | None,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(group, query_lens [R], seq_lens, block_table, region_start)``, checked."""
    if batch.seq_lens is None or batch.block_table is None or batch.region_start is None:
        raise ValueError("window votes need the batch's seq_lens, block_table and region_start")
    num_requests, num_q_heads, window, head_dim = queries.shape
    num_kv_heads, cache_dim = key_cache.shape[1], key_cache.shape[3]
    if cache_dim != head_dim or num_q_heads % num_kv_heads or batch.head_page_table.shape[1] != num_kv_heads:
        raise ValueError(f"queries {tuple(queries.shape)} do not match the cache {tuple(key_cache.shape)}")
    if batch.seq_lens.shape[0] != num_requests:
        raise ValueError(f"queries hold {num_requests} requests, the batch {batch.seq_lens.shape[0]}")
    if query_lens is None:
        query_lens = torch.full((num_requests,), window, dtype=torch.int32, device=queries.device)
    return num_q_heads // num_kv_heads, query_lens, batch.seq_lens, batch.block_table, batch.region_start


def window_votes_reference(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    batch: HeadPagedBatch,
    scale: float,
    *,
    query_lens: torch.Tensor | None = None,
    compacted_positions: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`window_votes` (same arguments and result),
    one item at a time on the logical cache ``[num_blocks, H, page_size, D]``."""
    group, query_lens, seq_lens, block_table, region_start = _window_inputs(queries, key_cache, batch, query_lens)
    num_requests, _, _, _ = queries.shape
    num_kv_heads = key_cache.shape[1]
    lengths = item_lengths(batch)
    width = int(lengths.max()) if max_len is None and lengths.numel() else int(max_len or 0)
    votes = torch.zeros(num_requests, num_kv_heads, width, dtype=torch.float32, device=queries.device)
    for r in range(num_requests):
        seq_len, start, count = int(seq_lens[r]), int(region_start[r]), int(query_lens[r])
        query_positions = torch.arange(seq_len - count, seq_len, device=queries.device)
        for h in range(num_kv_heads):
            length = int(batch.head_lens[r, h])
            keys = head_tokens_reference(
                key_cache, h, batch.head_page_table[r, h], length, block_table[r], start, max(start, seq_len)
            )
            slots = torch.arange(start, start + keys.shape[0] - length, device=queries.device)
            if compacted_positions is not None:
                before = compacted_positions[r, h, :length].long().to(queries.device)
            else:
                before = torch.full((length,), -1, dtype=torch.long, device=queries.device)
            votes[r, h, : keys.shape[0]] = window_votes_torch(
                queries[r, h * group : (h + 1) * group, :count],
                keys,
                torch.cat([before, slots]),
                query_positions,
                scale,
            )
    return votes


# --------------------------------------------------------------------------- Triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds without triton use the reference
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

if triton is not None:

    @triton.jit
    def _key_tile(
        index,
        in_range,
        length,
        start,
        kv_head,
        hpt_row,
        stride_hpt_p,
        bt_row,
        stride_bt_b,
        pos_row,
        stride_pos_c,
        stride_kb,
        stride_kh,
        stride_kt,
        NUM_KV_HEADS: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        HAS_POSITIONS: tl.constexpr,
    ):
        """Element offset and position of an item's keys ``index``: compacted
        tokens (``index < length``) through the head's page table, standard
        slots through the request's block table. Nothing is read outside
        ``in_range``."""
        compacted = index < length
        page = tl.load(hpt_row + (index // PAGE_SIZE) * stride_hpt_p, mask=in_range & compacted, other=0).to(tl.int64)
        slot = start + index - length  # a standard key's slot
        standard = in_range & (index >= length)
        block = tl.load(bt_row + (slot // PAGE_SIZE) * stride_bt_b, mask=standard, other=0).to(tl.int64)
        offset = tl.where(compacted, index % PAGE_SIZE, slot % PAGE_SIZE)
        head = tl.where(compacted, page % NUM_KV_HEADS, kv_head)
        block = tl.where(compacted, page // NUM_KV_HEADS, block)
        k_off = block * stride_kb + head * stride_kh + offset * stride_kt
        if HAS_POSITIONS:
            before = tl.load(pos_row + index * stride_pos_c, mask=in_range & compacted, other=0).to(tl.int64)
        else:
            before = tl.zeros_like(index).to(tl.int64) - 1  # before every window query
        position = tl.where(compacted, before, slot.to(tl.int64))
        return k_off, position

    @triton.jit
    def _window_logits(q, k_ptrs, k_ok, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
        """``q [BLOCK_M, BLOCK_D] @ K^T`` with ``k_ptrs [BLOCK_D, BLOCK_N]``; unread keys are 0."""
        k = tl.load(k_ptrs, mask=k_ok, other=0.0)
        if DOT_UPCAST:
            # Triton's interpreter multiplies 16-bit operands at their own
            # precision; it gets fp32 copies of the same values (never on a GPU).
            k = k.to(tl.float32)
            q = q.to(tl.float32)
        return tl.dot(q, k, input_precision=DOT_PRECISION)

    @triton.jit
    def _window_rows(
        q_ptr,
        req,
        kv_head,
        rows,
        row_ok,
        offs_d,
        d_ok,
        seq_len,
        count,
        stride_qr,
        stride_qh,
        stride_qw,
        stride_qd,
        GROUP: tl.constexpr,
    ):
        """Rows ``rows`` (``i * GROUP + g``: window query ``i`` of query head
        ``g`` of the group) as a ``[BLOCK_M, BLOCK_D]`` tile in the cache
        dtype, and their positions."""
        query = rows // GROUP
        q_head = kv_head * GROUP + rows % GROUP
        q_off = req.to(tl.int64) * stride_qr + q_head * stride_qh + query * stride_qw
        q_ptrs = q_ptr + q_off[:, None] + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        return q, (seq_len - count + query).to(tl.int64)

    @triton.jit
    def _window_lse_kernel(
        part_lse_ptr,
        q_ptr,
        k_ptr,
        query_lens_ptr,
        seq_lens_ptr,
        head_page_table_ptr,
        head_lens_ptr,
        block_table_ptr,
        region_start_ptr,
        positions_ptr,
        scale_log2,
        stride_ps,
        stride_pi,
        stride_qr,
        stride_qh,
        stride_qw,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_hpt_r,
        stride_hpt_h,
        stride_hpt_p,
        stride_hl_r,
        stride_hl_h,
        stride_bt_r,
        stride_bt_b,
        stride_pos_r,
        stride_pos_h,
        stride_pos_c,
        NUM_KV_HEADS: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        HAS_POSITIONS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
    ):
        """Pass 1. Program (item, row tile, split): the base-2 log-sum-exp of
        ``BLOCK_M`` window rows over split ``split`` of the item's keys (one
        contiguous, ``BLOCK_N``-aligned chunk; online softmax over key tiles,
        each tile read once for all the rows). ``-inf``: the rows see nothing
        in the chunk."""
        item = tl.program_id(0)
        row_tile = tl.program_id(1)
        split = tl.program_id(2)
        req = item // NUM_KV_HEADS
        kv_head = item % NUM_KV_HEADS

        count = tl.load(query_lens_ptr + req)
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < count * GROUP
        if row_tile * BLOCK_M >= count * GROUP:
            return  # rows past this request's window: pass 2 reads none of them

        seq_len = tl.load(seq_lens_ptr + req)
        start = tl.load(region_start_ptr + req)
        length = tl.load(head_lens_ptr + req * stride_hl_r + kv_head * stride_hl_h)
        num_keys = length + tl.maximum(seq_len - start, 0)

        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)
        q, q_position = _window_rows(
            q_ptr, req, kv_head, rows, row_ok, offs_d, d_ok, seq_len, count,
            stride_qr, stride_qh, stride_qw, stride_qd, GROUP,
        )
        q = q.to(k_ptr.dtype.element_ty)

        hpt_row = head_page_table_ptr + req * stride_hpt_r + kv_head * stride_hpt_h
        bt_row = block_table_ptr + req * stride_bt_r
        pos_row = positions_ptr + req * stride_pos_r + kv_head * stride_pos_h

        chunk = tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, num_keys)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for j0 in range(lo, hi, BLOCK_N):
            index = j0 + offs_n
            key_ok = index < hi
            k_off, k_position = _key_tile(
                index, key_ok, length, start, kv_head, hpt_row, stride_hpt_p, bt_row, stride_bt_b,
                pos_row, stride_pos_c, stride_kb, stride_kh, stride_kt, NUM_KV_HEADS, PAGE_SIZE, HAS_POSITIONS,
            )
            s = _window_logits(
                q, k_ptr + k_off[None, :] + offs_d[:, None] * stride_kd, d_ok[:, None] & key_ok[None, :],
                DOT_PRECISION, DOT_UPCAST,
            ) * scale_log2
            visible = key_ok[None, :] & (k_position[None, :] <= q_position[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing keeps m = -inf; subtracting 0 instead
            # keeps exp2(-inf - -inf) = NaN out of it.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
        empty = l_i == 0.0
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + split * stride_ps + item * stride_pi + rows, lse, mask=row_ok)

    @triton.jit
    def _window_votes_kernel(
        votes_ptr,
        part_lse_ptr,
        q_ptr,
        k_ptr,
        query_lens_ptr,
        seq_lens_ptr,
        head_page_table_ptr,
        head_lens_ptr,
        block_table_ptr,
        region_start_ptr,
        positions_ptr,
        scale_log2,
        width,
        stride_vi,
        stride_ps,
        stride_pi,
        stride_qr,
        stride_qh,
        stride_qw,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_hpt_r,
        stride_hpt_h,
        stride_hpt_p,
        stride_hl_r,
        stride_hl_h,
        stride_bt_r,
        stride_bt_b,
        stride_pos_r,
        stride_pos_h,
        stride_pos_c,
        NUM_KV_HEADS: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        HAS_POSITIONS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
    ):
        """Pass 2. Program (item, key tile): each of ``BLOCK_N`` keys' mean over
        the item's ``G * W_r`` window rows of ``exp2(s - lse)``, the rows by
        tiles of ``BLOCK_M`` (each row's log-sum-exp merged from pass 1's
        splits). Writes the tile's columns of ``votes``: 0 past the item's keys."""
        item = tl.program_id(0)
        tile = tl.program_id(1)
        req = item // NUM_KV_HEADS
        kv_head = item % NUM_KV_HEADS

        seq_len = tl.load(seq_lens_ptr + req)
        start = tl.load(region_start_ptr + req)
        length = tl.load(head_lens_ptr + req * stride_hl_r + kv_head * stride_hl_h)
        num_keys = length + tl.maximum(seq_len - start, 0)
        count = tl.load(query_lens_ptr + req)

        offs_n = tl.arange(0, BLOCK_N)
        index = tile * BLOCK_N + offs_n
        out_ptrs = votes_ptr + item.to(tl.int64) * stride_vi + index
        if tile * BLOCK_N >= num_keys:
            tl.store(out_ptrs, tl.zeros([BLOCK_N], tl.float32), mask=index < width)
            return
        key_ok = index < num_keys

        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < NUM_SPLITS
        hpt_row = head_page_table_ptr + req * stride_hpt_r + kv_head * stride_hpt_h
        bt_row = block_table_ptr + req * stride_bt_r
        pos_row = positions_ptr + req * stride_pos_r + kv_head * stride_pos_h
        k_off, k_position = _key_tile(
            index, key_ok, length, start, kv_head, hpt_row, stride_hpt_p, bt_row, stride_bt_b,
            pos_row, stride_pos_c, stride_kb, stride_kh, stride_kt, NUM_KV_HEADS, PAGE_SIZE, HAS_POSITIONS,
        )
        k_ptrs = k_ptr + k_off[None, :] + offs_d[:, None] * stride_kd
        k_ok = d_ok[:, None] & key_ok[None, :]

        votes = tl.zeros([BLOCK_N], tl.float32)
        for r0 in range(0, count * GROUP, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_ok = rows < count * GROUP
            q, q_position = _window_rows(
                q_ptr, req, kv_head, rows, row_ok, offs_d, d_ok, seq_len, count,
                stride_qr, stride_qh, stride_qw, stride_qd, GROUP,
            )
            q = q.to(k_ptr.dtype.element_ty)
            part = tl.load(
                part_lse_ptr + offs_s[:, None] * stride_ps + item * stride_pi + rows[None, :],
                mask=s_ok[:, None] & row_ok[None, :],
                other=float("-inf"),
            )
            top = tl.max(part, 0)
            top_safe = tl.where(top == float("-inf"), 0.0, top)
            total = tl.sum(tl.exp2(part - top_safe[None, :]), 0)
            seen = total > 0.0  # rows that see some key
            lse = top_safe + tl.log2(tl.where(seen, total, 1.0))
            s = _window_logits(q, k_ptrs, k_ok, DOT_PRECISION, DOT_UPCAST) * scale_log2
            visible = (seen & row_ok)[:, None] & key_ok[None, :] & (k_position[None, :] <= q_position[:, None])
            votes += tl.sum(tl.where(visible, tl.exp2(s - lse[:, None]), 0.0), 0)
        votes = votes / tl.maximum(count * GROUP, 1).to(tl.float32)
        tl.store(out_ptrs, votes, mask=index < width)

    # Whether the kernels were decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
    _INTERPRETED = not isinstance(_window_lse_kernel, triton.runtime.JITFunction)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


MAX_SPLITS = 16  # pass 2 merges every split's row state in each key tile: keep that small


def window_votes(
    queries: torch.Tensor,
    key_cache: torch.Tensor,
    batch: HeadPagedBatch,
    scale: float,
    *,
    query_lens: torch.Tensor | None = None,
    compacted_positions: torch.Tensor | None = None,
    max_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """SnapKV's window votes of every (request, KV head), two launches whatever
    the number of items; no ``[R, H, G * W, L]`` probabilities are stored.

    Args:
        queries: ``[R, Hq, W, D]``, any strides, fp32, bf16 or fp16 (cast to
            the cache dtype for the dots): request ``r``'s window queries, query
            head ``j`` reading KV head ``j // G`` (``Hq = H * G``); rows
            ``[0, query_lens[r])`` of it are the queries at positions
            ``[seq_lens[r] - query_lens[r], seq_lens[r])``, in order.
        key_cache: logical ``[num_blocks, H, page_size, D]``, any strides
            (vLLM's ``[num_blocks, page_size, H, D]`` permuted, or its per-layer
            key view), fp32, bf16 or fp16.
        batch: ``head_page_table``, ``head_lens``, ``seq_lens`` (the eviction
            point), ``block_table`` and ``region_start`` (the first standard
            slot, after any protected prefix); the other fields are not read.
        scale: the softmax scale.
        query_lens: ``[R]`` window queries per request, ``<= W`` (None: all
            ``W``); ``0`` gives zero votes.
        compacted_positions: ``[R, H, C]`` int, any strides: the position of
            each compacted token (``C >= head_lens``). None: every compacted
            token lies before every window query.
        max_len: the result's width, at least every item's key count
            ``head_lens + seq_lens - region_start``; None computes it (one
            host sync).
        num_splits: split each item's keys into that many chunks for pass 1
            (``None`` chooses from the grid size). The result does not depend
            on it beyond rounding.

    Returns:
        ``votes [R, H, width]`` fp32: item ``(r, h)``'s key ``j`` (in the
        numbering above) at ``votes[r, h, j]``, the mean over its ``G * W_r``
        window rows of their causal softmax; ``0`` past the item's keys.
    """
    if triton is None:
        raise RuntimeError("window_votes needs triton; use window_votes_reference")
    group, query_lens, seq_lens, block_table, region_start = _window_inputs(queries, key_cache, batch, query_lens)
    num_requests, _, window, head_dim = queries.shape
    num_kv_heads, page_size = key_cache.shape[1], key_cache.shape[2]
    head_page_table, head_lens = batch.head_page_table, batch.head_lens
    device = queries.device
    width = int(item_lengths(batch).max()) if max_len is None and num_requests else int(max_len or 0)
    num_items = num_requests * num_kv_heads
    votes = torch.empty(num_requests, num_kv_heads, width, dtype=torch.float32, device=device)
    if num_items == 0 or width == 0:
        return votes.zero_()

    rows = max(1, window * group)
    block_d = _next_power_of_2(head_dim)
    # Rows of one tile share each key tile's load. 16-bit caches: up to 128 rows
    # (SnapKV's 32 queries x 4 heads) against 64 keys, as flash attention's
    # forward pass tiles D <= 128. fp32 dots run on the FMA units and hold
    # their whole K extent per thread: smaller tiles keep them from spilling.
    fp32 = key_cache.dtype == torch.float32
    block_m = max(16, min(_next_power_of_2(rows), 32 if fp32 else 128))
    block_n = (16 if block_d >= 128 else 32) if fp32 else (64 if block_d <= 128 else 32)
    if _INTERPRETED:
        # The interpreter runs each program as numpy calls: fewer, larger tiles.
        block_m = max(16, min(_next_power_of_2(rows), 128))
        block_n = 64
    num_warps = 8 if block_m >= 64 else 4
    row_tiles = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = choose_num_splits(num_items * row_tiles, device, width)
    num_splits = min(MAX_SPLITS, max(1, int(num_splits)))

    part_lse = torch.empty(num_splits, num_items, rows, dtype=torch.float32, device=device)
    if compacted_positions is None:
        positions, has_positions = head_lens.unsqueeze(-1), False  # never read
    else:
        positions, has_positions = compacted_positions, True
    common = (
        queries,
        key_cache,
        query_lens,
        seq_lens,
        head_page_table,
        head_lens,
        block_table,
        region_start,
        positions,
        float(scale) * LOG2E,
    )
    strides = (
        part_lse.stride(0),
        part_lse.stride(1),
        *queries.stride(),
        *key_cache.stride(),
        *head_page_table.stride(),
        *head_lens.stride(),
        *block_table.stride(),
        *positions.stride(),
    )
    constants = dict(
        NUM_KV_HEADS=num_kv_heads,
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        HAS_POSITIONS=has_positions,
        # fp32 caches: keep the dots in fp32 (the default TF32 would cost ~1e-3).
        DOT_PRECISION="ieee" if fp32 else "tf32",
        DOT_UPCAST=not fp32 and _INTERPRETED,
        num_warps=num_warps,
    )
    _window_lse_kernel[(num_items, row_tiles, num_splits)](part_lse, *common, *strides, **constants)
    _window_votes_kernel[(num_items, triton.cdiv(width, block_n))](
        votes,
        part_lse,
        *common,
        width,
        votes.stride(1),
        *strides,
        BLOCK_S=_next_power_of_2(num_splits),
        **constants,
    )
    return votes
