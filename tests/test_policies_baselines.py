"""KeyDiff, Knorm and TOVA against loop implementations of their papers'
equations (fp64, one token at a time), on fresh random inputs."""

import math
from fractions import Fraction

import pytest
import torch

from vllm_kvevict.policies import KeyDiffPolicy, KnormPolicy, ScoringInputs, TOVAPolicy, make_policy
from vllm_kvevict.policies.base import PADDING_POSITION


def _inputs(gen, heads=3, group=2, live=24, dim=16, window=5):
    keys = torch.randn(heads, live, dim, generator=gen) * 2 + torch.randn(heads, 1, dim, generator=gen)
    values = torch.randn(heads, live, dim, generator=gen)
    positions = torch.arange(live).expand(heads, live).clone()
    queries = torch.randn(heads * group, window, dim, generator=gen)
    query_positions = torch.arange(live - window, live)
    return ScoringInputs(keys, values, positions, queries, query_positions, 1 / math.sqrt(dim))


def _cos(a, b):
    return float(a @ b) / max(float(a.norm()) * float(b.norm()), 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_keydiff_ranks_as_pairwise_eq7(seed):
    """KeyDiff Eq. 8 with the normalised-key anchor ranks tokens exactly as the
    pairwise Eq. 7, -Σ_j cos(k_i, k_j)."""
    inputs = _inputs(torch.Generator().manual_seed(seed))
    scores = KeyDiffPolicy().score(inputs)
    keys = inputs.keys.double()
    for h in range(keys.shape[0]):
        pairwise = [-sum(_cos(keys[h, i], keys[h, j]) for j in range(keys.shape[1]))
                    for i in range(keys.shape[1])]
        order_eq7 = sorted(range(len(pairwise)), key=lambda i: -pairwise[i])
        order_ours = torch.sort(scores[h], descending=True, stable=True).indices.tolist()
        assert order_ours == order_eq7


@pytest.mark.parametrize("seed", range(3))
def test_keydiff_raw_anchor_and_padding(seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = _inputs(gen)
    raw = KeyDiffPolicy(anchor="raw").score(inputs)
    keys = inputs.keys.double()
    for h in range(keys.shape[0]):
        anchor = keys[h].mean(0)
        want = torch.tensor([-_cos(k, anchor) for k in keys[h]], dtype=torch.float64)
        assert torch.allclose(raw[h].double(), want, atol=1e-5)
    # Padding (shorter heads under per-head page tables) never joins the anchor.
    padded = ScoringInputs(
        torch.cat([inputs.keys, torch.randn(3, 4, 16, generator=gen) * 50], dim=1),
        torch.cat([inputs.values, torch.zeros(3, 4, 16)], dim=1),
        torch.cat([inputs.key_positions, torch.full((3, 4), PADDING_POSITION)], dim=1),
        None, None, inputs.scale,
    )
    assert torch.allclose(KeyDiffPolicy().score(padded)[:, :24], KeyDiffPolicy().score(inputs), atol=1e-6)
    with pytest.raises(ValueError, match="anchor"):
        make_policy("keydiff", {"anchor": "median"})


@pytest.mark.parametrize("seed", range(3))
def test_knorm_keeps_lowest_key_norms(seed):
    inputs = _inputs(torch.Generator().manual_seed(seed))
    scores = KnormPolicy().score(inputs)
    for h in range(3):
        for i in range(24):
            assert float(scores[h, i]) == pytest.approx(-math.sqrt(sum(float(x) ** 2 for x in inputs.keys[h, i])), rel=1e-5)
    kept = KnormPolicy().select(inputs, 10, 0, 0, 24)
    for h in range(3):
        norms = inputs.keys[h].norm(dim=-1)
        assert kept[h].tolist() == sorted(torch.argsort(norms)[:10].tolist())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group", [1, 3])
def test_tova_is_last_query_attention_averaged_over_group(seed, group):
    inputs = _inputs(torch.Generator().manual_seed(seed), group=group, window=6)
    # the last query sees every key; earlier ones not the last few
    scores = TOVAPolicy().score(inputs)
    keys, queries = inputs.keys.double(), inputs.queries.double()
    last_pos = int(inputs.query_positions[-1])
    for h in range(3):
        want = [0.0] * 24
        for g in range(group):
            q = queries[h * group + g, -1]
            visible = [s for s in range(24) if int(inputs.key_positions[h, s]) <= last_pos]
            logits = {s: float(q @ keys[h, s]) * inputs.scale for s in visible}
            top = max(logits.values())
            z = sum(math.exp(v - top) for v in logits.values())
            for s in visible:
                want[s] += math.exp(logits[s] - top) / z / group
        assert torch.allclose(scores[h].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert TOVAPolicy.needs_queries and TOVAPolicy.default_prefill_mode == "end_of_prompt"


def _greedy_rounds_reference(inputs, alpha, evicted_k, evicted_v, keep, rounds, protected, covariance):
    """Alg. 1 in batches, one head at a time in fp64: each round evicts the
    lowest ``α_j ‖v_j - v̄ - τ S̃ k_j / n‖`` among the unprotected survivors,
    with the statistics recomputed from scratch (Eq. 24) over every token
    evicted so far. Returns the kept slots per head."""
    kept_per_head = []
    for h in range(inputs.keys.shape[0]):
        keys, values = inputs.keys[h].double(), inputs.values[h].double()
        gone_k, gone_v = [evicted_k[h].double()], [evicted_v[h].double()]
        alive = list(range(keys.shape[0]))
        must_go = len(alive) - keep
        done = 0
        for r in range(rounds):
            target = -(-must_go * (r + 1) // rounds)
            ke, ve = torch.cat(gone_k), torch.cat(gone_v)
            n = ke.shape[0]

            def score(j):
                if n == 0:
                    return alpha[h][j] * float(values[j].norm())
                s_tilde = ve.T @ ke - torch.outer(ve.sum(0), ke.sum(0)) / n
                if covariance == "full":
                    term = inputs.scale * (s_tilde @ keys[j]) / n
                elif covariance == "diagonal":
                    term = inputs.scale * s_tilde.diagonal() * keys[j] / n
                else:
                    term = 0.0
                return alpha[h][j] * float((values[j] - ve.mean(0) - term).norm())

            candidates = sorted((j for j in alive if j not in protected), key=lambda j: (score(j), j))
            batch = candidates[: target - done]
            done = target
            alive = [j for j in alive if j not in batch]
            gone_k.append(keys[batch])
            gone_v.append(values[batch])
        kept_per_head.append(alive)
    return kept_per_head


@pytest.mark.parametrize("covariance", ["full", "diagonal"])
@pytest.mark.parametrize("rounds", [1, 3, 14])
@pytest.mark.parametrize("seed", range(3))
def test_momentkv_rounds_follow_algorithm_1(seed, rounds, covariance):
    """The batched greedy: R rounds of rescoring against the statistics of
    what is already evicted (R = number evicted: Alg. 1's one-at-a-time
    greedy), the kept set equal to a from-scratch fp64 loop."""
    from vllm_kvevict.moments import EvictedMoments
    from vllm_kvevict.policies import MomentKVPolicy, SnapKVPolicy

    gen = torch.Generator().manual_seed(100 + seed)
    inputs = _inputs(gen, group=2, window=5)
    heads, dim = 3, 16
    # Head 0 has evicted nothing yet; the others have.
    evicted_k = [torch.randn(0 if h == 0 else 6, dim, generator=gen) for h in range(heads)]
    evicted_v = [torch.randn(0 if h == 0 else 6, dim, generator=gen) for h in range(heads)]
    summary = EvictedMoments.zeros(1, heads, dim, covariance=covariance)
    for h in range(heads):
        summary[0, h].fold_(evicted_k[h], evicted_v[h])
    inputs.evicted = summary.row(0)
    policy = MomentKVPolicy(rounds=rounds)
    num_keep, num_sink, num_recent = 10, 2, 3
    kept = policy.select(inputs, num_keep, num_sink, num_recent, 24)
    alpha = SnapKVPolicy().score(inputs).double().tolist()
    protected = set(range(num_sink)) | set(range(24 - num_recent, 24))
    want = _greedy_rounds_reference(inputs, alpha, evicted_k, evicted_v, num_keep, rounds, protected, covariance)
    assert kept.tolist() == want


@pytest.mark.parametrize("seed", range(3))
def test_momentkv_rounds_shrink_with_the_share_an_eviction_adds(seed):
    """Every head has evicted many tokens before (as at a decode-time
    eviction): the eviction runs ceil(R x the largest share it adds to a
    head's evicted count) rounds, and keeps what the from-scratch fp64 loop
    of that many rounds keeps."""
    from vllm_kvevict.moments import EvictedMoments
    from vllm_kvevict.policies import MomentKVPolicy, SnapKVPolicy

    gen = torch.Generator().manual_seed(300 + seed)
    inputs = _inputs(gen, group=2, window=5)
    heads, dim = 3, 16
    before = [int(n) for n in torch.randint(30, 90, (heads,), generator=gen)]
    evicted_k = [torch.randn(n, dim, generator=gen) for n in before]
    evicted_v = [torch.randn(n, dim, generator=gen) for n in before]
    summary = EvictedMoments.zeros(1, heads, dim, covariance="full")
    for h in range(heads):
        summary[0, h].fold_(evicted_k[h], evicted_v[h])
    inputs.evicted = summary.row(0)
    policy = MomentKVPolicy(rounds=8)
    num_keep, num_sink, num_recent = 13, 2, 3
    must_go = 24 - num_keep
    share = max(Fraction(must_go, n + must_go) for n in before)
    rounds = math.ceil(8 * share)
    assert 1 < rounds < 8  # the case this test is for
    assert policy.rounds_for(torch.full((heads,), must_go), inputs.evicted.count) == rounds
    kept = policy.select(inputs, num_keep, num_sink, num_recent, 24)
    alpha = SnapKVPolicy().score(inputs).double().tolist()
    protected = set(range(num_sink)) | set(range(24 - num_recent, 24))
    want = _greedy_rounds_reference(inputs, alpha, evicted_k, evicted_v, num_keep, rounds, protected, "full")
    assert kept.tolist() == want


@pytest.mark.parametrize(
    "to_evict, before, rounds",
    [
        ([2900, 2880, 2910], [0, 0, 0], 8),  # the prompt's end: nothing evicted yet
        ([32, 32, 32], [2900, 2880, 2910], 1),  # a decode-time eviction
        ([32, 600, 0], [2900, 600, 0], 4),  # the largest share decides: 600 of 1,200
        ([0, 0, 0], [100, 0, 5], 1),
    ],
)
def test_momentkv_rounds_for_closed_form(to_evict, before, rounds):
    from vllm_kvevict.policies import MomentKVPolicy

    got = MomentKVPolicy(rounds=8).rounds_for(torch.tensor(to_evict), torch.tensor(before, dtype=torch.float32))
    assert got == rounds


@pytest.mark.parametrize("covariance", ["full", "diagonal", "none"])
@pytest.mark.parametrize("seed", range(4))
def test_momentkv_score_is_attention_times_moment_residual(seed, covariance):
    """MomentKV Eq. 10: α_j ‖v_j - v̄ - τ S̃ k_j / n‖ with S̃ from the evicted
    tokens' raw sums (Eq. 24) (its diagonal, or nothing, for the reduced
    statistics), α SnapKV's score: the window attention averaged over window
    and group, max-pooled over 7 neighbours; with nothing evicted it is
    α_j ‖v_j‖."""
    from vllm_kvevict.moments import EvictedMoments
    from vllm_kvevict.policies import MomentKVPolicy

    gen = torch.Generator().manual_seed(seed)
    inputs = _inputs(gen, group=2, window=5)
    heads, dim = 3, 16
    evicted_k = [torch.randn(7 + h, dim, generator=gen) for h in range(heads)]
    evicted_v = [torch.randn(7 + h, dim, generator=gen) for h in range(heads)]
    summary = EvictedMoments.zeros(1, heads, dim, covariance=covariance)
    for h in range(heads):
        summary[0, h].fold_(evicted_k[h][:3], evicted_v[h][:3])
        summary[0, h].fold_(evicted_k[h][3:], evicted_v[h][3:])
    inputs.evicted = summary.row(0)
    scores = MomentKVPolicy(kernel_size=7).score(inputs)
    keys, values, queries = inputs.keys.double(), inputs.values.double(), inputs.queries.double()
    for h in range(heads):
        ke, ve = evicted_k[h].double(), evicted_v[h].double()
        n = ke.shape[0]
        s_tilde = ve.T @ ke - torch.outer(ve.sum(0), ke.sum(0)) / n
        window_attention = []
        for j in range(24):
            alpha = 0.0
            for g in range(2):
                for w in range(5):
                    qpos = int(inputs.query_positions[w])
                    visible = [s for s in range(24) if s <= qpos]
                    logits = torch.stack([queries[h * 2 + g, w] @ keys[h, s] for s in visible]) * inputs.scale
                    probs = torch.softmax(logits, 0)
                    alpha += float(probs[visible.index(j)]) if j in visible else 0.0
            window_attention.append(alpha / 10)
        for j in range(24):
            alpha = max(window_attention[max(0, j - 3) : j + 4])
            if covariance == "full":
                moment_term = inputs.scale * (s_tilde @ keys[h, j]) / n
            elif covariance == "diagonal":
                moment_term = inputs.scale * s_tilde.diagonal() * keys[h, j] / n
            else:
                moment_term = 0.0
            residual = values[h, j] - ve.mean(0) - moment_term
            assert float(scores[h, j]) == pytest.approx(alpha * float(residual.norm()), rel=1e-4, abs=1e-7)
    # nothing evicted yet: attention x value norm
    inputs.evicted = EvictedMoments.zeros(None, heads, dim)
    attention = MomentKVPolicy(kernel_size=7).score(inputs) / inputs.values.norm(dim=-1)
    from vllm_kvevict.policies import SnapKVPolicy
    assert torch.allclose(attention, SnapKVPolicy(kernel_size=7).score(inputs), atol=1e-6)


def test_momentkv_requires_moment_statistics():
    from vllm_kvevict.config import KVEvictionConfigError, build_config

    config = build_config({"policy": "momentkv"})
    assert config.moment_correction and config.uses_head_pages
    assert not build_config({"policy": "snapkv"}).moment_correction
    with pytest.raises(KVEvictionConfigError, match="drop moment_correction: false"):
        build_config({"policy": "momentkv", "moment_correction": False})
