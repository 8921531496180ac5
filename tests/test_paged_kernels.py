"""Paged-cache reference ops, the probed CPU page layout, and vLLM's C++ CPU
attention kernel on a frontier-shifted block table."""

import math

import pytest
import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from vllm_kvevict.cpu_ops import region_attention
from vllm_kvevict.triton_kernels.paged_reference import gather_region, region_slots, scatter_region
from vllm_kvevict.plugin.backends.cpu.page_layout import probe_page_layout


def _cdiv(a, b):
    return -(-a // b)


# --------------------------------------------------------------------------- (a)


@pytest.mark.parametrize(
    "num_blocks,heads,block_size,head_dim,length",
    [(10, 2, 4, 8, 13), (6, 1, 8, 4, 8), (20, 3, 16, 8, 33), (5, 4, 2, 2, 1)],
)
def test_scatter_gather_round_trip(num_blocks, heads, block_size, head_dim, length):
    """scatter_region writes token t of head h at (block_ids[t // bs], h, t % bs);
    gather_region reads it back; other slots are untouched."""
    torch.manual_seed(length)
    cache = torch.randn(num_blocks, heads, block_size, head_dim)
    original = cache.clone()
    nb = _cdiv(length, block_size)
    block_ids = torch.randperm(num_blocks)[:nb].to(torch.int32)
    tokens = torch.randn(heads, length, head_dim)
    scatter_region(cache, block_ids, tokens)
    expected = original.clone()
    for h in range(heads):
        for t in range(length):
            expected[int(block_ids[t // block_size]), h, t % block_size] = tokens[h, t]
    assert torch.equal(cache, expected)
    assert torch.equal(gather_region(cache, block_ids, length), tokens)
    block, offset = region_slots(block_ids, length, block_size)
    assert block.tolist() == [int(block_ids[t // block_size]) for t in range(length)]
    assert offset.tolist() == [t % block_size for t in range(length)]


def test_scatter_casts_to_cache_dtype():
    cache = torch.zeros(4, 2, 4, 8, dtype=torch.bfloat16)
    tokens = torch.randn(2, 6, 8)
    ids = torch.tensor([3, 1])
    scatter_region(cache, ids, tokens)
    assert torch.equal(gather_region(cache, ids, 6), tokens.to(torch.bfloat16))


# --------------------------------------------------------------------------- (b)


def _sdpa_full(queries_all, keys, values, scale):
    """Dense causal attention of S queries over S keys; GQA by repeating K/V."""
    num_kv_heads = keys.shape[0]
    group = queries_all.shape[1] // num_kv_heads
    q = queries_all.permute(1, 0, 2)  # [Hq, S, D]
    k = keys.repeat_interleave(group, dim=0)
    v = values.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.permute(1, 0, 2)  # [S, Hq, D]


@pytest.mark.parametrize(
    "kv_heads,group,seq_len,num_tokens,head_dim",
    [(2, 2, 17, 17, 8), (1, 4, 9, 3, 16), (3, 1, 30, 1, 8), (2, 3, 12, 5, 4)],
)
def test_region_attention_equals_sdpa_at_start(kv_heads, group, seq_len, num_tokens, head_dim):
    """region_start=0 over the whole sequence: the last T rows of dense causal SDPA."""
    torch.manual_seed(seq_len * 7 + num_tokens)
    queries_all = torch.randn(seq_len, kv_heads * group, head_dim, dtype=torch.float64)
    keys = torch.randn(kv_heads, seq_len, head_dim, dtype=torch.float64)
    values = torch.randn(kv_heads, seq_len, head_dim, dtype=torch.float64)
    scale = 1 / math.sqrt(head_dim)
    want = _sdpa_full(queries_all, keys, values, scale)[seq_len - num_tokens :]
    got = region_attention(queries_all[seq_len - num_tokens :], keys, values, 0, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kv_heads,group,region_start,length,num_tokens",
    [(2, 2, 16, 20, 6), (1, 3, 32, 7, 7), (2, 1, 8, 40, 1), (3, 2, 64, 33, 12)],
)
def test_region_attention_with_offset_matches_explicit_mask(kv_heads, group, region_start, length, num_tokens):
    """region_start > 0: key slot s (absolute) is visible to query position q iff s <= q."""
    torch.manual_seed(region_start + length)
    head_dim = 8
    seq_len = region_start + length
    num_q_heads = kv_heads * group
    query = torch.randn(num_tokens, num_q_heads, head_dim)
    keys = torch.randn(kv_heads, length, head_dim)
    values = torch.randn(kv_heads, length, head_dim)
    scale = 0.3
    mask = torch.zeros(num_tokens, length, dtype=torch.bool)
    for t in range(num_tokens):
        q_pos = seq_len - num_tokens + t
        for j in range(length):
            mask[t, j] = region_start + j <= q_pos
    want = torch.empty(num_tokens, num_q_heads, head_dim)
    for j in range(num_q_heads):
        h = j // group
        want[:, j] = F.scaled_dot_product_attention(
            query[:, j][None], keys[h][None], values[h][None], attn_mask=mask[None], scale=scale
        )[0]
    got = region_attention(query, keys, values, region_start, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- (c)

ISA = _get_attn_isa(torch.float32, 32, 64, "auto")


def _make_cache(num_blocks, heads, block_size, head_dim, dtype=torch.float32):
    kv = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv.view(num_blocks, heads, block_size * 2, head_dim).chunk(2, dim=2)
    return kv, key_cache, value_cache


def _write(key_cache, value_cache, keys, values, block_ids, start, block_size, isa=ISA):
    """Write tokens [H, L, D] into slots [start, start + L) of a block-table row via vLLM's op."""
    length = keys.shape[1]
    slots = torch.arange(start, start + length)
    slot_mapping = block_ids[slots // block_size].long() * block_size + slots % block_size
    ops.cpu_attn_reshape_and_cache(
        keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous(),
        key_cache, value_cache, slot_mapping, isa,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
    )


LAYOUT_CASES = [(torch.float32, bs, d) for bs in (32, 64) for d in (32, 64, 128)] + [
    (torch.bfloat16, 32, 64),
    (torch.bfloat16, 64, 128),
    (torch.float16, 32, 32),
]


@pytest.mark.parametrize("dtype,block_size,head_dim", LAYOUT_CASES)
def test_probed_layout_reads_back_written_tokens(dtype, block_size, head_dim):
    """Tokens written by cpu_attn_reshape_and_cache come back in logical order via read_pages."""
    torch.manual_seed(block_size + head_dim)
    isa = _get_attn_isa(dtype, block_size, head_dim, "auto")
    layout = probe_page_layout(block_size, head_dim, dtype, isa)
    heads, num_blocks = 3, 9
    kv, key_cache, value_cache = _make_cache(num_blocks, heads, block_size, head_dim, dtype)
    length = 2 * block_size + 5
    block_ids = torch.randperm(num_blocks)[: _cdiv(length, block_size)].to(torch.int32)
    keys = torch.randn(heads, length, head_dim).to(dtype)
    values = torch.randn(heads, length, head_dim).to(dtype)
    _write(key_cache, value_cache, keys, values, block_ids, 0, block_size, isa)
    got_k = layout.read_pages(key_cache, block_ids, is_key=True)
    got_v = layout.read_pages(value_cache, block_ids, is_key=False)
    assert got_k.shape == (heads, len(block_ids) * block_size, head_dim)
    assert torch.equal(got_k[:, :length], keys)
    assert torch.equal(got_v[:, :length], values)
    # unwritten tail slots stay zero; read_pages of one block alone agrees too
    assert not got_k[:, length:].any() and not got_v[:, length:].any()
    one = layout.read_pages(key_cache, block_ids[1:2], is_key=True)
    assert torch.equal(one, keys[:, block_size : 2 * block_size])


# --------------------------------------------------------------------------- (d)


def _native_attention(query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale,
                      num_kv_heads, split_kv):
    num_tokens, num_heads, head_dim = query.shape
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=ISA,
        enable_kv_split=split_kv,
        dynamic_causal=None,
        kv_cache_dtype="auto",
    )
    output = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=0,
        scheduler_metadata=metadata,
        s_aux=None,
        dynamic_causal=None,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    return output


NATIVE_CASES = [
    # (block_size, head_dim, kv_heads, group, [(seq_len, frontier, num_query_tokens), ...])
    (32, 64, 2, 2, [(200, 96, 40), (71, 32, 1), (40, 0, 40)]),
    (32, 32, 1, 4, [(129, 64, 1), (300, 224, 13), (33, 0, 1)]),
    (64, 128, 2, 1, [(500, 320, 1), (128, 64, 64)]),
    (32, 64, 4, 2, [(96, 64, 32), (65, 32, 1), (257, 128, 100)]),
]


@pytest.mark.parametrize("split_kv", [False, True])
@pytest.mark.parametrize("case", range(len(NATIVE_CASES)))
def test_native_kernel_on_shifted_table_equals_reference(case, split_kv):
    """vLLM's C++ CPU attention over [frontier, seq_len) via a block table shifted by
    frontier // bs equals region_attention over the same live region."""
    block_size, head_dim, kv_heads, group, requests = NATIVE_CASES[case]
    torch.manual_seed(case * 10 + split_kv)
    num_q_heads = kv_heads * group
    max_blocks = max(_cdiv(s, block_size) for s, _, _ in requests) + 2
    num_blocks = sum(_cdiv(s, block_size) for s, _, _ in requests) + 4
    kv, key_cache, value_cache = _make_cache(num_blocks, kv_heads, block_size, head_dim)
    # block 0 is vLLM's null block; hand the rest out at random
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    shifted = torch.zeros_like(table)
    queries, live, lens, starts = [], [], [], [0]
    scale = 1 / math.sqrt(head_dim)
    for i, (seq_len, frontier, num_tokens) in enumerate(requests):
        assert frontier % block_size == 0 and seq_len - num_tokens >= frontier
        nb = _cdiv(seq_len, block_size)
        row = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        table[i, :nb] = row
        # Evicted slots below the frontier hold garbage that must never be read.
        garbage = torch.full((kv_heads, frontier, head_dim), 1e4)
        if frontier:
            _write(key_cache, value_cache, garbage, garbage, row, 0, block_size)
        keys = torch.randn(kv_heads, seq_len - frontier, head_dim)
        values = torch.randn(kv_heads, seq_len - frontier, head_dim)
        _write(key_cache, value_cache, keys, values, row, frontier, block_size)
        live.append((keys, values, frontier))
        # the shifted row, as KVEvictCPUMetadataBuilder.build makes it
        cols = (torch.arange(max_blocks) + frontier // block_size).clamp(max=max_blocks - 1)
        shifted[i] = table[i, cols]
        lens.append(seq_len - frontier)
        queries.append(torch.randn(num_tokens, num_q_heads, head_dim))
        starts.append(starts[-1] + num_tokens)
    query = torch.cat(queries)
    out = _native_attention(
        query, key_cache, value_cache,
        torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
        shifted, scale, kv_heads, split_kv,
    )
    assert torch.isfinite(out).all()
    layout = probe_page_layout(block_size, head_dim, torch.float32, ISA)
    for i, (keys, values, frontier) in enumerate(live):
        want = region_attention(queries[i], keys, values, frontier, scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], want, atol=1e-4, rtol=1e-4)
        # the attention_kernel="torch" path reads the same live region through the layout
        seq_len = frontier + keys.shape[1]
        row = table[i, frontier // block_size : _cdiv(seq_len, block_size)]
        assert torch.equal(layout.read_pages(key_cache, row, True)[:, : keys.shape[1]], keys)
        assert torch.equal(layout.read_pages(value_cache, row, False)[:, : keys.shape[1]], values)
