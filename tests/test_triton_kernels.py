"""Every Triton kernel against its torch reference, on fresh random inputs.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``
on CPU tensors). Triton reads that variable when ``@triton.jit`` decorates a
function: for our kernels when their modules are imported, for triton's own
library (``tl.sum``, ``tl.zeros``...) when ``triton`` is first imported. So it
is set by ``triton_mode`` before any import of triton; if another test module imported
triton first (vLLM does), this file cannot interpret in this process and
``test_kernels_in_fresh_process`` runs it in a new one instead. On a machine
with CUDA (and ``TRITON_INTERPRET`` unset) the same tests run the compiled
kernels on the GPU.

Unreferenced cache slots hold NaN: a kernel that reads one, or lets a masked
lane leak into a sum, fails the comparison and the NaN checks.

Caches come in four layouts: contiguous, a padded permuted view, and the two
per-layer views vLLM 0.32 binds to an attention layer (``LBHNC`` and
``LBNHC``: one int8 buffer for every layer, a layer's logical
``[num_blocks, H, page_size, 2D]`` view with key and value side by side in the
last dim, split into strided key and value views).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from paged_layout import poisoned_cache, random_paged_layout
from triton_mode import DEVICE, INTERPRET, run_in_fresh_process, skip_unless

from vllm_kvevict.moments import EvictedMoments  # noqa: E402
from vllm_kvevict.triton_kernels import compact_head_pages as chp  # noqa: E402
from vllm_kvevict.triton_kernels import head_paged_attention as hpa  # noqa: E402
from vllm_kvevict.triton_kernels.batch import HeadPagedBatch  # noqa: E402

@pytest.fixture(autouse=True)
def _interpretable(request: pytest.FixtureRequest) -> None:
    skip_unless(request, "test_kernels_in_fresh_process")


def test_kernels_in_fresh_process() -> None:
    """This file in a new interpreter, when this one imported triton too early."""
    # Only the check against vLLM's own views may skip (without vLLM).
    allowed = 0 if importlib.util.find_spec("vllm") is not None else 1
    print(run_in_fresh_process(__file__, "test_kernels_in_fresh_process", allowed))


POISON = float("nan")


VLLM_LAYOUTS = ("LBHNC", "LBNHC")
# Logical axes [L, B, H, N, C] in physical order (vllm/v1/kv_cache_layout.py).
_STRIDE_ORDER = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4)}


def vllm_layer_kv_cache(
    raw: torch.Tensor | None,
    num_blocks: int,
    heads: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    layout: str,
    *,
    num_layers: int = 2,
    layer: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(raw, key, value)``: layer ``layer``'s key and value views as vLLM 0.32
    builds them (``create_kv_cache_views`` with the strides of
    ``compute_layout_strides`` for a layer-outermost layout, then
    ``kv_cache.split(head_dim, dim=-1)``). ``raw``: the int8 buffer of all
    layers (None: a new one, NaN everywhere)."""
    element = torch.empty((), dtype=dtype).element_size()
    shape = (num_layers, num_blocks, heads, page_size, 2 * head_dim * element)  # C in bytes
    strides = [0] * 5
    stride = 1
    for dim in reversed(_STRIDE_ORDER[layout]):
        strides[dim] = stride
        stride *= shape[dim]
    if raw is None:
        raw = torch.empty(stride, dtype=torch.int8, device=DEVICE)
        raw.view(dtype).fill_(POISON)
    kv_cache = torch.as_strided(raw, shape, strides, raw.storage_offset())[layer].view(dtype)
    key, value = kv_cache.split(head_dim, dim=-1)
    return raw, key, value


