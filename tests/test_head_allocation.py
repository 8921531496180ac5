"""Head budget allocation (uniform, AdaKV, PyramidKV), page rounding and per-head selection,
against brute-force loop implementations of their definitions."""

import dataclasses

import pytest
import torch

from vllm_kvevict.eviction.allocation import (
    AdaKVAllocation,
    GlobalAllocation,
    PyramidAllocation,
    UniformAllocation,
    allocate_head_tokens,
    allocate_request_tokens,
    global_top_b,
    pyramid_layer_budgets,
    round_to_pages,
)
from vllm_kvevict.top_k import select_top, top_k_mask

INF = float("inf")


def _random_scores(gen, heads, width, protected=3, ragged=True):
    """Distinct scores per head, ``+inf`` for a few protected tokens, ``-inf``
    padding at the end of shorter heads."""
    scores = torch.rand(heads, width, generator=gen) * torch.rand(heads, 1, generator=gen) * 10
    live = torch.full((heads,), width)
    if ragged:
        live = torch.randint(width // 2, width + 1, (heads,), generator=gen)
    for h in range(heads):
        scores[h, : min(protected, int(live[h]))] = INF
        scores[h, int(live[h]) :] = -INF
    return scores, live


def _adakv_brute_force(scores, total, floor_fraction):
    """kvpress AdaKVPress: force each head's top int(total/H * alpha) tokens,
    then keep the best `total` of the layer, one token at a time."""
    heads, width = scores.shape
    safe = int(total // heads * floor_fraction)
    chosen = set()
    for h in range(heads):
        ranked = sorted(range(width), key=lambda s: (-float(scores[h, s]), s))
        for s in ranked[:safe]:
            if scores[h, s] > -INF:
                chosen.add((h, s))
    rest = sorted(
        ((h, s) for h in range(heads) for s in range(width) if (h, s) not in chosen and scores[h, s] > -INF),
        key=lambda hs: (-float(scores[hs]), hs[0] * width + hs[1]),
    )
    for hs in rest:
        if len(chosen) >= total:
            break
        chosen.add(hs)
    counts = [0] * heads
    for h, _ in chosen:
        counts[h] += 1
    return counts


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("floor_fraction", [0.0, 0.2, 0.5, 1.0])
def test_adakv_counts_match_brute_force(seed, floor_fraction):
    gen = torch.Generator().manual_seed(seed)
    heads = int(torch.randint(1, 6, (1,), generator=gen))
    width = int(torch.randint(8, 40, (1,), generator=gen))
    scores, live = _random_scores(gen, heads, width)
    total = int(torch.randint(heads, int(live.sum()) + 1, (1,), generator=gen))
    counts = AdaKVAllocation(floor_fraction).token_counts(scores, total)
    assert counts.tolist() == _adakv_brute_force(scores, total, floor_fraction)
    assert int(counts.sum()) == min(total, int(live.sum()))
    assert bool((counts <= live).all())
    assert bool((counts >= torch.minimum(live, torch.tensor(int(total // heads * floor_fraction)))).all())


def test_adakv_gives_concentrated_heads_less():
    """A head whose scores are flat needs more tokens than one with a few peaks."""
    flat = torch.full((1, 64), 1.0) + torch.arange(64) * 1e-3
    peaked = torch.full((1, 64), 0.01)
    peaked[0, :4] = 5.0
    counts = AdaKVAllocation(0.2).token_counts(torch.cat([flat, peaked]), 64)
    assert counts[0] > counts[1] and int(counts.sum()) == 64
    assert int(counts[1]) >= int(32 * 0.2)


def test_uniform_counts():
    scores, live = _random_scores(torch.Generator().manual_seed(1), 4, 30)
    counts = UniformAllocation().token_counts(scores, 4 * 20)
    assert counts.tolist() == [min(20, int(n)) for n in live]


@pytest.mark.parametrize("seed", range(30))
def test_round_to_pages(seed):
    gen = torch.Generator().manual_seed(seed)
    heads = int(torch.randint(1, 7, (1,), generator=gen))
    page = int(torch.tensor([4, 8, 16])[torch.randint(0, 3, (1,), generator=gen)])
    total_pages = heads * int(torch.randint(1, 5, (1,), generator=gen))
    live = torch.randint(page, total_pages * page + 1, (heads,), generator=gen)
    # counts as an allocation gives them: summing to at most the capacity
    weights = torch.rand(heads, generator=gen)
    counts = torch.minimum((weights / weights.sum() * total_pages * page).long(), live)
    min_tokens = torch.minimum(torch.randint(0, page + 1, (heads,), generator=gen), counts)
    kept = round_to_pages(counts, live, min_tokens, total_pages, page)
    pages = (kept + page - 1) // page
    assert int(pages.sum()) <= total_pages
    assert bool((kept <= live).all())
    assert bool((kept >= min_tokens).all())
    # whole pages, except a head that keeps all its live tokens
    assert all(int(k) % page == 0 or int(k) == int(n) for k, n in zip(kept, live))
    # largest remainder: no head is more than a page away from its count,
    # unless capped by its live tokens or raised to its minimum
    for k, c, n, m in zip(kept.tolist(), counts.tolist(), live.tolist(), min_tokens.tolist()):
        assert k >= min(c - page + 1, n) or k >= m
        assert k <= max(c + page - 1, -(-m // page) * page)
    # pages are all used when the counts fill them and the heads have room
    if int(counts.sum()) == total_pages * page:
        assert int(pages.sum()) == total_pages or bool((kept == live).any())


@pytest.mark.parametrize("seed", range(4))
def test_round_to_pages_on_the_host_is_the_same(seed):
    """The CPU worker's rounding on Python integers (:func:`round_on_host`)
    and the tensor ops a device rounds with give the same pages, minimums
    raised, pages taken back and remainders handed out alike, and the same
    minimums where they cannot fit."""
    from vllm_kvevict.eviction import allocation

    gen = torch.Generator().manual_seed(seed)
    was = allocation._host_rounding
    for _ in range(300):
        heads = int(torch.randint(1, 12, (1,), generator=gen))
        page = int(torch.tensor([1, 4, 16])[torch.randint(0, 3, (1,), generator=gen)])
        total_pages = int(torch.randint(0, 5 * heads, (1,), generator=gen))
        live = torch.randint(0, (total_pages + 2) * page + 1, (heads,), generator=gen)
        counts = (torch.rand(heads, generator=gen) * (live + 1)).long()
        min_tokens = (torch.rand(heads, generator=gen) * (live + 1)).long().clamp(max=live)
        if bool(torch.rand(1, generator=gen) < 0.5):
            min_tokens = min_tokens.clamp(max=2 * page)
        allocation.round_on_host(False)
        try:
            on_device = round_to_pages(counts, live, min_tokens, total_pages, page)
            allocation.round_on_host(True)
            on_host = round_to_pages(counts, live, min_tokens, total_pages, page)
        finally:
            allocation.round_on_host(was)
        assert torch.equal(on_host, on_device), (counts, live, min_tokens, total_pages, page)


def test_an_impossible_minimum_is_refused():
    """Minimums that need more pages than there are: every head gets its
    minimum, the pages exceed the total (nothing is read back to refuse
    there), and the selection refuses them."""
    from vllm_kvevict.eviction.select import KeepRule, choose_kept
    from vllm_kvevict.policies import ScoringInputs, make_policy

    kept = round_to_pages(torch.tensor([8, 8]), torch.tensor([16, 16]), torch.tensor([9, 9]), 2, 8)
    assert kept.tolist() == [16, 16]
    gen = torch.Generator().manual_seed(0)
    heads, width, dim = 2, 40, 8
    inputs = ScoringInputs(
        torch.randn(heads, width, dim, generator=gen), torch.randn(heads, width, dim, generator=gen),
        torch.arange(width).expand(heads, -1), None, None, dim**-0.5,
    )
    rule = KeepRule(make_policy("knorm"), UniformAllocation(), 4, 8)  # 12 tokens: 2 pages a head
    with pytest.raises(ValueError, match="more than"):
        choose_kept(rule, [inputs], [None], width, 2, 8)


@pytest.mark.parametrize("seed", range(10))
def test_select_top_is_per_head_best_sorted(seed):
    gen = torch.Generator().manual_seed(seed)
    scores, live = _random_scores(gen, 4, 25)
    counts = torch.minimum(torch.randint(0, 26, (4,), generator=gen), live)
    kept = select_top(scores, counts)
    assert kept.shape == (4, int(counts.max()))
    for h in range(4):
        n = int(counts[h])
        ranked = sorted(range(25), key=lambda s: (-float(scores[h, s]), s))[:n]
        assert kept[h, :n].tolist() == sorted(ranked)
        assert bool((kept[h, n:] == -1).all())


def _tied_scores(gen, heads, width):
    """Scores drawn from five values, ``±inf`` among them: every selection
    meets ties, as after SnapKV's max pooling."""
    levels = torch.tensor([-INF, 0.25, 0.5, 1.0, INF])
    return levels[torch.randint(0, 5, (heads, width), generator=gen)]


def _stable_order(row):
    """A row's indices by descending score, ties to the earlier index."""
    return sorted(range(len(row)), key=lambda s: (-float(row[s]), s))


@pytest.mark.parametrize("seed", range(20))
def test_top_k_mask_is_a_stable_sorts_first_k(seed):
    gen = torch.Generator().manual_seed(seed)
    heads, width = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 60, (1,), generator=gen))
    scores = _tied_scores(gen, heads, width) if seed % 2 else torch.rand(heads, width, generator=gen)
    k = torch.randint(0, width + 3, (heads,), generator=gen)  # 0 and more than the row holds too
    keep = top_k_mask(scores, k)
    for h in range(heads):
        expected = set(_stable_order(scores[h])[: int(k[h])])
        assert set(keep[h].nonzero().view(-1).tolist()) == expected


@pytest.mark.parametrize("seed", range(10))
def test_selections_break_ties_by_slot(seed):
    """AdaKV's counts and the per-head top-k on heavily tied scores, against
    the one-token-at-a-time definitions (a stable order)."""
    gen = torch.Generator().manual_seed(seed)
    heads, width = 4, 40
    scores = _tied_scores(gen, heads, width)
    live = (scores > -INF).sum(-1)
    total = int(torch.randint(1, int(live.sum()) + 1, (1,), generator=gen))
    counts = AdaKVAllocation(0.3).token_counts(scores, total)
    assert counts.tolist() == _adakv_brute_force(scores, total, 0.3)
    kept = select_top(scores, counts)
    for h in range(heads):
        n = int(counts[h])
        assert kept[h, :n].tolist() == sorted(_stable_order(scores[h])[:n])
        assert bool((kept[h, n:] == -1).all())


def _global_brute_force(scores, budget, floor):
    """DBTrimKV's global top-B one entry at a time: the best ``budget - S *
    floor`` entries of all, each stream topped up to its count plus the
    floor by its own order, what is left over handed out globally."""
    streams, width = scores.shape
    flat = scores.reshape(-1)
    live = [(s, i) for s in range(streams) for i in range(width) if scores[s, i] > -INF]
    if budget >= len(live):
        return set(live)
    chosen = _stable_order(flat)[: budget - floor * streams]
    if floor == 0:
        return {(j // width, j % width) for j in chosen if flat[j] > -INF}
    keep = set()
    for s in range(streams):
        count = min(sum(1 for j in chosen if j // width == s) + floor, int((scores[s] > -INF).sum()))
        keep |= {(s, i) for i in _stable_order(scores[s])[:count]}
    rest = [j for j in _stable_order(flat) if (j // width, j % width) not in keep and flat[j] > -INF]
    keep |= {(j // width, j % width) for j in rest[: budget - len(keep)]}
    return keep


@pytest.mark.parametrize("seed", range(10))
def test_global_top_b_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    streams, width = int(torch.randint(2, 7, (1,), generator=gen)), int(torch.randint(4, 30, (1,), generator=gen))
    scores = _tied_scores(gen, streams, width) if seed % 2 else _random_scores(gen, streams, width)[0]
    live = int((scores > -INF).sum())
    floor = int(torch.randint(0, 3, (1,), generator=gen))
    budget = int(torch.randint(floor * streams, max(live, floor * streams) + 2, (1,), generator=gen))
    keep = global_top_b(scores, budget, floor)
    assert {tuple(e) for e in keep.nonzero().tolist()} == _global_brute_force(scores, budget, floor)


@pytest.mark.parametrize("seed", range(20))
def test_allocate_head_tokens_keeps_floor_protected_and_pages(seed):
    """Whole pages within the layer's total, every head at least its protected
    tokens and AdaKV's floor (rounded up to a page), when it has them."""
    from vllm_kvevict.eviction.allocation import allocate_head_tokens

    gen = torch.Generator().manual_seed(seed)
    heads, page = 3, 16
    total_pages = heads * int(torch.randint(2, 6, (1,), generator=gen))
    width = total_pages * page
    scores, live = _random_scores(gen, heads, width, protected=int(torch.randint(0, 20, (1,), generator=gen)))
    allocation = AdaKVAllocation(0.3)
    kept = allocate_head_tokens(allocation, scores, total_pages, page)
    floor = allocation.floor_tokens(total_pages * page, heads)
    protected = (scores == INF).sum(-1)
    assert int(((kept + page - 1) // page).sum()) <= total_pages
    assert bool((kept <= live).all())
    assert bool((kept >= torch.minimum(live, torch.maximum(protected, torch.tensor(floor)))).all())


# ------------------------------------------------------------------ PyramidKV


@pytest.mark.parametrize("num_layers,mean,beta", [(30, 220.0, 20.0), (2, 100.0, 4.0), (7, 37.5, 1.0)])
def test_pyramid_layer_budgets_follow_the_paper(num_layers, mean, beta):
    """PyramidKV's schedule, written out: last layer m/β, first 2m - m/β,
    equal steps between, the mean m (the uniform budget's memory)."""
    budgets = pyramid_layer_budgets(mean, num_layers, beta)
    assert budgets[-1] == pytest.approx(mean / beta)
    assert budgets[0] == pytest.approx(2 * mean - mean / beta)
    steps = [a - b for a, b in zip(budgets, budgets[1:])]
    assert all(step == pytest.approx(steps[0]) for step in steps)
    assert sum(budgets) / num_layers == pytest.approx(mean)
    assert pyramid_layer_budgets(mean, 1, beta) == [mean]
    with pytest.raises(ValueError, match="pyramid_beta"):
        pyramid_layer_budgets(mean, num_layers, 0.5)


@pytest.mark.parametrize("seed", range(4))
def test_pyramid_allocation_pages(seed):
    """Through allocate_head_tokens: whole pages, the uniform budget's pages in
    all, every head of a layer the same count, counts falling with depth, each
    head its protected tokens plus the layer's pyramid share (up to a page)."""
    gen = torch.Generator().manual_seed(seed)
    num_layers, num_heads, width, page = 6, 3, 400, 8
    scores = torch.rand(num_layers * num_heads, width, generator=gen)
    scores[:, :4] = float("inf")  # sinks
    scores[:, -12:] = float("inf")  # recent window
    per_head_pages = 10
    total_pages = num_layers * num_heads * per_head_pages
    counts = allocate_head_tokens(PyramidAllocation(beta=5.0), scores, total_pages, page, num_layers)
    assert int(((counts + page - 1) // page).sum()) <= total_pages
    assert all(int(c) % page == 0 for c in counts)
    by_layer = counts.view(num_layers, num_heads)
    assert bool((by_layer == by_layer[:, :1]).all())
    assert bool((by_layer[:-1, 0] >= by_layer[1:, 0]).all()) and by_layer[0, 0] > by_layer[-1, 0]
    free = per_head_pages * page - 16
    expected = torch.tensor(pyramid_layer_budgets(free, num_layers, 5.0)) + 16
    assert bool(((by_layer[:, 0] - expected).abs() <= page).all())
    # Heads of different layers must not be mixed up: layer-major streams.
    with pytest.raises(ValueError, match="do not split"):
        PyramidAllocation(beta=2.0).token_counts(scores[:-1], total_pages * page, num_layers)


def test_pyramid_config_defaults_and_refusals():
    from vllm_kvevict.config import KVEvictionConfigError, build_config

    config = build_config({"policy": "pyramidkv", "budget": 256})
    assert config.head_budget == "pyramid" and config.pools_layers and config.uses_head_pages
    assert isinstance(config.build_allocation(), PyramidAllocation)
    assert config.build_allocation().beta == 1.5  # configs/pyramidkv.yaml (benchmarks/README.md)
    assert build_config({"policy": "snapkv", "budget": 256, "head_budget": "pyramid"}).pools_layers
    for bad in (
        {"policy": "criticalkv", "head_budget": "pyramid"},
        {"policy": "momentkv", "head_budget": "pyramid"},
        {"policy": "snapkv", "head_budget": "pyramid", "moment_correction": True},
    ):
        with pytest.raises(KVEvictionConfigError, match="pyramid"):
            build_config({"budget": 256, **bad})
    with pytest.raises(KVEvictionConfigError, match="pyramid_beta"):
        build_config({"policy": "pyramidkv", "budget": 256, "pyramid_beta": 0.5})


def test_global_top_b_breaks_ties_by_position():
    """Equal scores: the earlier entry (stream-major, then position) is kept,
    as every other selection does (a stable sort, not topk's unspecified order)."""
    scores = torch.zeros(3, 5)
    keep = global_top_b(scores, 4)
    assert keep.view(-1).nonzero().view(-1).tolist() == [0, 1, 2, 3]
    keep = global_top_b(scores, 7, floor=1)
    assert keep.sum() == 7 and bool(keep[:, 0].all())
    assert keep.view(-1).nonzero().view(-1).tolist() == [0, 1, 2, 3, 4, 5, 10]


@pytest.mark.parametrize("policy", ["keydiff", "snapkv", "knorm", "momentkv"])
def test_a_nan_key_does_not_evict_sinks_or_recent_tokens(policy):
    """One NaN key (KeyDiff's anchor, SnapKV's attention and the key norm
    become NaN): the selection falls back to the sinks and the most recent
    tokens, every head keeps its full count, the fallback is reported."""
    from vllm_kvevict.config import build_config
    from vllm_kvevict.eviction.select import KeepRule, choose_kept
    from vllm_kvevict.moments import EvictedMoments
    from vllm_kvevict.policies.base import ScoringInputs

    gen = torch.Generator().manual_seed(3)
    heads, width, dim = 2, 96, 16
    keys = torch.randn(heads, width, dim, generator=gen)
    keys[0, 40] = float("nan")
    config = build_config({"policy": policy, "budget": 48, "sink_tokens": 4, "recent_window": 8,
                           "observation_window": 4, "head_budget": "uniform"})
    inputs = ScoringInputs(
        keys=keys, values=torch.randn(heads, width, dim, generator=gen),
        key_positions=torch.arange(width).expand(heads, -1),
        queries=torch.randn(heads * 2, 4, dim, generator=gen), query_positions=torch.arange(width - 4, width),
        scale=dim ** -0.5,
        evicted=EvictedMoments.zeros(None, heads, dim) if config.moment_correction else None,
    )
    fallbacks: list[str] = []
    rule = dataclasses.replace(KeepRule.from_config(config), on_fallback=fallbacks.append)
    counts, kept = choose_kept(rule, [inputs], [None], width, heads * 48, 1)
    assert counts.tolist() == [48, 48]
    # NaN scores: the selection falls back to the sinks and the most recent tokens.
    assert fallbacks == ["non_finite_scores"]
    for h in range(heads):
        assert kept[h].tolist() == [*range(4), *range(width - 44, width)], h


def test_a_failing_policy_falls_back_to_sinks_and_recent_tokens():
    """A policy whose scoring raises: every stream keeps what StreamingLLM
    keeps, in the planned number of pages (head pages with AdaKV too), and
    the failure is reported by its exception type."""
    from vllm_kvevict.config import build_config
    from vllm_kvevict.eviction.select import KeepRule, choose_kept
    from vllm_kvevict.policies.base import ScoringInputs

    gen = torch.Generator().manual_seed(11)
    heads, width, dim, page = 4, 200, 16, 16
    inputs = ScoringInputs(
        keys=torch.randn(heads, width, dim, generator=gen), values=torch.randn(heads, width, dim, generator=gen),
        key_positions=torch.arange(width).expand(heads, -1),
        queries=torch.randn(heads, 8, dim, generator=gen), query_positions=torch.arange(width - 8, width),
        scale=dim ** -0.5,
    )
    for head_budget, total, size in (("uniform", heads * 64, 1), ("adaptive", 16, page)):
        settings = {"budget": 64, "sink_tokens": 4, "recent_window": 8, "head_budget": head_budget}
        failing = KeepRule.from_config(build_config({"policy": "snapkv", **settings}))
        reference = KeepRule.from_config(build_config({"policy": "streamingllm", **settings}))

        def broken(_inputs):
            raise ZeroDivisionError("boom")

        object.__setattr__(failing.policy, "score", broken)
        fallbacks: list[str] = []
        failing = dataclasses.replace(failing, on_fallback=fallbacks.append)
        counts, kept = choose_kept(failing, [inputs], [None], width, total, size)
        expected_counts, expected = choose_kept(reference, [inputs], [None], width, total, size)
        assert fallbacks == ["ZeroDivisionError"], head_budget
        assert torch.equal(counts, expected_counts) and torch.equal(kept, expected), head_budget
        assert int(counts.sum()) <= total * size


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    "allocation",
    [UniformAllocation(), AdaKVAllocation(0.2), AdaKVAllocation(0.9), GlobalAllocation(), GlobalAllocation(floor=5),
     PyramidAllocation(1.5), PyramidAllocation(20.0)],
    ids=["uniform", "adakv", "adakv-0.9", "global", "global-floor", "pyramid", "pyramid-20"],
)
def test_requests_split_together_as_each_alone(seed, allocation):
    """Several requests' layers split at once (each its own pages, floor and
    ragged heads) give each request what :func:`allocate_head_tokens` gives
    it alone; the pooled layers' allocations (global, pyramid) split each
    request's streams of two layers."""
    gen = torch.Generator().manual_seed(seed + 1000 * int(torch.randint(0, 1000, ())))
    requests, heads, width = int(torch.randint(1, 6, (1,), generator=gen)), 4, 64
    page = int(torch.tensor([1, 4, 8])[torch.randint(0, 3, (1,), generator=gen)])
    rows = [_random_scores(gen, heads, width, protected=int(torch.randint(0, 5, (1,), generator=gen)))[0]
            for _ in range(requests)]
    # Heads on very different scales, so the floors bind.
    rows = [row * torch.tensor([[1.0], [100.0], [0.01], [1.0]]) for row in rows]
    total_pages = [int(torch.randint(1, heads * width // page // 2 + 1, (1,), generator=gen)) for _ in rows]
    floors = [allocation.floor_tokens(pages * page, heads) for pages in total_pages]
    host = torch.tensor([total_pages, floors])
    layers = 2 if isinstance(allocation, (GlobalAllocation, PyramidAllocation)) else 1
    together = allocate_request_tokens(
        allocation, torch.stack(rows), host[0][:, None], host[1][:, None], total_pages, page, layers
    )
    for row, pages, got in zip(rows, total_pages, together):
        assert got.tolist() == allocate_head_tokens(allocation, row, pages, page, layers).tolist()
