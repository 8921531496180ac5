"""The C++ CPU kernel and the torch path of ``vllm_kvevict.cpu_ops.head_paged_attention``
against ``head_paged_attention_reference`` (the oracle, on the logical cache).

Each case draws a batch of requests (ragged lengths, decode and prefill
chunks), per-head compacted page tables over head-pages of any slot, standard
regions in vLLM's probed ISA page layouts ("vec", "amx") and MomentKV
summaries, then builds the CPU-layout cache from the logical one: compacted
pages logically, standard pages through the offset tables.

The C++ tests fail when the kernel cannot be built, unless
``KVEVICT_ALLOW_NO_CPU_KERNEL=1``.
"""

from __future__ import annotations

import functools
import math
import os
import dataclasses
from dataclasses import dataclass

import pytest
import torch

from helpers import layout_param
from vllm_kvevict import cpu_ops
from vllm_kvevict.moments import EvictedMoments
from vllm_kvevict.triton_kernels.batch import HeadPagedBatch
from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention_reference
from vllm_kvevict.plugin.backends.cpu.page_layout import PageLayout, probe_page_layout


@pytest.fixture(scope="module")
def native():
    module = cpu_ops.load_cpu_ops()
    if module is None:
        if os.environ.get("KVEVICT_ALLOW_NO_CPU_KERNEL") == "1":
            pytest.skip("the C++ kernel did not build (KVEVICT_ALLOW_NO_CPU_KERNEL=1)")
        pytest.fail("the C++ CPU kernel failed to build; see the warning logged by load_cpu_ops")
    return module


@functools.lru_cache(maxsize=None)
def _layout(page_size: int, head_dim: int, dtype: torch.dtype, isa: str) -> PageLayout:
    """vLLM's probed layout, or ("shuffled") random permutations: any order the
    offset tables describe must work, also for head sizes vLLM has no kernel for."""
    if isa == "shuffled":
        gen = torch.Generator().manual_seed(page_size * 1000 + head_dim)
        size = page_size * head_dim
        return PageLayout(
            torch.randperm(size, generator=gen), torch.randperm(size, generator=gen),
            page_size, head_dim,
        )
    return probe_page_layout(page_size, head_dim, dtype, isa)


@dataclass
class Case:
    query: torch.Tensor
    key_logical: torch.Tensor  # [NB, H, bs, D], the oracle's input
    value_logical: torch.Tensor
    kv_cache: torch.Tensor  # [NB, H, 2 * bs, D], what the kernels read
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    head_page_table: torch.Tensor
    head_lens: torch.Tensor
    block_table: torch.Tensor
    region_start: torch.Tensor
    layout: PageLayout
    scale: float
    summary: EvictedMoments | None
    summary_rows: torch.Tensor | None
    prefix_lens: torch.Tensor | None = None

    def batch(self, **tables: torch.Tensor) -> HeadPagedBatch:
        """The case's batch, with ``tables`` (page table, lengths) replaced."""
        fields = dict(
            head_page_table=self.head_page_table, head_lens=self.head_lens,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_table=self.block_table, region_start=self.region_start,
            moments=self.summary, moment_rows=self.summary_rows, prefix_lens=self.prefix_lens,
        )
        return HeadPagedBatch(**{**fields, **tables})

    def kernel_args(self, **tables: torch.Tensor) -> tuple:
        return (
            self.query, self.kv_cache, self.layout.key_index, self.layout.value_index,
            self.batch(**tables), self.scale,
        )

    def oracle(self) -> tuple[torch.Tensor, torch.Tensor]:
        return head_paged_attention_reference(
            self.query, self.key_logical, self.value_logical, self.batch(), self.scale
        )