def _empty_kv(
    num_blocks: int, heads: int, page_size: int, head_dim: int, dtype: torch.dtype, strided: bool | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """NaN-filled ``(key, value, raw)`` caches: ``strided`` False (contiguous),
    True (padded permuted views, ``raw`` None) or a vLLM layout name (views of
    one buffer of two layers, ``raw`` that buffer)."""
    if isinstance(strided, str):
        raw, key, value = vllm_layer_kv_cache(None, num_blocks, heads, page_size, head_dim, dtype, strided)
        return key, value, raw
    key = poisoned_cache(num_blocks, heads, page_size, head_dim, dtype, strided, DEVICE)
    value = poisoned_cache(num_blocks, heads, page_size, head_dim, dtype, strided, DEVICE)
    return key, value, None


def _random_summary(gen: torch.Generator, rows: int, heads: int, head_dim: int, mode: str) -> EvictedMoments:
    """``mode``: "zero" (nothing evicted yet) or "random" (some heads empty),
    with "-diagonal" or "-none" for a reduced covariance (default full)."""
    mode, _, covariance = mode.partition("-")
    summary = EvictedMoments.zeros(rows, heads, head_dim, device=DEVICE, covariance=covariance or "full")
    if mode == "random":
        count = torch.randint(0, 40, (rows, heads), generator=gen).float()
        count[torch.rand(rows, heads, generator=gen) < 0.25] = 0.0
        nonempty = (count > 0).float()
        summary.count.copy_(count)
        summary.key_mean.copy_(torch.randn(rows, heads, head_dim, generator=gen) * nonempty[..., None])
        summary.value_mean.copy_(torch.randn(rows, heads, head_dim, generator=gen) * nonempty[..., None])
        cov = torch.randn(rows, heads, head_dim, head_dim, generator=gen) * 0.05 * count[..., None, None]
        if covariance == "diagonal":
            cov = cov.diagonal(dim1=-2, dim2=-1)
        if covariance != "none":
            summary.cross_cov.copy_(cov)
    return summary


# --------------------------------------------------------------------------- attention


@dataclass
class AttentionCase:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    head_page_table: torch.Tensor
    head_lens: torch.Tensor
    block_table: torch.Tensor
    region_start: torch.Tensor
    scale: float
    summary: EvictedMoments | None
    summary_rows: torch.Tensor | None
    prefix_lens: torch.Tensor | None = None

    def args(self):
        batch = HeadPagedBatch(
            self.head_page_table,
            self.head_lens,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.region_start,
            self.summary,
            self.summary_rows,
            self.prefix_lens,
        )
        return self.query, self.key_cache, self.value_cache, batch, self.scale


def make_attention_case(
    seed: int,
    *,
    heads: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    requests: list[tuple[int, int, int]],
    summary: str,
    strided: bool | str,
    max_compacted: int,
    prefixes: list[int] | None = None,
) -> AttentionCase:
    """``requests``: ``(query_len, region_start, seq_len)`` each. Compacted
    lengths are random in ``[0, max_compacted]`` and include a zero and a
    whole number of pages; every page no table points to is NaN.
    ``prefixes``: each request's protected prefix, slots ``[0, p)`` (whole pages)."""
    gen = torch.Generator().manual_seed(seed)
    num_requests = len(requests)
    layout = random_paged_layout(
        gen, requests=[(start, seq_len) for _, start, seq_len in requests], heads=heads,
        page_size=page_size, max_compacted=max_compacted, prefixes=prefixes,
    )
    head_lens = layout.head_lens
    key_cache, value_cache, _ = _empty_kv(layout.num_blocks, heads, page_size, head_dim, dtype, strided)
    for block, head, offsets in layout.writes:
        n = len(range(page_size)[offsets])
        for cache in (key_cache, value_cache):
            cache[block, head, offsets] = torch.randn(n, head_dim, generator=gen).to(dtype).to(DEVICE)

    query_lens = [q for q, _, _ in requests]
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, heads * group, head_dim, generator=gen).to(dtype)
    summary_state = summary_rows = None
    if summary != "none":
        summary_state = _random_summary(gen, num_requests + 1, heads, head_dim, summary)
        rows = torch.randperm(num_requests + 1, generator=gen)[:num_requests]
        rows[torch.rand(num_requests, generator=gen) < 0.25] = -1
        summary_rows = rows.to(torch.int32).to(DEVICE)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return AttentionCase(
        query=to(query),
        key_cache=key_cache,
        value_cache=value_cache,
        query_start_loc=to(query_start_loc),
        seq_lens=to(torch.tensor([s for _, _, s in requests], dtype=torch.int32)),
        head_page_table=to(layout.head_page_table),
        head_lens=to(head_lens.to(torch.int32)),
        block_table=to(layout.block_table),
        region_start=to(torch.tensor([s for _, s, _ in requests], dtype=torch.int32)),
        scale=1.0 / math.sqrt(head_dim),
        summary=summary_state,
        summary_rows=summary_rows,
        prefix_lens=to(torch.tensor(prefixes, dtype=torch.int32)) if prefixes is not None else None,
    )


