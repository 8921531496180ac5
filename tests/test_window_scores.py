"""SnapKV's window votes: the Triton kernel against its torch reference and
against :class:`~vllm_kvevict.policies.SnapKVPolicy` as the eviction engine
scores today, on fresh random inputs.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``
on CPU tensors), set by ``triton_mode`` before any import of triton; when another test module
imported triton first, ``test_window_scores_in_fresh_process`` runs this file in
a new process (as ``tests/test_triton_kernels.py`` does). With CUDA (and
``TRITON_INTERPRET`` unset) the compiled kernels run on the GPU.

Every batch holds several requests x KV heads in one call; keys are read
through shuffled head-pages and block tables, and every slot no table points
to is NaN. Tolerances: fp32 caches ``atol=1e-6, rtol=1e-5`` (the same fp32
logits summed in another order); fp16 and bf16 caches ``atol=1e-5, rtol=1e-4``
(queries in the cache dtype, as the model writes them: the products are exact
in fp32 and only the order of the sums differs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from paged_layout import poisoned_cache, random_paged_layout
from triton_mode import DEVICE, run_in_fresh_process, skip_unless

from vllm_kvevict.eviction.select import score_heads  # noqa: E402
from vllm_kvevict.policies import ScoringInputs, SnapKVPolicy  # noqa: E402
from vllm_kvevict.policies.base import PADDING_POSITION  # noqa: E402
from vllm_kvevict.triton_kernels import window_scores as ws  # noqa: E402
from vllm_kvevict.triton_kernels.batch import HeadPagedBatch  # noqa: E402
from vllm_kvevict.triton_kernels.head_paged_attention import head_tokens_reference  # noqa: E402
from vllm_kvevict.policies.snapkv import pool_votes  # noqa: E402
from vllm_kvevict.policies.tova import TOVAPolicy  # noqa: E402
from vllm_kvevict.triton_kernels.window_scores_torch import item_lengths  # noqa: E402

POISON = float("nan")


@pytest.fixture(autouse=True)
def _interpretable(request: pytest.FixtureRequest) -> None:
    skip_unless(request, "test_window_scores_in_fresh_process")


def test_window_scores_in_fresh_process() -> None:
    """This file in a new interpreter, when this one imported triton too early."""
    print(run_in_fresh_process(__file__, "test_window_scores_in_fresh_process", timeout=600))


@dataclass
class WindowCase:
    queries: torch.Tensor  # [R, Hq, W, D]
    key_cache: torch.Tensor  # logical [num_blocks, H, page_size, D]
    batch: HeadPagedBatch
    query_lens: torch.Tensor  # [R]
    compacted_positions: torch.Tensor | None  # [R, H, C]
    scale: float

    def kwargs(self) -> dict:
        return dict(query_lens=self.query_lens, compacted_positions=self.compacted_positions)


def make_window_case(
    seed: int,
    *,
    heads: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    requests: list[tuple[int, int]],
    window: int,
    max_compacted: int,
    strided: bool,
    positions: bool,
) -> WindowCase:
    """``requests``: ``(region_start, seq_len)`` each, ``seq_len`` the eviction
    point; request ``r`` has ``min(window, seq_len)`` window queries. Compacted
    lengths are random in ``[0, max_compacted]`` with a zero and a whole number
    of pages among them; compacted positions (``positions``) are random in
    ``[0, seq_len)``, some after some window queries. ``strided``: the cache is
    a view of ``[num_blocks, page_size, H, D + 8]`` (vLLM's GPU layout, rows
    padded), the queries and positions permuted views."""
    gen = torch.Generator().manual_seed(seed)
    num_requests = len(requests)
    layout = random_paged_layout(
        gen, requests=requests, heads=heads, page_size=page_size, max_compacted=max_compacted
    )
    head_lens, num_blocks = layout.head_lens, layout.num_blocks
    key_cache = poisoned_cache(num_blocks, heads, page_size, head_dim, dtype, strided, DEVICE)
    for block, head, offsets in layout.writes:
        n = len(range(page_size)[offsets])
        key_cache[block, head, offsets] = (torch.randn(n, head_dim, generator=gen) * 2).to(dtype).to(DEVICE)

    capacity = int(head_lens.max()) + 3
    position_table = torch.full((num_requests, heads, capacity), -(1 << 20), dtype=torch.int64)  # never read
    for r, (_, seq_len) in enumerate(requests):
        for h in range(heads):
            length = int(head_lens[r, h])
            position_table[r, h, :length] = torch.randint(0, max(seq_len, 1), (length,), generator=gen).sort().values

    query_lens = torch.tensor([min(window, seq_len) for _, seq_len in requests], dtype=torch.int32)
    queries = (torch.randn(num_requests, window, heads * group, head_dim, generator=gen) * 2).to(dtype)
    queries = queries.to(DEVICE).transpose(1, 2)  # [R, Hq, W, D], the ring's [W, Hq, D] per request
    compacted_positions = None
    if positions:
        compacted_positions = position_table.to(DEVICE)
        if strided:
            compacted_positions = compacted_positions.transpose(1, 2).contiguous().transpose(1, 2)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    batch = HeadPagedBatch(
        to(layout.head_page_table),
        to(head_lens.to(torch.int32)),
        seq_lens=to(torch.tensor([s for _, s in requests], dtype=torch.int32)),
        block_table=to(layout.block_table),
        region_start=to(torch.tensor([s for s, _ in requests], dtype=torch.int32)),
    )
    return WindowCase(queries, key_cache, batch, to(query_lens), compacted_positions, 1.0 / math.sqrt(head_dim))


def engine_scores(case: WindowCase, r: int, policy: SnapKVPolicy) -> tuple[torch.Tensor, int]:
    """Request ``r``'s SnapKV scores ``[H, S]`` as the eviction engine computes
    them (``eviction/head_pages.gather_live``'s padded keys and positions,
    then ``score_heads``), and ``S``."""
    batch = case.batch
    num_kv_heads, group = case.key_cache.shape[1], case.queries.shape[1] // case.key_cache.shape[1]
    start, seq_len, count = int(batch.region_start[r]), int(batch.seq_lens[r]), int(case.query_lens[r])
    lens = [int(n) for n in batch.head_lens[r]]
    width = max(lens) + seq_len - start
    if width == 0:
        return torch.zeros(num_kv_heads, 0, device=DEVICE), 0
    keys = torch.zeros(num_kv_heads, width, case.key_cache.shape[3], dtype=case.key_cache.dtype, device=DEVICE)
    positions = torch.full((num_kv_heads, width), PADDING_POSITION, dtype=torch.int64, device=DEVICE)
    live = torch.zeros(num_kv_heads, width, dtype=torch.bool, device=DEVICE)
    for h, length in enumerate(lens):
        tokens = head_tokens_reference(
            case.key_cache, h, batch.head_page_table[r, h], length, batch.block_table[r], start, seq_len
        )
        n = tokens.shape[0]
        keys[h, :n], live[h, :n] = tokens, True
        if case.compacted_positions is not None:
            positions[h, :length] = case.compacted_positions[r, h, :length]
        else:
            positions[h, :length] = -1
        positions[h, length:n] = torch.arange(start, seq_len, device=DEVICE)
    inputs = ScoringInputs(
        keys, keys, positions, case.queries[r, :, :count], torch.arange(seq_len - count, seq_len, device=DEVICE),
        case.scale,
    )
    assert inputs.queries is not None and inputs.queries.shape[0] == num_kv_heads * group
    return score_heads(policy, inputs, live), width


WINDOW_CASES = {
    # name: (heads, group, head_dim, page_size, dtype, requests [(region_start, seq_len)], window,
    #        max_compacted, strided, positions, splits, kernel_size, pooling)
    # Items shorter than the window (3 and 5 keys), a request with no standard slot.
    "g4-d64-bf16-max": (
        2, 4, 64, 16, torch.bfloat16, [(16, 45), (27, 30), (40, 40), (0, 5)], 8, 21, False, True, None, 7, "max",
    ),
    "g1-d32-fp32-avg-strided-splits": (
        3, 1, 32, 16, torch.float32, [(32, 81), (5, 40), (48, 52)], 6, 37, True, True, 2, 5, "avg",
    ),
    # Several key tiles (up to 230 keys), three splits, kernel wider than some items.
    "g4-d32-fp16-max-splits": (
        2, 4, 32, 32, torch.float16, [(64, 190), (10, 33), (90, 95)], 8, 40, True, True, 3, 15, "max",
    ),
    # Points before a full window (3 and 9 queries of 16); compacted tokens before every query.
    "g1-d64-fp32-avg-short-window": (
        2, 1, 64, 16, torch.float32, [(0, 3), (0, 9), (17, 70)], 16, 20, False, False, None, 3, "avg",
    ),
    # 40 queries x 4 heads = 160 rows: two row tiles in each pass.
    "g4-d32-bf16-two-row-tiles": (
        2, 4, 32, 16, torch.bfloat16, [(20, 100), (60, 66)], 40, 30, True, True, 2, 7, "avg",
    ),
}


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_window_votes_match_reference_and_snapkv(name: str) -> None:
    (heads, group, head_dim, page_size, dtype, requests, window, max_compacted, strided, positions, splits,
     kernel, pooling) = WINDOW_CASES[name]
    case = make_window_case(
        sum(map(ord, name)), heads=heads, group=group, head_dim=head_dim, page_size=page_size, dtype=dtype,
        requests=requests, window=window, max_compacted=max_compacted, strided=strided, positions=positions,
    )
    if strided:
        assert not case.key_cache.is_contiguous() and not case.queries.is_contiguous()
    votes = ws.window_votes(case.queries, case.key_cache, case.batch, case.scale, num_splits=splits, **case.kwargs())
    lengths = item_lengths(case.batch)
    width = int(lengths.max())
    assert votes.shape == (len(requests), heads, width) and votes.dtype == torch.float32
    assert not torch.isnan(votes).any()
    past = torch.arange(width, device=DEVICE)[None, None, :] >= lengths[..., None]
    assert torch.equal(votes[past], torch.zeros_like(votes[past]))

    # (a) the torch reference, item by item on the logical cache.
    expected = ws.window_votes_reference(case.queries, case.key_cache, case.batch, case.scale, **case.kwargs())
    torch.testing.assert_close(votes, expected, **_tolerance(dtype))
    # Each row that sees a key gives its keys one unit of attention in all.
    assert ((votes.sum(-1) > 0) | (lengths == 0)).all() and (votes.sum(-1) <= 1 + 1e-5).all()

    # (b) SnapKV's scores as the engine computes them today, after the pooling.
    policy = SnapKVPolicy(kernel_size=kernel, pooling=pooling)
    pooled = pool_votes(votes, lengths, kernel, pooling)
    for r in range(len(requests)):
        want, request_width = engine_scores(case, r, policy)
        if request_width == 0:
            continue  # nothing to score (the engine scores no such request)
        torch.testing.assert_close(pooled[r, :, :request_width], want, **_tolerance(dtype))
        assert not pooled[r, :, request_width:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_last_querys_votes_are_tovas_scores(dtype: torch.dtype) -> None:
    """A window of one query (TOVA's ``voting_queries``): each key's votes
    are the group's mean attention from the query just before the point,
    TOVA's score as the engine computes it head by head, on ragged heads,
    strided views and compacted tokens at any earlier position."""
    seed = int(torch.randint(0, 2**31, ()))
    case = make_window_case(
        seed, heads=3, group=4, head_dim=64, page_size=16, dtype=dtype,
        requests=[(16, 45), (27, 30), (40, 40), (0, 5), (32, 97)], window=1, max_compacted=37, strided=True,
        positions=True,
    )
    votes = ws.window_votes(case.queries, case.key_cache, case.batch, case.scale, **case.kwargs())
    for r in range(votes.shape[0]):
        want, width = engine_scores(case, r, TOVAPolicy())
        torch.testing.assert_close(votes[r, :, :width], want, **_tolerance(dtype), msg=lambda m: f"seed {seed}: {m}")


def test_window_votes_width_and_no_queries() -> None:
    """A wider ``max_len`` pads with zeros; a request with no window query
    votes zero; one with every query before its keys (blind) votes zero."""
    case = make_window_case(
        5, heads=2, group=2, head_dim=32, page_size=16, dtype=torch.float32,
        requests=[(8, 40), (30, 50), (0, 20)], window=6, max_compacted=12, strided=False, positions=True,
    )
    case.query_lens = torch.tensor([6, 0, 6], dtype=torch.int32, device=DEVICE)
    assert case.compacted_positions is not None
    case.compacted_positions[2] = 1 << 20  # request 2: every key after every query
    case.batch.region_start[2] = 20  # ... and no standard slot
    width = int(item_lengths(case.batch).max()) + 37
    votes = ws.window_votes(case.queries, case.key_cache, case.batch, case.scale, max_len=width, **case.kwargs())
    expected = ws.window_votes_reference(
        case.queries, case.key_cache, case.batch, case.scale, max_len=width, **case.kwargs()
    )
    assert votes.shape[-1] == width
    torch.testing.assert_close(votes, expected, **_tolerance(torch.float32))
    assert not votes[1:].any() and votes[0].sum() > 0 and not torch.isnan(votes).any()


class _CountingLaunches:
    """Stands in for a jitted kernel: counts ``kernel[grid]`` launches."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("num_requests", [1, 6])
def test_one_launch_per_pass(num_requests: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole batch is one launch of each pass, whatever the number of
    (request, KV head) items; every item is a program of it."""
    heads = 2
    requests = [(16 * (r % 3), 16 * (r % 3) + 20 + 7 * r) for r in range(num_requests)]
    case = make_window_case(
        100 + num_requests, heads=heads, group=2, head_dim=32, page_size=16, dtype=torch.float32,
        requests=requests, window=4, max_compacted=10, strided=False, positions=True,
    )
    passes = [_CountingLaunches(ws._window_lse_kernel), _CountingLaunches(ws._window_votes_kernel)]
    monkeypatch.setattr(ws, "_window_lse_kernel", passes[0])
    monkeypatch.setattr(ws, "_window_votes_kernel", passes[1])
    votes = ws.window_votes(case.queries, case.key_cache, case.batch, case.scale, num_splits=2, **case.kwargs())
    assert [len(p.grids) for p in passes] == [1, 1]
    assert passes[0].grids[0][0] == passes[1].grids[0][0] == num_requests * heads
    expected = ws.window_votes_reference(case.queries, case.key_cache, case.batch, case.scale, **case.kwargs())
    torch.testing.assert_close(votes, expected, **_tolerance(torch.float32))
