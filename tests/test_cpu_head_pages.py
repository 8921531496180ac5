"""head_pages storage over vLLM's CPU cache: what compaction writes is what
attention and the next compaction read, through vLLM's real page layout."""

import pytest
import torch
from vllm import _custom_ops as ops

from helpers import layout_param

from vllm_kvevict.triton_kernels.head_paged_attention import head_tokens_reference
from vllm_kvevict.eviction.cache_ops import EvictionObserver
from vllm_kvevict.eviction.head_pages import block_head_pages, gather_live, live_addresses, page_tables
from vllm_kvevict.policies.base import PADDING_POSITION
from vllm_kvevict.plugin.backends.cpu.head_pages import HeadPagedCache
from vllm_kvevict.plugin.backends.cpu.page_layout import probe_page_layout


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


@pytest.mark.parametrize("isa", ["vec", layout_param("amx", isa="amx")])
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
    table = page_tables(free, torch.tensor(counts), bs, 8)
    assert table.tolist() == [[*free[:2].tolist(), *[0] * 6], [*free[2:4].tolist(), *[0] * 6], [0] * 8]
    pages = [table[h, : -(-counts[h] // bs)] for h in range(heads)]
    written = [(std_k[h, : counts[h]].clone(), std_v[h, : counts[h]].clone()) for h in range(heads)]
    for h in range(heads):
        cache.write_pages(pages[h], *written[h])
    for h in range(heads):
        k, v = cache.read_pages(pages[h], counts[h])
        assert torch.equal(k, written[h][0]) and torch.equal(v, written[h][1])

    # live tokens: compacted then the standard region [90, 120), padded
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


def test_page_tables_hand_out_the_free_pages_in_stream_order():
    free = torch.tensor([7, 3, 11, 5, 2], dtype=torch.int32)
    table = page_tables(free, torch.tensor([17, 0, 16, 1]), 16, 3)
    assert table.tolist() == [[7, 3, 0], [0, 0, 0], [11, 0, 0], [5, 0, 0]]
    assert table.dtype == torch.int32


@pytest.mark.parametrize("isa", ["vec", layout_param("amx", isa="amx")])
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
    from vllm_kvevict.plugin.backends.cpu.backend import live_block_table

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


# The C++ extension's compaction copies (NativeHeadPagedCache) against the
# per-head torch reads and writes, and both against the logical tokens.


def _native_cache(kv_cache: torch.Tensor, layout) -> "NativeHeadPagedCache":
    from vllm_kvevict import cpu_ops
    from vllm_kvevict.plugin.backends.cpu.head_pages import NativeHeadPagedCache

    module = cpu_ops.load_cpu_ops()
    if module is None:
        pytest.fail("the C++ CPU kernel failed to build; see the warning logged by load_cpu_ops")
    return NativeHeadPagedCache(kv_cache, layout, module=module)


def _laid_out_cache(gen, num_blocks, heads, bs, head_dim, isa, dtype):
    """vLLM's CPU cache of ``dtype`` with random tokens in every slot (written
    by vLLM's op), and those tokens ``[nb, H, bs, D]`` as stored."""
    keys = torch.randn(num_blocks, heads, bs, head_dim, generator=gen).to(dtype)
    values = torch.randn(num_blocks, heads, bs, head_dim, generator=gen).to(dtype)
    kv_cache = torch.zeros(num_blocks, heads, 2 * bs, head_dim, dtype=dtype)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys.permute(0, 2, 1, 3).reshape(-1, heads, head_dim),
        values.permute(0, 2, 1, 3).reshape(-1, heads, head_dim),
        key_cache, value_cache, torch.arange(num_blocks * bs), isa,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
    )
    return kv_cache, keys, values


@pytest.mark.parametrize("isa", ["vec", layout_param("amx", isa="amx")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_native_gather_reads_what_the_per_head_reads_read(isa, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, heads, bs, head_dim = 40, 3, 32, 32  # amx packs bf16 pages of 32 tokens
    kv_cache, keys, values = _laid_out_cache(gen, num_blocks, heads, bs, head_dim, isa, dtype)
    layout = probe_page_layout(bs, head_dim, dtype, isa)
    plain, native = HeadPagedCache(kv_cache, layout), _native_cache(kv_cache, layout)
    # Compacted tokens: each head its own pages (any head-page ids), a random
    # count (none, whole pages, a partial last page), written by the torch path.
    lens = torch.randint(0, 4 * bs, (heads,), generator=gen)
    lens[int(torch.randint(0, heads, (1,), generator=gen))] = 0 if seed == 0 else 2 * bs
    page_ids = torch.randperm(num_blocks * heads, generator=gen)[: 4 * heads].view(heads, 4).to(torch.int32)
    written = []
    for h in range(heads):
        k = torch.randn(int(lens[h]), head_dim, generator=gen).to(dtype)
        v = torch.randn(int(lens[h]), head_dim, generator=gen).to(dtype)
        if lens[h]:
            plain.write_pages(page_ids[h], k, v)
        written.append((k, v))
    block_row = torch.randperm(num_blocks, generator=gen)[:10].to(torch.int32)
    start = int(torch.randint(0, 5 * bs, (1,), generator=gen))
    end = start + int(torch.randint(0, 4 * bs, (1,), generator=gen))
    positions = torch.randint(0, 10_000, (heads, 4 * bs), generator=gen)

    got = gather_live(native, page_ids, lens, positions, block_row, start, end)
    want = gather_live(plain, page_ids, lens, positions, block_row, start, end)
    for field in ("keys", "values", "positions", "live"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    addresses = live_addresses(got, page_ids, lens, block_row, start, end, bs)
    slots = torch.arange(start, end)
    for h in range(heads):  # and the tokens themselves, from what was written
        n = int(lens[h])
        assert torch.equal(got.keys[h, :n], written[h][0]) and torch.equal(got.values[h, :n], written[h][1])
        std_blocks = block_row[slots // bs].long()
        assert torch.equal(got.keys[h, n : n + end - start], keys[std_blocks, h, slots % bs])
        assert torch.equal(got.values[h, n : n + end - start], values[std_blocks, h, slots % bs])
        assert not got.keys[h, n + end - start :].any()
        assert torch.equal(got.positions[h, :n], positions[h, :n])
        assert torch.equal(got.positions[h, n : n + end - start], slots)
        # flat addresses: head-page * bs + offset, compacted pages then the block row's slots
        want_addresses = [int(page_ids[h, j // bs]) * bs + j % bs for j in range(n)]
        want_addresses += [(int(block_row[t // bs]) * heads + h) * bs + t % bs for t in range(start, end)]
        want_addresses += [0] * (got.keys.shape[1] - len(want_addresses))
        assert addresses[h].tolist() == want_addresses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_native_write_writes_what_the_per_head_writes_write(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, heads, bs, head_dim, width = 30, 3, 16, 32, 70
    kv_cache = torch.randn(num_blocks, heads, 2 * bs, head_dim, generator=gen).to(dtype)  # stale bytes
    layout = probe_page_layout(bs, head_dim, dtype, "vec")
    plain_cache = kv_cache.clone()
    plain, native = HeadPagedCache(plain_cache, layout), _native_cache(kv_cache, layout)
    keys = torch.randn(heads, width, head_dim, generator=gen).to(dtype)
    values = torch.randn(heads, width, head_dim, generator=gen).to(dtype)
    counts = torch.randint(0, width + 1, (heads,), generator=gen)
    counts[0] = 2 * bs  # whole pages; the others end part-way through a page (or keep nothing)
    kept = torch.full((heads, int(counts.max())), -1, dtype=torch.int64)
    table = torch.zeros(heads, 6, dtype=torch.int32)
    page_ids = torch.randperm(num_blocks * heads, generator=gen).to(torch.int32)
    used = 0
    for h in range(heads):
        n = int(counts[h])
        kept[h, :n] = torch.randperm(width, generator=gen)[:n].sort().values
        pages = page_ids[used : used + -(-n // bs)]
        used += pages.numel()
        table[h, : pages.numel()] = pages
        if n:
            plain.write_pages(pages, keys[h, kept[h, :n]], values[h, kept[h, :n]])
    native.write_heads(keys, values, kept, counts, table)
    assert torch.equal(kv_cache, plain_cache)


def test_native_copies_refuse_bad_indices_before_copying():
    gen = torch.Generator().manual_seed(0)
    kv_cache, _, _ = _laid_out_cache(gen, 8, 2, 16, 32, "vec", torch.float32)
    native = _native_cache(kv_cache, probe_page_layout(16, 32, torch.float32, "vec"))
    before = kv_cache.clone()
    lens = torch.tensor([20, 0])
    with pytest.raises(RuntimeError, match="head-page id 16"):
        native.read_heads(torch.tensor([[3, 16], [0, 0]], dtype=torch.int32), lens, torch.arange(4, dtype=torch.int32), 0, 10)
    with pytest.raises(RuntimeError, match="block id 9"):
        native.read_heads(torch.zeros(2, 2, dtype=torch.int32), lens, torch.tensor([1, 9], dtype=torch.int32), 0, 20)
    with pytest.raises(RuntimeError, match="outside the block row"):
        native.read_heads(torch.zeros(2, 2, dtype=torch.int32), lens, torch.tensor([1], dtype=torch.int32), 0, 20)
    dense = torch.randn(2, 5, 32)
    kept = torch.tensor([[0, 5], [1, -1]])
    with pytest.raises(RuntimeError, match=r"kept\[0, 1\] = 5 is outside keys' 5 rows"):
        native.write_heads(dense, dense, kept, torch.tensor([2, 1]), torch.tensor([[1], [2]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="head-page id -1"):
        native.write_heads(dense, dense, kept.clamp(max=4), torch.tensor([2, 1]), torch.tensor([[1], [-1]], dtype=torch.int32))
    assert torch.equal(kv_cache, before)


@pytest.mark.parametrize("isa", ["vec", layout_param("amx", isa="amx")])
@pytest.mark.parametrize("seed", range(2))
def test_compaction_through_native_copies_is_the_per_head_compaction(isa, seed):
    """Two compactions of one request (the prompt's end, then a decode-time
    point over the tokens written since) through each cache: the same bytes,
    page tables, positions, lengths and moments, and the kept tokens are the
    logical tokens at their positions."""
    from vllm_kvevict.eviction.allocation import AdaKVAllocation
    from vllm_kvevict.eviction.head_pages import compact_head_pages
    from vllm_kvevict.eviction.point import EvictionPoint, StreamRows
    from vllm_kvevict.eviction.select import KeepRule
    from vllm_kvevict.moments import EvictedMoments
    from vllm_kvevict.policies import ScoringInputs, make_policy

    gen = torch.Generator().manual_seed(seed)
    num_blocks, heads, bs, head_dim = 24, 3, 16, 32
    kv_cache, keys, values = _laid_out_cache(gen, num_blocks, heads, bs, head_dim, isa, torch.float32)
    kv_cache[:, 1, :bs] *= 3.0  # head 1's keys (vec: K pages) apart, so AdaKV splits unevenly
    layout = probe_page_layout(bs, head_dim, torch.float32, isa)
    block_row = torch.randperm(num_blocks, generator=gen)[:9].to(torch.int32)
    rule = KeepRule(make_policy("knorm"), AdaKVAllocation(0.2), 4, 8)

    def inputs(k, v, positions, evicted):
        return ScoringInputs(k, v, positions, None, None, head_dim**-0.5, evicted)

    results = []
    for make in (lambda kv: HeadPagedCache(kv, layout), lambda kv: _native_cache(kv, layout)):
        kv = kv_cache.clone()
        cache = make(kv)
        rows = StreamRows(
            positions=torch.zeros(heads, 128, dtype=torch.int32),
            pages=torch.zeros(heads, 8, dtype=torch.int32),
            lens=torch.zeros(heads, dtype=torch.int32),
            moments=EvictedMoments.zeros(None, heads, head_dim, covariance="full"),
        )
        for ev in (
            EvictionPoint("r", 0, 0, 0, 95, 0, 0, 96, 48, 96, compacts=True),
            EvictionPoint("r", 0, 0, 0, 127, 96, 48, 128, 80, 128, compacts=True, region_start=96),
        ):
            compact_head_pages(cache, rule, ev, rows, block_row, inputs, 0, EvictionObserver())
        results.append((kv, rows))
    (kv_plain, plain), (kv_native, native) = results
    assert torch.equal(kv_native, kv_plain)
    for field in ("positions", "pages", "lens"):
        assert torch.equal(getattr(native, field), getattr(plain, field)), field
    for field in ("count", "key_mean", "value_mean", "cross_cov"):
        assert torch.equal(getattr(native.moments, field), getattr(plain.moments, field)), field
    assert len(set(native.lens.tolist())) > 1
    logical = HeadPagedCache(kv_native, layout)
    slots = torch.arange(128)
    logical_keys = kv_cache.new_empty(heads, 128, head_dim)
    for h in range(heads):
        logical_keys[h] = keys[block_row[slots // bs].long(), h, slots % bs] * (3.0 if h == 1 else 1.0)
    for h in range(heads):
        n = int(native.lens[h])
        got, _ = logical.read_pages(native.pages[h], n)
        assert torch.equal(got, logical_keys[h, native.positions[h, :n].long()])


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_evicted_tokens_are_each_heads_dropped_live_tokens_in_slot_order(native, seed):
    """What a compaction folds into the moments: every live token a head did
    not keep, in slot order, masked past the head's count; with the torch
    selection and with the C++ one."""
    from vllm_kvevict import cpu_ops
    from vllm_kvevict.eviction.head_pages import LiveTokens, evicted_tokens
    from vllm_kvevict.top_k import use_native_selection

    gen = torch.Generator().manual_seed(seed)
    heads, width, dim = 3, 50, 8
    lengths = torch.randint(10, width + 1, (heads,), generator=gen)
    live = torch.arange(width)[None, :] < lengths[:, None]
    tokens = LiveTokens(torch.randn(heads, width, dim, generator=gen), torch.randn(heads, width, dim, generator=gen),
                        torch.where(live, torch.arange(width), PADDING_POSITION), live)
    counts = [int(torch.randint(0, int(n) + 1, (1,), generator=gen)) for n in lengths]
    kept = torch.full((heads, max(counts)), -1)
    for h, (n, c) in enumerate(zip(lengths.tolist(), counts)):
        kept[h, :c] = torch.randperm(n, generator=gen)[:c].sort().values
    use_native_selection(cpu_ops.load_cpu_ops() if native else None)
    try:
        keys, values, mask = evicted_tokens(tokens, kept)
    finally:
        use_native_selection(None)
    for h, n in enumerate(lengths.tolist()):
        dropped = [s for s in range(n) if s not in set(kept[h, : counts[h]].tolist())]
        assert mask[h].sum() == len(dropped) and bool(mask[h, : len(dropped)].all())
        assert torch.equal(keys[h, : len(dropped)], tokens.keys[h, dropped])
        assert torch.equal(values[h, : len(dropped)], tokens.values[h, dropped])