ATTENTION_CASES = {
    # name: (heads, group, head_dim, page_size, dtype, requests, summary, strided, max_compacted, splits)
    "decode-g1-d64-fp32-summary-strided": (
        2, 1, 64, 16, torch.float32, [(1, 16, 21), (1, 0, 7), (1, 40, 64), (1, 5, 40)], "random", True, 40, 1,
    ),
    "decode-g4-d128-ps32-bf16-zero-summary": (
        2, 4, 128, 32, torch.bfloat16, [(1, 32, 35), (1, 10, 75), (1, 64, 65)], "zero", False, 70, 1,
    ),
    "prefill-ragged-g2-d64-fp32": (
        2, 2, 64, 16, torch.float32, [(5, 16, 30), (1, 3, 20), (0, 8, 9), (9, 0, 9)], "random", False, 33, 1,
    ),
    "prefill-g8-d128-bf16-strided": (
        1, 8, 128, 16, torch.bfloat16, [(3, 20, 40), (7, 32, 48)], "none", True, 32, 1,
    ),
    "mixed-g3-d64-ps32-fp32-splits": (
        2, 3, 64, 32, torch.float32, [(1, 64, 100), (6, 30, 60), (1, 0, 2)], "random", True, 96, 3,
    ),
    "decode-g4-d128-fp32-splits": (
        1, 4, 128, 16, torch.float32, [(1, 80, 150), (1, 120, 121)], "random", False, 160, 4,
    ),
    "decode-g2-d32-fp16-splits": (
        2, 2, 32, 16, torch.float16, [(1, 33, 40), (1, 16, 100)], "random", False, 48, 5,
    ),
    "mixed-g2-d64-fp32-diagonal-summary-splits": (
        2, 2, 64, 16, torch.float32, [(1, 40, 70), (5, 16, 30)], "random-diagonal", True, 40, 2,
    ),
    "decode-g4-d128-bf16-no-covariance-summary": (
        2, 4, 128, 32, torch.bfloat16, [(1, 32, 35), (1, 10, 75)], "random-none", False, 70, 1,
    ),
    # The tiny test model's shape (D 32, two query heads per KV head, fp32 blocks of 32).
    "decode-g2-d32-ps32-fp32-summary-strided": (
        4, 2, 32, 32, torch.float32, [(1, 40, 75), (1, 0, 33), (1, 128, 160), (1, 7, 300)], "random", True, 128, 1,
    ),
    "prefill-g2-d32-ps32-fp32-summary-splits": (
        4, 2, 32, 32, torch.float32, [(40, 96, 200), (1, 128, 129), (17, 3, 60)], "random", True, 128, 3,
    ),
}


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_head_paged_attention_matches_reference(name: str) -> None:
    heads, group, head_dim, page_size, dtype, requests, summary, strided, max_compacted, splits = ATTENTION_CASES[name]
    case = make_attention_case(
        sum(map(ord, name)),
        heads=heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        requests=requests,
        summary=summary,
        strided=strided,
        max_compacted=max_compacted,
    )
    out, lse = hpa.head_paged_attention(*case.args(), num_splits=splits)
    ref_out, ref_lse = hpa.head_paged_attention_reference(*case.args())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isfinite(lse).all()  # every query here reads something
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)


SWEEP = [(g, d, ps) for g in (1, 2, 3, 4, 8) for d in (64, 128) for ps in (16, 32)]


@pytest.mark.parametrize("group,head_dim,page_size", SWEEP)
def test_head_paged_attention_sweep(group: int, head_dim: int, page_size: int) -> None:
    """Random batches over the GQA x head size x page size grid: three requests
    mixing decode and prefill chunks at random region starts, fp32 and bf16,
    contiguous and strided caches, with and without splits."""
    index = SWEEP.index((group, head_dim, page_size))  # varies dtype, summary, layout, splits
    seed = 1000 + index
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(3):
        start = int(torch.randint(0, 3 * page_size, (1,), generator=gen))
        query_len = 1 if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(2, 12, (1,), generator=gen))
        seq_len = start + query_len + int(torch.randint(0, 2 * page_size, (1,), generator=gen))
        requests.append((query_len, start, seq_len))
    dtype = (torch.float32, torch.bfloat16)[index % 2]
    case = make_attention_case(
        seed, heads=2, group=group, head_dim=head_dim, page_size=page_size, dtype=dtype,
        requests=requests, summary=("random", "zero", "none")[index % 3], strided=bool(index // 2 % 2),
        max_compacted=2 * page_size + 5,
    )
    out, lse = hpa.head_paged_attention(*case.args(), num_splits=1 + index % 3)
    ref_out, ref_lse = hpa.head_paged_attention_reference(*case.args())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)