def make_case(
    seed: int,
    *,
    queries: list[int],
    seq_lens: list[int],
    region_starts: list[int],
    head_lens: list[list[int]],
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    isa: str = "vec",
    summary: str = "none",  # "none" | "zero" | "random"
    poison: float = float("nan"),
    spare_blocks: int = 3,
    index_dtype: torch.dtype = torch.int32,
    pad_tokens: int = 0,
    prefix_lens: list[int] | None = None,
) -> Case:
    """A batch whose every unreferenced cache element (whole head-pages not in
    any table, standard slots outside ``[region_start, seq_len)`` and the
    protected prefix ``[0, prefix_lens[r])``, compacted page tails past
    ``head_lens``) holds ``poison``, in the logical caches and in the
    CPU-layout cache alike."""
    gen = torch.Generator().manual_seed(seed)
    num_requests = len(queries)
    num_heads = len(head_lens[0])
    bs, dim = page_size, head_dim
    layout = _layout(bs, dim, dtype, isa)
    prefixes = prefix_lens or [0] * num_requests

    # Blocks: each request's standard blocks (its prefix's, then its
    # region's), then blocks whose head-pages the compacted tokens use (any
    # slot for any head), then spare ones.
    std_blocks = [
        list(range(-(-prefix // bs))) + (list(range(start // bs, -(-seq // bs))) if seq > start else [])
        for seq, start, prefix in zip(seq_lens, region_starts, prefixes)
    ]
    compacted_pages = sum(-(-n // bs) for lens in head_lens for n in lens)
    num_std = sum(len(b) for b in std_blocks)
    num_blocks = num_std + -(-compacted_pages // num_heads) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(1, max(-(-s // bs) for s in seq_lens))
    block_table = torch.full((num_requests, max_blocks), -1, dtype=torch.long)
    cursor = 0
    for r, blocks in enumerate(std_blocks):
        for b in blocks:
            block_table[r, b] = perm[cursor]
            cursor += 1
    free_pages = [blk * num_heads + s for blk in perm[cursor:] for s in range(num_heads)]
    free_pages = [free_pages[i] for i in torch.randperm(len(free_pages), generator=gen).tolist()]
    max_pages = max(1, max(-(-n // bs) for lens in head_lens for n in lens))
    head_page_table = torch.full((num_requests, num_heads, max_pages), -1, dtype=torch.long)
    for r in range(num_requests):
        for h in range(num_heads):
            for i in range(-(-head_lens[r][h] // bs)):
                head_page_table[r, h, i] = free_pages.pop()

    shape = (num_blocks, num_heads, bs, dim)
    keys = torch.randn(shape, generator=gen).to(dtype)
    values = torch.randn(shape, generator=gen).to(dtype)
    referenced = torch.zeros(num_blocks * num_heads, bs, dtype=torch.bool)
    for r in range(num_requests):
        for h in range(num_heads):
            n = head_lens[r][h]
            for i in range(-(-n // bs)):
                referenced[int(head_page_table[r, h, i]), : min(bs, n - i * bs)] = True
        for slot in [*range(prefixes[r]), *range(region_starts[r], seq_lens[r])]:
            block = int(block_table[r, slot // bs])
            referenced[block * num_heads : (block + 1) * num_heads, slot % bs] = True
    referenced = referenced.view(num_blocks, num_heads, bs)
    keys[~referenced] = poison
    values[~referenced] = poison

    # The CPU cache: poison everywhere, then compacted head-pages logically and
    # standard head-pages through the ISA offsets.
    kv = torch.full((num_blocks * num_heads, 2 * bs * dim), poison, dtype=dtype)
    flat_k = keys.reshape(num_blocks * num_heads, bs * dim)
    flat_v = values.reshape(num_blocks * num_heads, bs * dim)
    for page in head_page_table[head_page_table >= 0].tolist():
        kv[page, : bs * dim] = flat_k[page]
        kv[page, bs * dim :] = flat_v[page]
    for r in range(num_requests):
        for b in std_blocks[r]:
            block = int(block_table[r, b])
            for h in range(num_heads):
                page = block * num_heads + h
                kv[page, layout.key_index] = flat_k[page]
                kv[page, bs * dim + layout.value_index] = flat_v[page]
    kv_cache = kv.view(num_blocks, num_heads, 2 * bs, dim)

    num_tokens = sum(queries) + pad_tokens
    query = torch.randn(num_tokens, num_heads * group, dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())

    summaries = None
    rows = None
    if summary != "none":
        num_rows = num_requests + 2
        # "random[-diagonal|-none]": the summary's covariance rank (default full).
        covariance = summary.split("-")[1] if "-" in summary else "full"
        summaries = EvictedMoments.zeros(num_rows, num_heads, dim, covariance=covariance)
        row_of = torch.randperm(num_rows, generator=gen)[:num_requests]
        if summary.startswith("random"):
            for r in range(num_requests):
                for h in range(num_heads):
                    n = int(torch.randint(0, 40, (1,), generator=gen))
                    if (r + h) % 3 == 2:
                        n = 0  # a head that has evicted nothing
                    if n:
                        summaries[int(row_of[r]), h].fold_(
                            torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen),
                        )
            if num_requests > 1:
                row_of[-1] = -1  # a request without a summary row
        rows = row_of.to(index_dtype)

    def idx(t: torch.Tensor) -> torch.Tensor:
        return t.to(index_dtype)

    return Case(
        query=query,
        key_logical=keys,
        value_logical=values,
        kv_cache=kv_cache,
        query_start_loc=idx(query_start_loc),
        seq_lens=idx(torch.tensor(seq_lens)),
        head_page_table=idx(head_page_table),
        head_lens=idx(torch.tensor(head_lens)),
        block_table=idx(block_table),
        region_start=idx(torch.tensor(region_starts)),
        layout=layout,
        scale=1.0 / math.sqrt(dim),
        summary=summaries,
        summary_rows=rows,
        prefix_lens=idx(torch.tensor(prefix_lens)) if prefix_lens is not None else None,
    )


def random_batch(
    seed: int, *, num_requests: int, num_heads: int, page_size: int, decode: bool, **kwargs
) -> Case:
    """Ragged requests: compacted lengths from 0 to a few pages (full pages
    included), standard regions from exactly the queries to a few pages,
    region starts anywhere inside a block."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    bs = page_size
    queries, seq_lens, starts, lens = [], [], [], []
    for r in range(num_requests):
        t = 1 if decode else int(torch.randint(1, 3 * bs, (1,), generator=gen))
        extra = int(torch.randint(0, 3 * bs, (1,), generator=gen)) if r % 3 else 0
        start = int(torch.randint(0, 6 * bs, (1,), generator=gen))
        queries.append(t)
        starts.append(start)
        seq_lens.append(start + t + extra)  # extra == 0: region_start = seq_len - T
        head = []
        for h in range(num_heads):
            choice = (r + h + seed) % 4
            if choice == 0:
                head.append(0)
            elif choice == 1:
                head.append(bs * int(torch.randint(1, 4, (1,), generator=gen)))  # full pages
            else:
                head.append(int(torch.randint(1, 4 * bs, (1,), generator=gen)))
        lens.append(head)
    return make_case(
        seed, queries=queries, seq_lens=seq_lens, region_starts=starts, head_lens=lens,
        page_size=page_size, **kwargs,
    )


def check(case: Case, out: torch.Tensor, lse: torch.Tensor) -> None:
    ref_out, ref_lse = case.oracle()
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "unreferenced (NaN) cache elements leaked into out"
    torch.testing.assert_close(out, ref_out, atol=3e-5, rtol=3e-4)
    torch.testing.assert_close(lse, ref_lse, atol=3e-5, rtol=3e-5)


def run_native(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_ops.head_paged_attention(*case.kernel_args(), native=True)


def run_torch(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu_ops.head_paged_attention(*case.kernel_args(), native=False)


# (group, head_dim, page_size, dtype, isa, summary, decode)
SHAPES = [
    (1, 64, 16, torch.float32, "vec", "none", True),
    (2, 64, 32, torch.float32, "vec", "random", False),
    (3, 64, 32, torch.float32, "amx", "random", True),
    (3, 64, 32, torch.bfloat16, "vec", "random", True),
    (3, 64, 32, torch.bfloat16, "amx", "zero", False),
    (4, 128, 16, torch.float32, "vec", "random", False),
    (4, 128, 32, torch.bfloat16, "amx", "random", True),
    (8, 32, 16, torch.float32, "amx", "random", False),
    (8, 128, 32, torch.bfloat16, "vec", "none", False),
    (1, 32, 32, torch.bfloat16, "vec", "random", True),
    (2, 128, 16, torch.float32, "amx", "zero", True),
    (4, 64, 16, torch.float16, "vec", "random", False),
    (2, 80, 16, torch.float32, "shuffled", "random", False),
    (2, 80, 16, torch.bfloat16, "vec16", "random", True),
    (4, 64, 16, torch.float32, "vec", "random-diagonal", True),
    (3, 64, 32, torch.bfloat16, "amx", "random-diagonal", False),
    (2, 80, 16, torch.float32, "shuffled", "random-diagonal", True),
    (2, 128, 32, torch.float32, "vec", "random-none", True),
    (3, 64, 16, torch.bfloat16, "vec", "random-none", False),
]


def _id(shape) -> str:
    g, d, bs, dtype, isa, summary, decode = shape
    kind = "decode" if decode else "prefill"
    return f"G{g}-D{d}-bs{bs}-{str(dtype).split('.')[-1]}-{isa}-{summary}-{kind}"


@pytest.mark.parametrize(
    "shape", [layout_param(shape, isa=shape[4]) if shape[4] == "amx" else shape for shape in SHAPES], ids=_id
)
@pytest.mark.parametrize("path", ["native", "torch"])
def test_matches_reference(shape, path, request):
    group, dim, bs, dtype, isa, summary, decode = shape
    if path == "native":
        request.getfixturevalue("native")
    for seed in range(2):
        case = random_batch(
            seed, num_requests=4, num_heads=3 if group != 8 else 2, page_size=bs, decode=decode,
            group=group, head_dim=dim, dtype=dtype, isa=isa, summary=summary,
        )
        out, lse = run_native(case) if path == "native" else run_torch(case)
        check(case, out, lse)


@pytest.mark.parametrize("isa", ["vec", layout_param("amx", isa="amx")])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_protected_prefix_matches_reference(isa, path, request):
    """A protected prefix (prefix_caching shared): the slots [0, p) of the
    block table, in vLLM's page layout, read by every query before the
    compacted tokens; requests without one (p = 0), a region that starts
    right after it, and one far after it (the blocks between freed: poison)."""
    if path == "native":
        request.getfixturevalue("native")
    bs = 16
    for seed in range(3):
        case = make_case(
            seed, queries=[1, 5, 1, 20], seq_lens=[200, 130, 97, 180],
            region_starts=[150, 64, 90, 100], prefix_lens=[64, 64, 0, 96],
            head_lens=[[40, 0, 77], [16, 33, 5], [0, 0, 0], [100, 3, 48]],
            group=3, head_dim=64, page_size=bs, isa=isa, summary="random",
        )
        out, lse = run_native(case) if path == "native" else run_torch(case)
        check(case, out, lse)
        # the prefix counts: without it the outputs differ
        without = dataclasses.replace(case, prefix_lens=None)
        out_without, _ = run_native(without) if path == "native" else run_torch(without)
        assert not torch.allclose(out_without[:7], out[:7])


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_split_kv_and_tiles(native, threads):
    """Long decode heads split into KV chunks merged by LSE (more threads than
    groups), and prefill chunks of several 32-token query tiles."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decode = make_case(
            1, queries=[1, 1], seq_lens=[700, 40], region_starts=[650, 0],
            head_lens=[[900, 0, 64], [33, 1000, 5]], group=3, head_dim=64, page_size=32,
            summary="random",
        )
        check(decode, *run_native(decode))
        prefill = make_case(
            2, queries=[70, 1, 33], seq_lens=[90, 300, 33], region_starts=[5, 290, 0],
            head_lens=[[100, 0], [300, 31], [0, 16]], group=4, head_dim=64, page_size=16,
            summary="random", dtype=torch.bfloat16, isa="vec",
        )
        check(prefill, *run_native(prefill))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype,isa", [(torch.float32, "vec"), layout_param(torch.bfloat16, "amx", isa="amx")])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_poisoned_unreferenced_elements_never_leak(path, dtype, isa, request):
    """NaN in every head-page no table references, in standard slots before
    region_start and past seq_len, and in compacted page tails past head_lens:
    outputs stay finite and equal the oracle's."""
    if path == "native":
        request.getfixturevalue("native")
    case = make_case(
        3, queries=[1, 4, 1], seq_lens=[75, 40, 33], region_starts=[70, 3, 32],
        head_lens=[[5, 64, 0], [31, 1, 40], [32, 0, 95]], group=3, head_dim=64,
        page_size=32, dtype=dtype, isa=isa, summary="random", spare_blocks=6,
    )
    # The poison really is there: whole spare head-pages, slots outside
    # the regions, page tails.
    assert torch.isnan(case.kv_cache).any()
    out, lse = run_native(case) if path == "native" else run_torch(case)
    check(case, out, lse)


def test_generic_head_dim_int64_indices_and_strided_query(native):
    """A head size with no specialisation (scalar loops), int64 index tensors,
    a query that is a strided view, and padding tokens past the last request
    (0 / -inf like the reference)."""
    case = make_case(
        4, queries=[2, 1], seq_lens=[20, 9], region_starts=[10, 0], head_lens=[[7, 16], [0, 3]],
        group=2, head_dim=24, page_size=16, summary="random", index_dtype=torch.int64,
        pad_tokens=2, isa="shuffled",
    )
    wide = torch.randn(case.query.shape[0], case.query.shape[1], 2 * case.query.shape[2])
    wide[..., : case.query.shape[2]] = case.query
    case.query = wide[..., : case.query.shape[2]]
    assert not case.query.is_contiguous()
    for path in (run_native, run_torch):
        out, lse = path(case)
        check(case, out, lse)
        assert (out[-2:] == 0).all() and torch.isinf(lse[-2:]).all()


def test_heads_with_nothing_to_read(native):
    """region_start == seq_len and no compacted tokens: out 0, lse -inf, unless
    the summary has evicted tokens, which then are the whole softmax."""
    for summary in ("none", "random"):
        case = make_case(
            5, queries=[1, 1], seq_lens=[32, 5], region_starts=[32, 5],
            head_lens=[[0, 0, 0], [0, 3, 0]],
            group=2, head_dim=64, page_size=16, summary=summary,
        )
        for path in (run_native, run_torch):
            out, lse = path(case)
            check(case, out, lse)
        if summary == "none":
            assert torch.isinf(lse[0]).all() and (out[0] == 0).all()


def test_preallocated_outputs_and_bf16_query(native):
    case = random_batch(
        6, num_requests=3, num_heads=2, page_size=32, decode=False, group=2, head_dim=64,
        dtype=torch.bfloat16, summary="random",
    )
    out = torch.full((case.query.shape[0], case.query.shape[1], 64), 7.0)
    lse = torch.full(case.query.shape[:2], 7.0)
    result = cpu_ops.head_paged_attention(*case.kernel_args(), out=out, lse=lse)
    assert result[0] is out and result[1] is lse
    check(case, out, lse)


def test_invalid_inputs_raise(native):
    case = make_case(
        7, queries=[1], seq_lens=[20], region_starts=[10], head_lens=[[5, 16]], group=1,
        head_dim=32, page_size=16,
    )
    bad = case.head_page_table.clone()
    bad[0, 0, 0] = case.kv_cache.shape[0] * case.kv_cache.shape[1]
    with pytest.raises(RuntimeError, match="head-page id"):
        cpu_ops.head_paged_attention(*case.kernel_args(head_page_table=bad))
    bad_lens = torch.tensor([[5, 999]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head_lens"):
        cpu_ops.head_paged_attention(*case.kernel_args(head_lens=bad_lens))


def test_sources_ship_as_package_data():
    """The loader finds the C++ sources through the installed package (CI
    installs non-editable)."""
    from importlib import resources

    for name in ("bindings.cpp", "head_paged_attention.cpp", "compact_head_pages.cpp", "select_top.cpp"):
        assert resources.files("vllm_kvevict.csrc").joinpath(name).is_file()


def test_failed_build_warns_once_and_falls_back(monkeypatch, caplog, tmp_path):
    """A build that fails (here: the compiler "fails") logs one warning with
    the reason and leaves the torch path to answer."""
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension\nfoo.cpp:1:1: error: no compiler today\n")

    monkeypatch.setenv("KVEVICT_CACHE_DIR", str(tmp_path))  # no finished build to load
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setattr(cpp_extension, "load", broken)
    with caplog.at_level("WARNING", logger="vllm_kvevict.cpu_ops"):
        assert cpu_ops.load_cpu_ops() is None
        assert cpu_ops.load_cpu_ops() is None
    warnings = [r for r in caplog.records if r.name == "vllm_kvevict.cpu_ops"]
    assert len(warnings) == 1 and "no compiler today" in warnings[0].getMessage()
    case = random_batch(
        8, num_requests=2, num_heads=2, page_size=16, decode=True, group=2, head_dim=32,
        summary="random",
    )
    check(case, *run_native(case))
