"""Compaction of one eviction over per-(request, KV-head) page tables, with the
evicted tokens folded into MomentKV's moments.

Storage as in :class:`~vllm_kvevict.triton_kernels.batch.HeadPagedBatch`: the
logical cache is ``[num_blocks, H, page_size, D]``, head-page
``page = block * H + slot`` is ``cache[block, slot]``, and a token is addressed
by its *flat address* ``page * page_size + offset``.

One call handles one eviction of ``R`` requests x ``H`` KV heads; ``batch``
describes the heads after it. For each ``(r, h)``:

* ``src_tokens[r, h, :src_lens[r, h]]`` are the flat addresses of the head's
  live tokens, in sequence order (compacted pages, then standard-region slots:
  whatever the caller's page tables say);
* ``keep[r, h, :batch.head_lens[r, h]]`` are the indices (into that row) of the
  tokens it keeps, distinct, in the order they are written (normally
  increasing, which preserves sequence order);
* kept token ``j`` goes to page ``batch.head_page_table[r, h, j // page_size]``
  at offset ``j % page_size``;
* the live tokens not kept are folded into ``batch.moments`` row
  ``batch.moment_rows[r]`` (``-1``: none), head ``h``, with Chan et al.'s
  parallel update (:meth:`~vllm_kvevict.moments.EvictedMoments.folded`).

Every read happens before every write, so destinations may overlap any
sources (the kept set compacted in place inside the same blocks, or a head
taking over pages another head is vacating). Nothing here knows which policy
chose ``keep``. Distinct ``(r, h)`` must have disjoint destinations and distinct
requests distinct moment rows.
"""

from __future__ import annotations

import torch

from vllm_kvevict.triton_kernels.batch import HeadPagedBatch


def _token_locations(flat: torch.Tensor, num_heads: int, page_size: int) -> tuple[torch.Tensor, ...]:
    """(block, slot, offset) of flat token addresses."""
    flat = flat.long()
    page, offset = flat // page_size, flat % page_size
    return page // num_heads, page % num_heads, offset