@pytest.mark.parametrize("strided", [False, True])
def test_head_paged_attention_reads_the_protected_prefix(strided: bool) -> None:
    """A protected prefix (whole pages at the start of the block table, seen
    by every query; the slots between it and the region freed, NaN) folded
    into the page tables: the kernel equals the reference, which reads it as
    standard slots, and differs from reading without it."""
    case = make_attention_case(
        11, heads=2, group=3, head_dim=64, page_size=16, dtype=torch.float32,
        requests=[(1, 80, 130), (4, 32, 60), (1, 40, 70)], summary="random", strided=strided,
        max_compacted=50, prefixes=[32, 32, 0],
    )
    out, lse = hpa.head_paged_attention(*case.args(), num_splits=2)
    ref_out, ref_lse = hpa.head_paged_attention_reference(*case.args())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    case.prefix_lens = None
    assert not torch.allclose(hpa.head_paged_attention(*case.args(), num_splits=2)[0][:5], out[:5])


def test_head_paged_attention_splits_agree() -> None:
    """The flash-decoding split changes the summation order only."""
    case = make_attention_case(
        7, heads=2, group=2, head_dim=64, page_size=16, dtype=torch.float32,
        requests=[(1, 48, 130), (2, 20, 50)], summary="random", strided=False, max_compacted=100,
    )
    out_1, lse_1 = hpa.head_paged_attention(*case.args(), num_splits=1)
    out_4, lse_4 = hpa.head_paged_attention(*case.args(), num_splits=4)
    torch.testing.assert_close(out_4, out_1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_4, lse_1, atol=1e-5, rtol=1e-5)


