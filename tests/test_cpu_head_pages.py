"""head_pages storage over vLLM's CPU cache: what compaction writes is what
attention and the next compaction read, through vLLM's real page layout."""

import pytest
import torch
from vllm import _custom_ops as ops

from vllm_kvevict.triton_kernels.head_paged_attention import head_tokens_reference
from vllm_kvevict.eviction.head_pages import assign_pages, block_head_pages, gather_live
from vllm_kvevict.policies.base import PADDING_POSITION
from vllm_kvevict.vllm_glue.cpu_head_pages import HeadPagedCache
from vllm_kvevict.vllm_glue.cpu_page_layout import probe_page_layout


def _cpu_cache(logical: torch.Tensor, isa: str):
    """vLLM's CPU cache holding ``logical [nb, H, bs, 2D]``-style K/V written
    through vLLM's own cache-write op (every slot is a standard slot)."""
    keys, values = logical
    num_blocks, heads, bs, head_dim = keys.shape
    kv_cache = torch.zeros(num_blocks, heads, 2 * bs, head_dim)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    slots = torch.arange(num_blocks * bs)
    ops.cpu_attn_reshape_and_cache(
        keys.permute(0, 2, 1, 3).reshape(-1, heads, head_dim),
        values.permute(0, 2, 1, 3).reshape(-1, heads, head_dim),
        key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
    )
    return kv_cache


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("seed", range(3))
def test_compaction_round_trip_and_live_tokens(isa, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, heads, bs, head_dim = 24, 3, 16, 32
    keys = torch.randn(num_blocks, heads, bs, head_dim, generator=gen)
    values = torch.randn(num_blocks, heads, bs, head_dim, generator=gen)
    cache = HeadPagedCache(_cpu_cache((keys, values), isa), probe_page_layout(bs, head_dim, torch.float32, isa))
    block_row = torch.randperm(num_blocks, generator=gen)[:12].to(torch.int32)

    # standard slots read back through the probed layout
    start, end = 21, 75
    std_k, std_v = cache.read_slots(block_row, start, end)
    slots = torch.arange(start, end)
    for h in range(heads):
        assert torch.equal(std_k[h], keys[block_row[slots // bs].long(), h, slots % bs])
        assert torch.equal(std_v[h], values[block_row[slots // bs].long(), h, slots % bs])

    # compact: head 0 keeps 2 pages, head 1 keeps 1 page + 5, head 2 keeps 0,
    # into the head-pages of two blocks (pages of any slot)
    free = block_head_pages(block_row[:2], heads)
    assert free.tolist() == [int(b) * heads + s for b in block_row[:2] for s in range(heads)]
    counts = [2 * bs, bs + 5, 0]
    pages = assign_pages(free, counts, bs)
    assert [p.numel() for p in pages] == [2, 2, 0]
    written = [(std_k[h, : counts[h]].clone(), std_v[h, : counts[h]].clone()) for h in range(heads)]
    for h in range(heads):
        cache.write_pages(pages[h], *written[h])
    for h in range(heads):
        k, v = cache.read_pages(pages[h], counts[h])
        assert torch.equal(k, written[h][0]) and torch.equal(v, written[h][1])

    # live tokens: compacted then the standard region [90, 120), padded
    table = torch.zeros(heads, 8, dtype=torch.int32)
    for h in range(heads):
        table[h, : pages[h].numel()] = pages[h]
    positions = torch.arange(heads * 100).view(heads, 100)
    live = gather_live(cache, table, torch.tensor(counts), positions, block_row, 90, 120)
    for h in range(heads):
        n = counts[h] + 30
        assert bool(live.live[h, :n].all()) and not bool(live.live[h, n:].any())
        assert torch.equal(live.keys[h, : counts[h]], written[h][0])
        assert torch.equal(live.positions[h, counts[h] : n], torch.arange(90, 120))
        assert bool((live.positions[h, n:] == PADDING_POSITION).all())
        # the same tokens through the logical reference's reading rule
        logical = torch.stack([keys, values])[0]
        ref = head_tokens_reference(logical, h, torch.zeros(1, dtype=torch.int32), 0, block_row, 90, 120)
        assert torch.equal(live.keys[h, counts[h] : n], ref)


def test_assign_pages_refuses_more_than_held():
    with pytest.raises(RuntimeError, match="needs 3 head-pages"):
        assign_pages(torch.arange(2, dtype=torch.int32), [16, 17], 16)


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_poison_standard_prefix_hits_only_those_slots(isa):
    num_blocks, heads, bs, head_dim = 4, 2, 16, 32
    keys = torch.randn(num_blocks, heads, bs, head_dim)
    values = torch.randn(num_blocks, heads, bs, head_dim)
    cache = HeadPagedCache(_cpu_cache((keys, values), isa), probe_page_layout(bs, head_dim, torch.float32, isa))
    cache.poison_standard_prefix(2, 5)
    k, v = cache.read_slots(torch.tensor([2], dtype=torch.int32), 0, bs)
    assert bool(torch.isnan(k[:, :5]).all()) and bool(torch.isnan(v[:, :5]).all())
    assert not bool(torch.isnan(k[:, 5:]).any()) and not bool(torch.isnan(v[:, 5:]).any())
    others = torch.cat([cache.kv_cache[:2], cache.kv_cache[3:]])
    assert not bool(torch.isnan(others).any())


@pytest.mark.parametrize("seed", range(4))
def test_live_block_table_drops_the_freed_gap(seed):
    """vLLM's kernel reads a request's live slots ``[0, prefix)`` and
    ``[frontier, n)`` as one sequence: each row keeps its first
    ``prefix_blocks`` columns, then its columns from ``first_blocks`` on."""
    from vllm_kvevict.vllm_glue.cpu_backend import live_block_table

    gen = torch.Generator().manual_seed(seed)
    rows, width = 5, 12
    table = torch.randperm(rows * width, generator=gen).view(rows, width).to(torch.int32)
    prefix_blocks = torch.randint(0, 4, (rows,), generator=gen)
    first_blocks = prefix_blocks + torch.randint(0, 6, (rows,), generator=gen)
    got = live_block_table(table, prefix_blocks, first_blocks)
    for r in range(rows):
        pb, fb = int(prefix_blocks[r]), int(first_blocks[r])
        want = table[r, :pb].tolist() + table[r, fb:].tolist()
        assert got[r, : len(want)].tolist() == want