def compact_head_pages_reference(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src_tokens: torch.Tensor,
    src_lens: torch.Tensor,
    keep: torch.Tensor,
    batch: HeadPagedBatch,
) -> None:
    """Torch reference of :func:`compact_head_pages` (same arguments), in place."""
    num_requests, num_heads = src_lens.shape
    page_size = key_cache.shape[2]
    moves = []
    for r in range(num_requests):
        row = int(batch.moment_rows[r]) if batch.has_moments else -1
        for h in range(num_heads):
            live = int(src_lens[r, h])
            kept = keep[r, h, : int(batch.head_lens[r, h])].long()
            block, slot, offset = _token_locations(src_tokens[r, h, :live], num_heads, page_size)
            keys = key_cache[block, slot, offset]  # advanced indexing: copies
            values = value_cache[block, slot, offset]
            if row >= 0:
                assert batch.moments is not None
                evicted = torch.ones(live, dtype=torch.bool, device=keys.device)
                evicted[kept] = False
                batch.moments[row, h].fold_(keys, values, evicted)
            moves.append((r, h, keys[kept], values[kept]))
    for r, h, keys, values in moves:  # all reads above, all writes here
        j = torch.arange(keys.shape[0], device=keys.device)
        page = batch.head_page_table[r, h, j // page_size].long()
        key_cache[page // num_heads, page % num_heads, j % page_size] = keys
        value_cache[page // num_heads, page % num_heads, j % page_size] = values


# --------------------------------------------------------------------------- Triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds without triton use the reference
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

if triton is not None:

    @triton.jit
    def _token_offsets(flat, stride_b, stride_h, stride_t, NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr):
        """Element offset of flat token addresses in a strided logical cache."""
        flat = flat.to(tl.int64)
        page = flat // PAGE_SIZE
        return (page // NUM_KV_HEADS) * stride_b + (page % NUM_KV_HEADS) * stride_h + (flat % PAGE_SIZE) * stride_t

    @triton.jit
    def _kept_token_kernel(
        k_ptr,
        v_ptr,
        scratch_k_ptr,
        scratch_v_ptr,
        src_tokens_ptr,
        keep_ptr,
        keep_lens_ptr,
        dest_page_table_ptr,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_vd,
        stride_src_rh,
        stride_keep_rh,
        stride_dest_rh,
        stride_scratch_rh,
        stride_scratch_t,
        NUM_KV_HEADS: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        SCATTER: tl.constexpr,
    ):
        """Program ((r, h), tile of kept tokens): gather (``SCATTER=False``) the
        kept tokens from their sources into a scratch row, or scatter
        (``SCATTER=True``) that row into their destinations.

        Two launches of the same kernel: the launch boundary is the barrier that
        makes overlapping sources and destinations safe. A token whose source
        is its destination is neither gathered nor scattered, so a compaction
        that leaves a prefix in place moves only the rest.
        """
        rh = tl.program_id(0)
        j = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = j < tl.load(keep_lens_ptr + rh)
        index = tl.load(keep_ptr + rh * stride_keep_rh + j, mask=ok, other=0)
        src = tl.load(src_tokens_ptr + rh * stride_src_rh + index, mask=ok, other=0).to(tl.int64)
        page = tl.load(dest_page_table_ptr + rh * stride_dest_rh + j // PAGE_SIZE, mask=ok, other=0)
        dst = page.to(tl.int64) * PAGE_SIZE + j % PAGE_SIZE
        move = ok & (src != dst)
        offs_d = tl.arange(0, BLOCK_D)
        mask = move[:, None] & (offs_d < HEAD_DIM)[None, :]
        scratch = rh * stride_scratch_rh + j[:, None] * stride_scratch_t + offs_d[None, :]
        if SCATTER:
            k = tl.load(scratch_k_ptr + scratch, mask=mask)
            v = tl.load(scratch_v_ptr + scratch, mask=mask)
            k_dst = _token_offsets(dst, stride_kb, stride_kh, stride_kt, NUM_KV_HEADS, PAGE_SIZE)
            v_dst = _token_offsets(dst, stride_vb, stride_vh, stride_vt, NUM_KV_HEADS, PAGE_SIZE)
            tl.store(k_ptr + k_dst[:, None] + offs_d[None, :] * stride_kd, k, mask=mask)
            tl.store(v_ptr + v_dst[:, None] + offs_d[None, :] * stride_vd, v, mask=mask)
        else:
            k_src = _token_offsets(src, stride_kb, stride_kh, stride_kt, NUM_KV_HEADS, PAGE_SIZE)
            v_src = _token_offsets(src, stride_vb, stride_vh, stride_vt, NUM_KV_HEADS, PAGE_SIZE)
            k = tl.load(k_ptr + k_src[:, None] + offs_d[None, :] * stride_kd, mask=mask)
            v = tl.load(v_ptr + v_src[:, None] + offs_d[None, :] * stride_vd, mask=mask)
            tl.store(scratch_k_ptr + scratch, k, mask=mask)
            tl.store(scratch_v_ptr + scratch, v, mask=mask)

    @triton.jit
    def _evicted_mean_kernel(
        k_ptr,
        v_ptr,
        src_tokens_ptr,
        evicted_index_ptr,
        evicted_count_ptr,
        moment_rows_ptr,
        batch_count_ptr,
        batch_mean_ptr,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_vd,
        stride_src_rh,
        stride_ev_rh,
        NUM_KV_HEADS: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        """Program (r, h): count and means of the evicted batch, fp32.

        Writes ``batch_count[rh]`` and ``batch_mean[rh] = [k̄_B, v̄_B]``
        (``[2, BLOCK_D]``); heads without a moment row write a zero count.
        Iterates over the evicted tokens only (``evicted_index``), so a
        decode-time eviction of a few tokens costs a few loads, not a scan.
        """
        rh = tl.program_id(0)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        k_sum = tl.zeros([BLOCK_D], tl.float32)
        v_sum = tl.zeros([BLOCK_D], tl.float32)
        count = tl.load(evicted_count_ptr + rh)
        if tl.load(moment_rows_ptr + rh // NUM_KV_HEADS) < 0:
            count = count * 0
        for e0 in range(0, count, BLOCK_T):
            e = e0 + tl.arange(0, BLOCK_T)
            ok = e < count
            index = tl.load(evicted_index_ptr + rh * stride_ev_rh + e, mask=ok, other=0)
            src = tl.load(src_tokens_ptr + rh * stride_src_rh + index, mask=ok, other=0)
            mask = ok[:, None] & d_ok[None, :]
            k_src = _token_offsets(src, stride_kb, stride_kh, stride_kt, NUM_KV_HEADS, PAGE_SIZE)
            v_src = _token_offsets(src, stride_vb, stride_vh, stride_vt, NUM_KV_HEADS, PAGE_SIZE)
            k = tl.load(k_ptr + k_src[:, None] + offs_d[None, :] * stride_kd, mask=mask, other=0.0)
            v = tl.load(v_ptr + v_src[:, None] + offs_d[None, :] * stride_vd, mask=mask, other=0.0)
            k_sum += tl.sum(k.to(tl.float32), 0)
            v_sum += tl.sum(v.to(tl.float32), 0)
        n = count.to(tl.float32)
        safe = tl.where(count > 0, n, 1.0)
        tl.store(batch_count_ptr + rh, n)
        tl.store(batch_mean_ptr + rh * 2 * BLOCK_D + offs_d, k_sum / safe)
        tl.store(batch_mean_ptr + rh * 2 * BLOCK_D + BLOCK_D + offs_d, v_sum / safe)

    @triton.jit
    def _fold_cross_cov_kernel(
        k_ptr,
        v_ptr,
        src_tokens_ptr,
        evicted_index_ptr,
        evicted_count_ptr,
        moment_rows_ptr,
        batch_count_ptr,
        batch_mean_ptr,
        count_ptr,
        key_mean_ptr,
        value_mean_ptr,
        cross_cov_ptr,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_vd,
        stride_src_rh,
        stride_ev_rh,
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
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_T: tl.constexpr,
        DIAGONAL: tl.constexpr,
    ):
        """Program ((r, h), block of value dims): the centred cross-covariance of
        the evicted batch, ``C_B = Σ (v - v̄_B)(k - k̄_B)ᵀ`` for ``BLOCK_DV`` rows,
        Chan-merged into the stored rows:
        ``C += C_B + (n_A n_B / n)(v̄_B - v̄_A)(k̄_B - k̄_A)ᵀ``.
        ``DIAGONAL``: the statistics keep only ``C_dd`` (``[N, H, D]``); the block
        is computed whole and its diagonal added.

        Reads the stored means and count and leaves them for the scatter launch
        to update: every program of this grid still needs the old ones.
        """
        rh = tl.program_id(0)
        dv0 = tl.program_id(1) * BLOCK_DV
        row = tl.load(moment_rows_ptr + rh // NUM_KV_HEADS)
        n_b = tl.load(batch_count_ptr + rh)
        if (row < 0) | (n_b == 0):
            return
        head = rh % NUM_KV_HEADS
        row = row.to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = dv0 + tl.arange(0, BLOCK_DV)
        d_ok = offs_d < HEAD_DIM
        dv_ok = offs_dv < HEAD_DIM
        k_mean_b = tl.load(batch_mean_ptr + rh * 2 * BLOCK_D + offs_d)
        v_mean_b = tl.load(batch_mean_ptr + rh * 2 * BLOCK_D + BLOCK_D + offs_dv, mask=dv_ok, other=0.0)
        cov = tl.zeros([BLOCK_DV, BLOCK_D], tl.float32)
        evicted_count = tl.load(evicted_count_ptr + rh)
        for e0 in range(0, evicted_count, BLOCK_T):
            e = e0 + tl.arange(0, BLOCK_T)
            ev = e < evicted_count
            index = tl.load(evicted_index_ptr + rh * stride_ev_rh + e, mask=ev, other=0)
            src = tl.load(src_tokens_ptr + rh * stride_src_rh + index, mask=ev, other=0)
            k_src = _token_offsets(src, stride_kb, stride_kh, stride_kt, NUM_KV_HEADS, PAGE_SIZE)
            v_src = _token_offsets(src, stride_vb, stride_vh, stride_vt, NUM_KV_HEADS, PAGE_SIZE)
            k_mask = ev[:, None] & d_ok[None, :]
            v_mask = dv_ok[:, None] & ev[None, :]
            k = tl.load(k_ptr + k_src[:, None] + offs_d[None, :] * stride_kd, mask=k_mask, other=0.0)
            # V transposed, [BLOCK_DV, BLOCK_T], so the sum over tokens is one dot.
            v_t = tl.load(v_ptr + v_src[None, :] + offs_dv[:, None] * stride_vd, mask=v_mask, other=0.0)
            # Centred before the product (never Σ v kᵀ - n v̄ k̄ᵀ, which cancels);
            # padding lanes contribute exact zeros.
            k_c = tl.where(k_mask, k.to(tl.float32) - k_mean_b[None, :], 0.0)
            v_c = tl.where(v_mask, v_t.to(tl.float32) - v_mean_b[:, None], 0.0)
            cov += tl.dot(v_c, k_c, input_precision="ieee")
        n_a = tl.load(count_ptr + row * stride_cnt_n + head * stride_cnt_h)
        k_mean_a = tl.load(key_mean_ptr + row * stride_km_n + head * stride_km_h + offs_d, mask=d_ok, other=0.0)
        v_mean_a = tl.load(
            value_mean_ptr + row * stride_vm_n + head * stride_vm_h + offs_dv, mask=dv_ok, other=0.0
        )
        weight = n_a * n_b / (n_a + n_b)
        cov += weight * (v_mean_b - v_mean_a)[:, None] * (k_mean_b - k_mean_a)[None, :]
        cov_ptrs = (
            cross_cov_ptr
            + row * stride_cov_n
            + head * stride_cov_h
            + offs_dv[:, None] * stride_cov_r
            + offs_d[None, :] * stride_cov_c
        )
        if DIAGONAL:
            diag = tl.sum(tl.where(offs_dv[:, None] == offs_d[None, :], cov, 0.0), 1)
            diag_ptrs = cross_cov_ptr + row * stride_cov_n + head * stride_cov_h + offs_dv * stride_cov_r
            tl.store(diag_ptrs, tl.load(diag_ptrs, mask=dv_ok, other=0.0) + diag, mask=dv_ok)
        else:
            c_mask = dv_ok[:, None] & d_ok[None, :]
            tl.store(cov_ptrs, tl.load(cov_ptrs, mask=c_mask, other=0.0) + cov, mask=c_mask)

    @triton.jit
    def _fold_means_kernel(
        moment_rows_ptr,
        batch_count_ptr,
        batch_mean_ptr,
        count_ptr,
        key_mean_ptr,
        value_mean_ptr,
        stride_cnt_n,
        stride_cnt_h,
        stride_km_n,
        stride_km_h,
        stride_vm_n,
        stride_vm_h,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Program (r, h): the Chan update of count and means, after the
        cross-covariance launch has read the old ones."""
        rh = tl.program_id(0)
        row = tl.load(moment_rows_ptr + rh // NUM_KV_HEADS)
        n_b = tl.load(batch_count_ptr + rh)
        if (row < 0) | (n_b == 0):
            return
        head = rh % NUM_KV_HEADS
        row = row.to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        count = count_ptr + row * stride_cnt_n + head * stride_cnt_h
        k_mean = key_mean_ptr + row * stride_km_n + head * stride_km_h + offs_d
        v_mean = value_mean_ptr + row * stride_vm_n + head * stride_vm_h + offs_d
        n_a = tl.load(count)
        n = n_a + n_b
        k_mean_b = tl.load(batch_mean_ptr + rh * 2 * BLOCK_D + offs_d)
        v_mean_b = tl.load(batch_mean_ptr + rh * 2 * BLOCK_D + BLOCK_D + offs_d)
        # Same expression as the reference ((n_A a + n_B b) / n) for bitwise-close means.
        tl.store(k_mean, (n_a * tl.load(k_mean, mask=d_ok, other=0.0) + n_b * k_mean_b) / n, mask=d_ok)
        tl.store(v_mean, (n_a * tl.load(v_mean, mask=d_ok, other=0.0) + n_b * v_mean_b) / n, mask=d_ok)
        tl.store(count, n)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def evicted_tokens(
    src_lens: torch.Tensor, keep: torch.Tensor, keep_lens: torch.Tensor, max_live: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The live tokens not kept: ``(index [R, H, max_live], count [R, H])``, int32,
    ``index[r, h, :count[r, h]]`` increasing indices into ``src_tokens[r, h]``.
    Torch ops on small tensors, no host sync."""
    num_requests, num_heads = src_lens.shape
    device = src_lens.device
    positions = torch.arange(max_live, device=device)
    live = positions < src_lens[..., None]
    kept_valid = torch.arange(keep.shape[-1], device=device) < keep_lens[..., None]
    # Padding entries land in a spare last column, dropped after.
    kept = torch.zeros(num_requests, num_heads, max_live + 1, dtype=torch.bool, device=device)
    kept.scatter_(2, torch.where(kept_valid, keep.long(), max_live), True)
    evicted = live & ~kept[..., :max_live]
    rank = torch.cumsum(evicted, dim=-1) - 1
    index = torch.zeros(num_requests, num_heads, max_live + 1, dtype=torch.int32, device=device)
    source = positions.to(torch.int32).expand(num_requests, num_heads, max_live)
    index.scatter_(2, torch.where(evicted, rank, max_live), source)
    return index[..., :max_live], evicted.sum(-1, dtype=torch.int32)


def compact_head_pages(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src_tokens: torch.Tensor,
    src_lens: torch.Tensor,
    keep: torch.Tensor,
    batch: HeadPagedBatch,
) -> None:
    """Compact one eviction in place (see the module docstring); Triton.

    Args:
        key_cache, value_cache: logical ``[num_blocks, H, page_size, D]``, any
            strides (vLLM's ``[num_blocks, page_size, H, D]`` permuted), fp16,
            bf16 or fp32. Kept tokens are copied bit for bit.
        src_tokens: ``[R, H, S_max]`` flat token addresses
            ``(block * H + slot) * page_size + offset`` of the live tokens.
        src_lens: ``[R, H]`` live tokens per head.
        keep: ``[R, H, K_max]`` indices into ``src_tokens[r, h]`` of the kept
            tokens, distinct, in destination order.
        batch: the heads after the eviction: ``head_lens [R, H]`` kept tokens
            per head, ``head_page_table [R, H, P]`` the head-pages receiving
            them, and optionally the moments and each request's row (``-1``:
            evicted tokens are dropped without statistics).

    Launches (no host sync): gather the moving kept tokens to a scratch buffer;
    with moments, the evicted batch's means, then its centred
    cross-covariance merged into ``cross_cov``; scatter the scratch buffer to
    the destinations; with moments, the count/means update. All reads of the
    cache precede the scatter.
    """
    if triton is None:
        raise RuntimeError("compact_head_pages needs triton; use compact_head_pages_reference")
    num_blocks, num_kv_heads, page_size, head_dim = key_cache.shape
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    num_requests, num_heads = src_lens.shape
    if num_heads != num_kv_heads:
        raise ValueError(f"src_lens has {num_heads} heads, the cache {num_kv_heads}")
    if num_requests == 0:
        return
    device = key_cache.device
    # (r, h) rows are flattened: program rh reads row rh of each [R, H, ...] table.
    rows = num_requests * num_heads
    keep_lens = batch.head_lens
    src_tokens = src_tokens.reshape(rows, src_tokens.shape[-1])
    keep_flat = keep.reshape(rows, keep.shape[-1])
    dest = batch.head_page_table.reshape(rows, batch.head_page_table.shape[-1])
    for name, t in (("src_tokens", src_tokens), ("keep", keep_flat), ("dest_page_table", dest)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    keep_lens_flat = keep_lens.reshape(-1).contiguous()
    max_kept = keep_flat.shape[1]
    block_d = _next_power_of_2(head_dim)
    block_t = 32
    strides = (*key_cache.stride(), *value_cache.stride())
    common = dict(NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=block_d)

    scratch_k = torch.empty(rows, max(max_kept, 1), block_d, dtype=key_cache.dtype, device=device)
    scratch_v = torch.empty_like(scratch_k)
    move_grid = (rows, triton.cdiv(max(max_kept, 1), block_t))
    move_args = (
        key_cache,
        value_cache,
        scratch_k,
        scratch_v,
        src_tokens,
        keep_flat,
        keep_lens_flat,
        dest,
        *strides,
        src_tokens.stride(0),
        keep_flat.stride(0),
        dest.stride(0),
        scratch_k.stride(0),
        scratch_k.stride(1),
    )
    _kept_token_kernel[move_grid](*move_args, **common, BLOCK_T=block_t, SCATTER=False, num_warps=4)

    moments = batch.moments if batch.has_moments else None
    moment_rows = batch.moment_rows
    folding = moments is not None
    if folding:
        assert moments is not None and moment_rows is not None
        for name in ("key_mean", "value_mean"):
            if getattr(moments, name).stride(-1) != 1:
                raise ValueError(f"moments.{name} must be contiguous in its last dim")
        evicted_index, evicted_count = evicted_tokens(src_lens, keep, keep_lens, src_tokens.shape[1])
        evicted_index = evicted_index.reshape(rows, -1)
        batch_count = torch.empty(rows, dtype=torch.float32, device=device)
        batch_mean = torch.empty(rows, 2, block_d, dtype=torch.float32, device=device)
        token_args = (src_tokens, evicted_index, evicted_count.reshape(-1), moment_rows)
        _evicted_mean_kernel[(rows,)](
            key_cache,
            value_cache,
            *token_args,
            batch_count,
            batch_mean,
            *strides,
            src_tokens.stride(0),
            evicted_index.stride(0),
            **common,
            BLOCK_T=block_t,
            num_warps=4,
        )
        block_dv = min(32, block_d)
        state = (moments.count, moments.key_mean, moments.value_mean, moments.cross_cov)
        state_strides = (
            moments.count.stride(0),
            moments.count.stride(1),
            moments.key_mean.stride(0),
            moments.key_mean.stride(1),
            moments.value_mean.stride(0),
            moments.value_mean.stride(1),
        )
        covariance = moments.covariance
        cov_strides = (tuple(moments.cross_cov.stride()) + (0,))[:4]
    if folding and covariance != "none":  # the zeroth-order statistics keep no C
        _fold_cross_cov_kernel[(rows, triton.cdiv(head_dim, block_dv))](
            key_cache,
            value_cache,
            *token_args,
            batch_count,
            batch_mean,
            *state,
            *strides,
            src_tokens.stride(0),
            evicted_index.stride(0),
            *state_strides,
            *cov_strides,
            **common,
            BLOCK_DV=block_dv,
            BLOCK_T=block_t,
            DIAGONAL=covariance == "diagonal",
            num_warps=4,
        )

    _kept_token_kernel[move_grid](*move_args, **common, BLOCK_T=block_t, SCATTER=True, num_warps=4)

    if folding:
        _fold_means_kernel[(rows,)](
            moment_rows,
            batch_count,
            batch_mean,
            moments.count,
            moments.key_mean,
            moments.value_mean,
            *state_strides,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            num_warps=4,
        )
