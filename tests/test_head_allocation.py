"""Head budget allocation (uniform, AdaKV), page rounding and per-head selection,
against brute-force loop implementations of their definitions."""

import pytest
import torch

from vllm_kvevict.policies.allocation import (
    AdaKVAllocation,
    UniformAllocation,
    round_to_pages,
    select_top,
)

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


def test_round_to_pages_rejects_impossible_minimum():
    with pytest.raises(ValueError, match="more than"):
        round_to_pages(torch.tensor([8, 8]), torch.tensor([16, 16]), torch.tensor([9, 9]), 2, 8)


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


@pytest.mark.parametrize("seed", range(20))
def test_allocate_head_tokens_keeps_floor_protected_and_pages(seed):
    """Whole pages within the layer's total, every head at least its protected
    tokens and AdaKV's floor (rounded up to a page), when it has them."""
    from vllm_kvevict.policies.allocation import allocate_head_tokens

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