def test_head_paged_attention_unowned_rows_and_summary_only() -> None:
    """Tokens past ``query_start_loc[-1]`` (padding) give ``(0, -inf)``; a query
    placed before its region (nothing in the standard region visible) and with
    no compacted tokens reads only the summary, whose state is returned as is."""
    heads, head_dim, page_size = 1, 32, 16
    key_cache = poisoned_cache(2, heads, page_size, head_dim, torch.float32, False, DEVICE)
    value_cache = poisoned_cache(2, heads, page_size, head_dim, torch.float32, False, DEVICE)
    key_cache[0, 0, :4] = torch.randn(4, head_dim, device=DEVICE)
    value_cache[0, 0, :4] = torch.randn(4, head_dim, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    summary = _random_summary(gen, 1, heads, head_dim, "random")
    summary.count.fill_(5.0)
    query = torch.randn(4, heads, head_dim, device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    batch = HeadPagedBatch(
        head_page_table=torch.full((1, heads, 1), 3, **i32),
        head_lens=torch.zeros(1, heads, **i32),
        query_start_loc=torch.tensor([0, 3], **i32),  # token 3 belongs to no request
        seq_lens=torch.tensor([4], **i32),
        block_table=torch.tensor([[0, 1]], **i32),
        region_start=torch.tensor([2], **i32),  # region [2, 4): the first query (position 1) sees none of it
        moments=summary,
        moment_rows=torch.zeros(1, **i32),
    )
    args = (query, key_cache, value_cache, batch, 0.3)
    for splits in (1, 2):
        out, lse = hpa.head_paged_attention(*args, num_splits=splits)
        ref_out, ref_lse = hpa.head_paged_attention_reference(*args)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[3], torch.zeros_like(out[3])) and lse[3].item() == float("-inf")
        assert not torch.isnan(out).any()


# --------------------------------------------------------------------------- compaction


@dataclass
class CompactionCase:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    src_tokens: torch.Tensor
    src_lens: torch.Tensor
    keep: torch.Tensor
    keep_lens: torch.Tensor
    dest_page_table: torch.Tensor
    summary: EvictedMoments | None
    summary_rows: torch.Tensor | None
    raw: torch.Tensor | None = None  # vLLM layouts: the buffer of every layer
    layout: str | None = None

    def clone(self) -> CompactionCase:
        summary = None
        if self.summary is not None:
            s = self.summary
            summary = EvictedMoments(s.count.clone(), s.key_mean.clone(), s.value_mean.clone(), s.cross_cov.clone())
        raw = None
        if self.raw is not None:
            assert self.layout is not None
            num_blocks, heads, page_size, head_dim = self.key_cache.shape
            raw, key_cache, value_cache = vllm_layer_kv_cache(
                self.raw.clone(), num_blocks, heads, page_size, head_dim, self.key_cache.dtype, self.layout
            )
        else:
            key_cache, value_cache = _clone_strided(self.key_cache), _clone_strided(self.value_cache)
        return CompactionCase(
            key_cache,
            value_cache,
            self.src_tokens,
            self.src_lens,
            self.keep,
            self.keep_lens,
            self.dest_page_table,
            summary,
            self.summary_rows,
            raw,
            self.layout,
        )

    def args(self):
        after = HeadPagedBatch(
            self.dest_page_table, self.keep_lens, moments=self.summary, moment_rows=self.summary_rows
        )
        return self.key_cache, self.value_cache, self.src_tokens, self.src_lens, self.keep, after


def _clone_strided(cache: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (a permuted view stays a permuted view)."""
    return torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=cache.device).copy_(cache)


def make_compaction_case(
    seed: int,
    *,
    heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    live_lens: list[list[int]],
    summary: str,
    strided: bool | str,
    keep_all: bool = False,
) -> CompactionCase:
    """Each request's heads hold their live tokens in pages of the request's
    blocks (a head's first page may start mid-page, like a standard region).
    Head 0 of each request compacts in place into its own source pages and
    keeps a prefix (tokens that do not move); the other heads take random
    pages of the request, usually other heads' sources. Keep counts cover
    none, some and all of the live tokens."""
    gen = torch.Generator().manual_seed(seed)
    num_requests = len(live_lens)
    starts = [[int(torch.randint(0, page_size, (1,), generator=gen)) if n else 0 for n in row] for row in live_lens]
    pages_per_head = [[-(-(s + n) // page_size) for s, n in zip(sr, nr)] for sr, nr in zip(starts, live_lens)]
    blocks_per_request = [-(-sum(p) // heads) + 1 for p in pages_per_head]
    num_blocks = sum(blocks_per_request) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    key_cache, value_cache, raw = _empty_kv(num_blocks, heads, page_size, head_dim, dtype, strided)

    max_live = max(max(r) for r in live_lens)
    max_pages = max(max(p) for p in pages_per_head)
    src_tokens = torch.full((num_requests, heads, max(max_live, 1)), -7, dtype=torch.int64)
    keep = torch.full((num_requests, heads, max(max_live, 1)), -3, dtype=torch.int32)
    keep_lens = torch.zeros(num_requests, heads, dtype=torch.int32)
    dest_page_table = torch.full((num_requests, heads, max(max_pages, 1)), -5, dtype=torch.int32)
    for r in range(num_requests):
        first_block = sum(blocks_per_request[:r])
        blocks = order[first_block : first_block + blocks_per_request[r]]
        pool = [b * heads + s for b in blocks for s in range(heads)]
        pool = [pool[i] for i in torch.randperm(len(pool), generator=gen).tolist()]
        sources = []
        for h in range(heads):
            pages = [pool.pop() for _ in range(pages_per_head[r][h])]
            sources.append(pages)
            n, s = live_lens[r][h], starts[r][h]
            flat = torch.tensor([p * page_size + o for p in pages for o in range(page_size)], dtype=torch.int64)
            flat = flat[s : s + n]
            src_tokens[r, h, :n] = flat
            for cache in (key_cache, value_cache):
                block, slot, offset = flat // page_size // heads, flat // page_size % heads, flat % page_size
                cache[block, slot, offset] = torch.randn(n, head_dim, generator=gen).to(dtype).to(DEVICE)
            # Kept: none, all, or a random subset (head 0: a prefix plus a random rest).
            choice = 1 if keep_all else (r + h) % 4
            if choice == 0 and h != 0:
                kept = torch.zeros(0, dtype=torch.int64)
            elif choice == 1:
                kept = torch.arange(n)
            else:
                mask = torch.rand(n, generator=gen) < 0.6
                if h == 0:
                    mask[: n // 3] = True
                kept = torch.nonzero(mask).flatten()
            keep[r, h, : len(kept)] = kept.to(torch.int32)
            keep_lens[r, h] = len(kept)
        # Destinations: head 0 in place over its own source pages (first page
        # from offset 0, so kept tokens shift down and a prefix stays put when
        # the sources start at offset 0); the others from everything left.
        free = [p for h in range(1, heads) for p in sources[h]] + pool
        free = [free[i] for i in torch.randperm(len(free), generator=gen).tolist()]
        for h in range(heads):
            needed = -(-int(keep_lens[r, h]) // page_size)
            pages = sources[0][:needed] if h == 0 else [free.pop() for _ in range(needed)]
            if h == 0:
                free += sources[0][needed:]
            dest_page_table[r, h, :needed] = torch.tensor(pages, dtype=torch.int32)

    summary_state = summary_rows = None
    if summary != "none":
        summary_state = _random_summary(gen, num_requests + 1, heads, head_dim, summary)
        rows = torch.randperm(num_requests + 1, generator=gen)[:num_requests]
        rows[torch.rand(num_requests, generator=gen) < 0.3] = -1
        summary_rows = rows.to(torch.int32).to(DEVICE)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return CompactionCase(
        key_cache,
        value_cache,
        to(src_tokens),
        to(torch.tensor(live_lens, dtype=torch.int32)),
        to(keep),
        to(keep_lens),
        to(dest_page_table),
        summary_state,
        summary_rows,
        raw,
        strided if isinstance(strided, str) else None,
    )


COMPACTION_CASES = {
    # name: (heads, head_dim, page_size, dtype, live_lens [R][H], summary, strided)
    "fp32-d64-ps16-summary-strided": (4, 64, 16, torch.float32, [[40, 17, 0, 33], [16, 50, 8, 1]], "random", True),
    "bf16-d128-ps32-zero-summary": (2, 128, 32, torch.bfloat16, [[70, 64], [5, 41], [32, 0]], "zero", False),
    "fp32-d128-ps16-no-summary": (3, 128, 16, torch.float32, [[30, 45, 16], [3, 0, 60]], "none", False),
    "bf16-d64-ps16-summary-strided": (2, 64, 16, torch.bfloat16, [[100, 37], [48, 64]], "random", True),
    "fp32-d64-ps16-diagonal-summary": (3, 64, 16, torch.float32, [[40, 17, 70], [16, 50, 8]], "random-diagonal", False),
    "fp32-d128-ps32-no-covariance-summary": (2, 128, 32, torch.float32, [[70, 33], [5, 64]], "random-none", True),
    "fp32-d32-ps32-summary-strided": (4, 32, 32, torch.float32, [[200, 17, 90, 33], [64, 0, 129, 31]], "random", True),
}


@pytest.mark.parametrize("name", list(COMPACTION_CASES))
def test_compact_head_pages_matches_reference(name: str) -> None:
    heads, head_dim, page_size, dtype, live_lens, summary, strided = COMPACTION_CASES[name]
    case = make_compaction_case(
        sum(map(ord, name)),
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        live_lens=live_lens,
        summary=summary,
        strided=strided,
    )
    expected = case.clone()
    chp.compact_head_pages_reference(*expected.args())
    before = case.clone()
    chp.compact_head_pages(*case.args())
    # Kept tokens are copied bit for bit; untouched slots (NaN included) stay.
    for got, want in ((case.key_cache, expected.key_cache), (case.value_cache, expected.value_cache)):
        torch.testing.assert_close(got, want, atol=0.0, rtol=0.0, equal_nan=True)
        assert got.stride() == want.stride()
    assert not torch.equal(case.key_cache.nan_to_num(), before.key_cache.nan_to_num())  # something moved
    if case.summary is not None:
        assert expected.summary is not None
        for field in ("count", "key_mean", "value_mean", "cross_cov"):
            got, want = getattr(case.summary, field), getattr(expected.summary, field)
            assert not torch.isnan(got).any()
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4, msg=field)


COMPACTION_SWEEP = [(d, ps, dt) for d in (64, 128) for ps in (16, 32) for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("head_dim,page_size,dtype", COMPACTION_SWEEP)
def test_compact_head_pages_sweep(head_dim: int, page_size: int, dtype: torch.dtype) -> None:
    """Random live lengths (zero and whole pages included) over the head size x
    page size x dtype grid, summaries random, strided caches half the time."""
    index = COMPACTION_SWEEP.index((head_dim, page_size, dtype))
    seed = 2000 + index
    gen = torch.Generator().manual_seed(seed)
    live_lens = torch.randint(0, 3 * page_size, (2, 3), generator=gen)
    live_lens[0, 0] = 0
    live_lens[1, 2] = 2 * page_size
    case = make_compaction_case(
        seed, heads=3, head_dim=head_dim, page_size=page_size, dtype=dtype,
        live_lens=live_lens.tolist(), summary="random", strided=bool(index // 2 % 2),
    )
    expected = case.clone()
    chp.compact_head_pages_reference(*expected.args())
    chp.compact_head_pages(*case.args())
    torch.testing.assert_close(case.key_cache, expected.key_cache, atol=0.0, rtol=0.0, equal_nan=True)
    torch.testing.assert_close(case.value_cache, expected.value_cache, atol=0.0, rtol=0.0, equal_nan=True)
    assert case.summary is not None and expected.summary is not None
    for field in ("count", "key_mean", "value_mean", "cross_cov"):
        torch.testing.assert_close(
            getattr(case.summary, field), getattr(expected.summary, field), atol=1e-3, rtol=1e-4, msg=field
        )


def _gather_tokens(cache: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    heads, page_size = cache.shape[1], cache.shape[2]
    flat = flat.long()
    return cache[flat // page_size // heads, flat // page_size % heads, flat % page_size]


def test_compaction_then_attention() -> None:
    """Keeping every token moves tokens (across heads' pages) but not what
    attention over the new page table sees."""
    heads, head_dim, page_size, scale = 2, 64, 16, 0.125
    case = make_compaction_case(
        11, heads=heads, head_dim=head_dim, page_size=page_size, dtype=torch.float32,
        live_lens=[[37, 20]], summary="none", strided=True, keep_all=True,
    )
    lens = [int(n) for n in case.src_lens[0]]
    before = [
        (_gather_tokens(case.key_cache, case.src_tokens[0, h, :n]), _gather_tokens(case.value_cache, case.src_tokens[0, h, :n]))
        for h, n in enumerate(lens)
    ]
    chp.compact_head_pages(*case.args())
    query = torch.randn(1, heads, head_dim, device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    batch = HeadPagedBatch(
        case.dest_page_table, case.src_lens,
        query_start_loc=torch.tensor([0, 1], **i32), seq_lens=torch.zeros(1, **i32),  # no standard region
        block_table=torch.zeros(1, 1, **i32), region_start=torch.zeros(1, **i32),
    )
    out, _ = hpa.head_paged_attention(query, case.key_cache, case.value_cache, batch, scale)
    for h, (keys, values) in enumerate(before):
        probs = torch.softmax(keys @ query[0, h] * scale, dim=0)
        torch.testing.assert_close(out[0, h], probs @ values, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- vLLM's cache views


def test_kernel_mode() -> None:
    """Compiled kernels on CUDA tensors when a GPU is visible and
    ``TRITON_INTERPRET`` is unset; the interpreter on CPU tensors otherwise."""
    compiled = not hpa._interpreted(hpa._head_paged_attention_kernel)
    if torch.cuda.is_available() and not INTERPRET:
        assert compiled and DEVICE.type == "cuda"
    else:
        assert INTERPRET and not compiled and DEVICE.type == "cpu"


_VLLM_VIEWS_SCRIPT = """
import json, sys, torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout
num_layers, num_blocks, heads, page_size, head_dim = (int(a) for a in sys.argv[1:6])
dtype = getattr(torch, sys.argv[6])
views = {}
for name in sys.argv[7:]:
    layout = KVCacheLayout[name]
    spec = FullAttentionSpec(block_size=page_size, num_kv_heads=heads, head_size=head_dim, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = num_layers * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[str(i) for i in range(num_layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    layers = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    views[name] = [[list(t.shape), list(t.stride()), t.storage_offset()]
                   for kv_cache in layers for t in kv_cache.split(head_dim, dim=-1)]
print(json.dumps(views))
"""


def test_vllm_layer_views_are_vllms() -> None:
    """``vllm_layer_kv_cache`` builds the views vLLM's own code builds (checked
    against the installed vLLM, in a subprocess: importing vLLM here would
    import triton's compiled mode first)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    num_layers, num_blocks, heads, page_size, head_dim, dtype = 3, 5, 3, 16, 64, torch.bfloat16
    result = subprocess.run(
        [sys.executable, "-c", _VLLM_VIEWS_SCRIPT, *map(str, (num_layers, num_blocks, heads, page_size, head_dim)),
         "bfloat16", *VLLM_LAYOUTS],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    for layout in VLLM_LAYOUTS:
        ours = []
        raw = None
        for layer in range(num_layers):
            raw, key, value = vllm_layer_kv_cache(
                raw, num_blocks, heads, page_size, head_dim, dtype, layout, num_layers=num_layers, layer=layer
            )
            ours += [[list(t.shape), list(t.stride()), t.storage_offset()] for t in (key, value)]
        assert ours == theirs[layout], layout


VLLM_ATTENTION_CASES = {
    # name: (heads, group, head_dim, page_size, dtype, requests, moments, max_compacted, splits)
    "mixed-g4-d64-fp32-moments-splits": (
        2, 4, 64, 16, torch.float32, [(1, 48, 90), (5, 16, 37), (1, 0, 9)], "random", 50, 2,
    ),
    "decode-g2-d128-ps32-bf16-diagonal-moments": (
        3, 2, 128, 32, torch.bfloat16, [(1, 32, 70), (1, 64, 65)], "random-diagonal", 70, 1,
    ),
}


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
@pytest.mark.parametrize("name", list(VLLM_ATTENTION_CASES))
def test_head_paged_attention_on_vllm_views(name: str, layout: str) -> None:
    """Attention over vLLM's strided key/value views of a layer's cache
    (key and value interleaved per token, another layer beside it)."""
    heads, group, head_dim, page_size, dtype, requests, moments, max_compacted, splits = VLLM_ATTENTION_CASES[name]
    case = make_attention_case(
        sum(map(ord, name + layout)), heads=heads, group=group, head_dim=head_dim, page_size=page_size,
        dtype=dtype, requests=requests, summary=moments, strided=layout, max_compacted=max_compacted,
    )
    assert case.key_cache.stride(-1) == 1 and not case.key_cache.is_contiguous()
    assert case.value_cache.data_ptr() - case.key_cache.data_ptr() == head_dim * case.key_cache.element_size()
    out, lse = hpa.head_paged_attention(*case.args(), num_splits=splits)
    ref_out, ref_lse = hpa.head_paged_attention_reference(*case.args())
    assert not torch.isnan(out).any() and torch.isfinite(lse).all()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)


VLLM_COMPACTION_CASES = {
    # name: (heads, head_dim, page_size, dtype, live_lens [R][H], moments)
    "fp32-d64-ps16-moments": (3, 64, 16, torch.float32, [[40, 17, 33], [16, 50, 0]], "random"),
    "bf16-d128-ps32-moments": (2, 128, 32, torch.bfloat16, [[70, 33], [5, 64]], "random"),
}


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
@pytest.mark.parametrize("name", list(VLLM_COMPACTION_CASES))
def test_compact_head_pages_on_vllm_views(name: str, layout: str) -> None:
    """Compaction through vLLM's key/value views: the whole buffer (both
    halves of every token, the other layer) ends bit for bit as the
    reference leaves it, and the moments agree."""
    heads, head_dim, page_size, dtype, live_lens, moments = VLLM_COMPACTION_CASES[name]
    case = make_compaction_case(
        sum(map(ord, name + layout)), heads=heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
        live_lens=live_lens, summary=moments, strided=layout,
    )
    assert case.raw is not None
    expected = case.clone()
    assert expected.raw is not None and expected.key_cache.stride() == case.key_cache.stride()
    chp.compact_head_pages_reference(*expected.args())
    before = case.raw.clone()
    chp.compact_head_pages(*case.args())
    assert not torch.equal(case.raw, before)  # something moved
    assert torch.equal(case.raw, expected.raw)  # bitwise, NaN slots included
    assert case.summary is not None and expected.summary is not None
    for field in ("count", "key_mean", "value_mean", "cross_cov"):
        got, want = getattr(case.summary, field), getattr(expected.summary, field)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4, msg=field)
