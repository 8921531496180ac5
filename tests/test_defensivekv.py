"""DefensiveKV and Layer-DefensiveKV against a brute-force transcription of
the paper's aggregation (Alg. 1) and of the authors' scoring and selection
(``efficient_defensivekv_press.py``), written one token at a time in fp64 on
fresh random inputs: GQA groups 1, 3 and 4, heads holding different tokens,
AdaKV head budgets, and one ranking over every layer and KV head."""

import math

import pytest
import torch

from vllm_kvevict.config import KVEvictionConfigError, build_config
from vllm_kvevict.eviction.allocation import (
    AdaKVAllocation,
    GlobalAllocation,
    allocate_head_tokens,
)
from vllm_kvevict.eviction.select import KeepRule, choose_kept, score_heads
from vllm_kvevict.policies import DefensiveKVPolicy, LayerDefensiveKVPolicy, ScoringInputs, make_policy
from vllm_kvevict.policies.base import PADDING_POSITION
from vllm_kvevict.policies.defensivekv import defensive_aggregation
from vllm_kvevict.top_k import select_top

INF = float("inf")


def _inputs(gen, heads=3, group=3, window=8, end=120, dim=16, d_model=24, ragged=True, hot=0):
    """One layer whose heads hold different tokens older than the window
    (position 0 and a random subset of the rest: compacted by earlier
    evictions) and every window token, each head's real tokens first in
    position order, then padding; the window's queries at ``[end - window, end)``.
    ``hot`` older keys per head point along the head's mean query, so that
    they draw most of the attention (stage 1's set is then smaller than its
    cap)."""
    held = []
    for _ in range(heads):
        older = torch.randperm(end - window - 1, generator=gen) + 1
        count = end - window - 1
        if ragged:
            count = int(torch.randint(end // 3, count, (1,), generator=gen))
        held.append(torch.cat([torch.zeros(1, dtype=torch.long), older[:count].sort().values,
                               torch.arange(end - window, end)]))
    width = max(len(p) for p in held)
    positions = torch.full((heads, width), PADDING_POSITION, dtype=torch.long)
    keys = torch.zeros(heads, width, dim, dtype=torch.float64)
    values = torch.zeros(heads, width, dim, dtype=torch.float64)
    for h, p in enumerate(held):
        positions[h, : len(p)] = p
        keys[h, : len(p)] = torch.randn(len(p), dim, generator=gen, dtype=torch.float64) * 1.5
        values[h, : len(p)] = torch.randn(len(p), dim, generator=gen, dtype=torch.float64) * (
            0.3 + torch.rand(len(p), 1, generator=gen, dtype=torch.float64)
        )
    queries = torch.randn(heads * group, window, dim, generator=gen, dtype=torch.float64) * 1.5
    for h, p in enumerate(held):
        direction = queries[h * group : (h + 1) * group].mean((0, 1))
        for j in (torch.randperm(len(p) - window - 1, generator=gen)[:hot] + 1).tolist():
            length = (10.0 + torch.rand(1, generator=gen, dtype=torch.float64)) * dim ** 0.5
            keys[h, j] = direction / direction.norm() * length
    projection = torch.randn(heads * group, dim, d_model, generator=gen, dtype=torch.float64)
    return ScoringInputs(
        keys, values, positions, queries, torch.arange(end - window, end), 1 / math.sqrt(dim),
        output_projection=projection,
    )


def _reference(inputs, kernel=5, mass_target=0.9):
    """The authors' scoring, token by token in fp64.

    Returns per head the live slots, the score ``S`` of each (``R · N̂``
    older than the window, the layer's highest ``S`` on the window), the
    stage-1 share of each older slot, the stage-1 target
    ``mass_target − window_bias`` and the window length ``w``."""
    heads, _, _ = inputs.keys.shape
    group = inputs.queries.shape[0] // heads
    window = inputs.queries.shape[1]
    first_query = int(inputs.query_positions.min())
    live = [[j for j in range(inputs.keys.shape[1]) if inputs.key_positions[h, j] < PADDING_POSITION]
            for h in range(heads)]
    older = [[j for j in live[h] if inputs.key_positions[h, j] < first_query] for h in range(heads)]
    attention = {}  # (h, g, w) -> {slot: probability}, causal
    for h in range(heads):
        for g in range(group):
            for w in range(window):
                q = inputs.queries[h * group + g, w]
                seen = [j for j in live[h] if inputs.key_positions[h, j] <= inputs.query_positions[w]]
                logits = torch.tensor([float(q @ inputs.keys[h, j]) * inputs.scale for j in seen],
                                      dtype=torch.float64)
                attention[h, g, w] = dict(zip(seen, torch.softmax(logits, 0).tolist()))
    # window_bias: the attention on the w keys just before the window, averaged
    # over heads, group and queries (the code's slice of the truncated rows).
    bias_terms = [
        sum(p for j, p in row.items() if first_query - window <= inputs.key_positions[h, j] < first_query)
        for (h, _, _), row in attention.items()
    ]
    window_bias = sum(bias_terms) / len(bias_terms)
    norms = {}
    for h in range(heads):
        for j in older[h]:
            norms[h, j] = sum(
                float((inputs.values[h, j] @ inputs.output_projection[h * group + g]).abs().sum())
                for g in range(group)
            ) / group
    by_position = {}  # position -> norms of the heads holding it
    for (h, j), n in norms.items():
        by_position.setdefault(int(inputs.key_positions[h, j]), []).append(n)
    # The sum over every head: that of the holders, scaled to all heads.
    total = {position: heads * sum(held) / len(held) for position, held in by_position.items()}
    scores, shares = [], []
    for h in range(heads):
        worst = {j: 0.0 for j in older[h]}
        for g in range(group):
            for w in range(window):
                row = [attention[h, g, w].get(j, 0.0) for j in older[h]]
                reach = range(-(kernel // 2), kernel // 2 + 1)
                pooled = [sum(row[i + d] for d in reach if 0 <= i + d < len(row)) / kernel
                          for i in range(len(row))]
                if sum(pooled) > 0:
                    pooled = [p * sum(row) / sum(pooled) for p in pooled]
                for i, j in enumerate(older[h]):
                    worst[j] = max(worst[j], pooled[i])
        prior = sum(worst.values()) / len(worst)
        scores.append({
            j: max(worst[j], prior) * norms[h, j] / total[int(inputs.key_positions[h, j])]
            for j in older[h]
        })
        rows = [attention[h, g, w] for g in range(group) for w in range(window)]
        mean = {j: sum(row.get(j, 0.0) for row in rows) / len(rows) for j in older[h]}
        shares.append({j: m / sum(mean.values()) for j, m in mean.items()})
    highest = max(max(s.values()) for s in scores)
    for h in range(heads):
        for j in live[h]:
            scores[h].setdefault(j, highest)
    return live, scores, shares, mass_target - window_bias, window


def _rounded(score):
    """Scores equal in exact arithmetic (the window's layer maximum; scores
    floored at the same prior) tie, as in every selection: to the earlier slot."""
    return score if math.isinf(score) else round(score, 12)


def _protected(inputs, h, j, num_sink, num_recent, point):
    position = int(inputs.key_positions[h, j])
    return position < num_sink or position >= point - num_recent


def _reference_keep(inputs, reference, h, count, num_sink, num_recent, point):
    """Stream ``h``'s kept slots for its count: the sinks and recent window,
    stage 1 (the fewest older keys, by window attention, whose share reaches
    the target, the crossing key excluded; at most ⌊(n − w) b / n − w⌋ and
    never below 0; what the count leaves), then the highest ``S``."""
    live, scores, shares, target, window = reference
    fixed = [j for j in live[h] if _protected(inputs, h, j, num_sink, num_recent, point)]
    ranked = sorted(shares[h], key=lambda j: (-shares[h][j], j))
    total, reached = 0.0, 0
    for i, j in enumerate(ranked):
        total += shares[h][j]
        if total >= target:
            reached = i
            break
    n = len(live[h])
    cap = max(0, int((n - window) * count / n - window))
    first = [j for j in ranked[: min(reached, cap)] if j not in fixed][: max(0, count - len(fixed))]
    rest = sorted((j for j in live[h] if j not in fixed and j not in first),
                  key=lambda j: (-_rounded(scores[h][j]), j))
    return set(fixed) | set(first) | set(rest[: count - len(fixed) - len(first)]), reached, cap


@pytest.mark.parametrize("seed", range(4))
def test_defensive_aggregation_is_worst_case_floored_at_the_mean(seed):
    """Alg. 1 on its own: R_i = max(max over (g, w) of I, mean_i of those
    maxima), the mean over each head's keys of ``prefix`` alone."""
    gen = torch.Generator().manual_seed(seed)
    heads, group, window, keys = 3, 4, 6, 30
    importance = torch.rand(heads, group, window, keys, generator=gen, dtype=torch.float64) ** 4
    prefix = torch.rand(heads, keys, generator=gen) < 0.8
    got = defensive_aggregation(importance, prefix)
    for h in range(heads):
        chosen = [i for i in range(keys) if prefix[h, i]]
        worst = {i: float(importance[h, :, :, i].max()) for i in chosen}
        prior = sum(worst.values()) / len(worst)
        for i in range(keys):
            want = max(worst[i], prior) if prefix[h, i] else 0.0
            assert math.isclose(float(got[h, i]), want, rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ragged", [True, False])
def test_scores_equal_the_reference(group, seed, ragged):
    """S = max(R̃, R̄) · N̂ on each head's keys older than the window (the
    pooled window attention's maximum over queries and group, floored at the
    head's mean; the value norm's share of the layer's heads at the
    position), the layer's highest S on the window, whether the heads hold
    the same tokens or not; whole-layer scoring equals the policy's own."""
    gen = torch.Generator().manual_seed(100 * group + seed)
    inputs = _inputs(gen, group=group, ragged=ragged)
    policy = DefensiveKVPolicy()
    got = policy.score(inputs)
    live, scores, _, _, _ = _reference(inputs)
    for h in range(inputs.keys.shape[0]):
        for j in live[h]:
            assert math.isclose(float(got[h, j]), scores[h][j], rel_tol=1e-4, abs_tol=1e-9), (h, j)
    padded = inputs.key_positions == PADDING_POSITION
    assert not got[padded].any()
    torch.testing.assert_close(score_heads(policy, inputs, ~padded), got.float())
    # Without the cross-head share, a head scored alone would score the same;
    # with it, N̂ = 1 for a single head: the heads are coupled by design.
    alone = policy.score(inputs.head(0, len(live[0])))
    assert not torch.allclose(alone[0], got[0, : len(live[0])])


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hot", [0, 5])
def test_selection_under_adakv_equals_the_reference(group, seed, hot):
    """With AdaKV counts made on S, each head keeps its sinks and recent
    window, its stage-1 set within its count, then its highest S."""
    gen = torch.Generator().manual_seed(200 * group + 10 * hot + seed)
    inputs = _inputs(gen, group=group, hot=hot)
    policy = DefensiveKVPolicy()
    point, num_sink, num_recent = 120, 2, 8
    live = inputs.key_positions < PADDING_POSITION
    masked = policy.masked_scores(inputs, num_sink, num_recent, point, live)
    counts = allocate_head_tokens(AdaKVAllocation(0.2), masked, total_pages=3 * 8, page_size=4)
    kept = select_top(policy.refine_scores(inputs, masked, counts), counts)
    reference = _reference(inputs)
    below_cap = 0
    for h, count in enumerate(counts.tolist()):
        want, reached, cap = _reference_keep(inputs, reference, h, count, num_sink, num_recent, point)
        assert set(kept[h, :count].tolist()) == want
        below_cap += 0 < reached < cap
    assert int(counts.sum()) == 96
    if hot:  # the mass rule, not the cap, sets stage 1 somewhere
        assert below_cap


@pytest.mark.parametrize("seed", range(3))
def test_layer_pooled_ranking_equals_the_reference(seed):
    """Layer-DefensiveKV: one top-B over every (layer, KV head) stream of the
    masked scores (sinks and recent window kept; the window's other keys at
    their layer's highest S), then each stream's stage 1 and highest S
    within its count; the config ranks globally by default."""
    gen = torch.Generator().manual_seed(300 + seed)
    layers = [_inputs(gen, group=4, window=8, end=100, hot=index) for index in range(4)]
    point, num_sink, num_recent = 100, 4, 4  # the window's 4 oldest keys at the layer's maximum
    policy = LayerDefensiveKVPolicy()
    rule = KeepRule(policy, GlobalAllocation(), num_sink, num_recent)
    live = [inputs.key_positions < PADDING_POSITION for inputs in layers]
    budget = 4 * 3 * 20
    counts, kept = choose_kept(rule, layers, live, point, budget, 1)
    references = [_reference(inputs) for inputs in layers]
    entries = []  # (score, layer-major flat index, stream)
    width = max(inputs.keys.shape[1] for inputs in layers)
    for index, (inputs, reference) in enumerate(zip(layers, references)):
        for h in range(3):
            for j in reference[0][h]:
                value = INF if _protected(inputs, h, j, num_sink, num_recent, point) else reference[1][h][j]
                entries.append((value, (index * 3 + h) * width + j, index * 3 + h))
    winners = sorted(entries, key=lambda e: (-_rounded(e[0]), e[1]))[:budget]
    want_counts = [sum(1 for e in winners if e[2] == stream) for stream in range(12)]
    assert counts.tolist() == want_counts and sum(want_counts) == budget
    assert len(set(want_counts)) > 1  # the streams keep different numbers
    for stream, count in enumerate(want_counts):
        index, h = divmod(stream, 3)
        want, _, _ = _reference_keep(layers[index], references[index], h, count, num_sink, num_recent, point)
        assert set(kept[stream, :count].tolist()) == want
    config = build_config({"policy": "layer_defensivekv"})
    assert config.head_budget == "global" and config.storage_name == "global"
    assert isinstance(config.build_allocation(), GlobalAllocation)
    assert build_config({"policy": "defensivekv"}).head_budget == "adaptive"


def test_stage_one_target_is_the_codes_window_bias():
    """The stage-1 target is 0.9 less the attention the window pays the w
    keys just before it, not the window's own keys."""
    gen = torch.Generator().manual_seed(7)
    inputs = _inputs(gen, ragged=False, hot=3)
    policy = DefensiveKVPolicy()
    policy.score(inputs)
    _, _, _, target, window = _reference(inputs)
    assert math.isclose(float(inputs.memo["defensivekv.threshold"]), target, rel_tol=1e-5)
    assert int(inputs.memo["defensivekv.window"]) == window == 8
    assert 0.0 < 0.9 - target < 0.9


@pytest.mark.parametrize("count,num_sink,num_recent", [
    (6, 2, 4), (12, 2, 4), (20, 2, 4), (40, 2, 4), (32, 4, 24), (40, 4, 24), (56, 4, 24),
])
def test_small_budgets_keep_the_count_and_the_window(count, num_sink, num_recent):
    """Where ⌊(n − w) b / n − w⌋ is negative (b below about w) stage 1 keeps
    nothing; where the sinks and a recent window longer than the
    observation window leave less than stage 1's set, it keeps what they
    leave; each head keeps exactly its count, the sinks and recent window
    among them."""
    gen = torch.Generator().manual_seed(count)
    inputs = _inputs(gen, ragged=False, hot=8)
    policy = DefensiveKVPolicy()
    kept = policy.select(inputs, count, num_sink, num_recent, point=120)
    assert kept.shape == (3, count)
    reference = _reference(inputs)
    for h in range(3):
        row = kept[h].tolist()
        held = {int(inputs.key_positions[h, j]) for j in row}
        assert row == sorted(set(row)) and held >= set(range(num_sink)) | set(range(120 - num_recent, 120))
        assert set(row) == _reference_keep(inputs, reference, h, count, num_sink, num_recent, 120)[0]


def test_options_and_missing_projection_are_refused():
    with pytest.raises(ValueError, match="kernel_size must be a positive odd number"):
        make_policy("defensivekv", {"kernel_size": 4})
    with pytest.raises(ValueError, match=r"stage_one_mass must be in \[0, 1\]"):
        make_policy("layer_defensivekv", {"stage_one_mass": 1.5})
    with pytest.raises(KVEvictionConfigError, match="head_budget 'pyramid'"):
        build_config({"policy": "defensivekv", "head_budget": "pyramid"})
    inputs = _inputs(torch.Generator().manual_seed(1))
    inputs.output_projection = None
    with pytest.raises(AssertionError, match="defensivekv needs the output projection"):
        DefensiveKVPolicy().score(inputs)


@pytest.mark.parametrize("seed", range(4))
def test_requests_stacked_score_and_refine_as_each_alone(seed):
    """The KV heads of requests with their own windows (of different
    lengths), points, positions and ragged heads, stacked as one layer of
    ``R * H`` rows (``windows``), score and refine as each request alone:
    the same scores up to fp32 rounding, the same stage-1 sets and kept
    tokens (a request's window, value shares, highest score and stage-1
    signal its own)."""
    from vllm_kvevict.policies.base import StackedWindows

    gen = torch.Generator().manual_seed(700 + seed)
    shapes = [(8, 120), (5, 90), (8, 100), (3, 64)]  # (window, end) per request
    alone = [_inputs(gen, window=w, end=e) for w, e in shapes]
    projection = alone[0].output_projection
    for inputs in alone:
        inputs.output_projection = projection
    heads, width = alone[0].keys.shape[0], max(i.keys.shape[1] for i in alone)
    window = max(w for w, _ in shapes)

    def padded(t, fill):
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]), value=fill)

    queries = torch.stack([
        torch.nn.functional.pad(i.queries, (0, 0, 0, window - i.queries.shape[1])) for i in alone
    ])
    stacked = ScoringInputs(
        torch.cat([padded(i.keys, 0.0) for i in alone]), torch.cat([padded(i.values, 0.0) for i in alone]),
        torch.cat([padded(i.key_positions, PADDING_POSITION) for i in alone]), None, None, alone[0].scale,
        output_projection=projection,
        windows=StackedWindows(queries, torch.tensor([w for w, _ in shapes]), torch.tensor([e for _, e in shapes])),
    )
    policy = DefensiveKVPolicy()
    got = policy.score(stacked)
    masked, counts = [], []
    for r, (inputs, (_, end)) in enumerate(zip(alone, shapes)):
        want = policy.score(inputs)
        rows = got[r * heads : (r + 1) * heads]
        torch.testing.assert_close(rows[:, : want.shape[1]], want, rtol=1e-5, atol=1e-9)
        assert not rows[:, want.shape[1] :].any()
        live = inputs.key_positions < PADDING_POSITION
        m = policy.masked_scores(inputs, 2, 2, end, live)
        masked.append(padded(m[..., None], -INF)[..., 0])
        counts.append(allocate_head_tokens(AdaKVAllocation(0.2), m, total_pages=heads * 6, page_size=4))
    refined = policy.refine_scores(stacked, torch.cat(masked), torch.cat(counts))
    for r, inputs in enumerate(alone):
        want = policy.refine_scores(inputs, masked[r][:, : inputs.keys.shape[1]], counts[r])
        rows = refined[r * heads : (r + 1) * heads, : want.shape[1]]
        assert torch.equal(torch.isinf(rows), torch.isinf(want))  # the same stage-1 sets (and padding)
        finite = torch.isfinite(want)
        torch.testing.assert_close(rows[finite], want[finite], rtol=1e-5, atol=1e-9)
        assert torch.equal(select_top(rows, counts[r]), select_top(want, counts[r]))


@pytest.mark.parametrize("seed", range(6))
def test_value_norm_shares_equal_a_position_by_position_sum(seed):
    """Each token's value factor as a share of its position's KV heads
    (heads that dropped the position counted at the mean of those holding
    it), for requests stacked, heads holding random positions, some not
    computed: against a loop over requests and positions in fp64."""
    from vllm_kvevict.policies.defensivekv import value_norm_shares

    gen = torch.Generator().manual_seed(seed + 1000 * int(torch.randint(0, 1000, ())))
    requests, heads, width, group, dim = 3, 4, 40, 2, 8
    values = torch.randn(requests * heads, width, dim, generator=gen)
    projection = torch.randn(heads * group, dim, 12, generator=gen)
    positions = torch.full((requests * heads, width), PADDING_POSITION, dtype=torch.int64)
    tokens = torch.zeros(requests * heads, width, dtype=torch.bool)
    for row in range(requests * heads):
        held = int(torch.randint(0, width + 1, (1,), generator=gen))
        positions[row, :held] = torch.randperm(60, generator=gen)[:held].sort().values
        tokens[row, :held] = torch.rand(held, generator=gen) < 0.8
    shares = value_norm_shares(values, projection, positions, tokens, requests)
    for r in range(requests):
        rows = range(r * heads, (r + 1) * heads)
        per_head = {}
        for row in rows:
            h = row - r * heads
            w = projection[h * group : (h + 1) * group].double()  # [G, D, d_model]
            n = (values[row].double() @ w).abs().sum(-1).mean(0)  # [S]: ‖v W_O‖₁ averaged over the group
            per_head[row] = n
        for row in rows:
            for i in range(width):
                if not tokens[row, i]:
                    assert shares[row, i] == 0
                    continue
                p = int(positions[row, i])
                holding = [(o, j) for o in rows for j in range(width) if tokens[o, j] and positions[o, j] == p]
                total = sum(float(per_head[o][j]) for o, j in holding) * heads / len(holding)
                want = float(per_head[row][i]) / total if total > 0 else 0.0
                assert math.isclose(float(shares[row, i]), want, rel_tol=1e-4, abs_tol=1e-7), (r, row, i)
