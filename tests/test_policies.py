"""Eviction policies against brute-force loop implementations of their papers'
equations, and the base-class selection against a per-head sort."""

import math

import pytest
import torch

from vllm_kvevict.eviction.select import score_heads
from vllm_kvevict.moments import EvictedMoments
from vllm_kvevict.policies import (
    POLICIES,
    EvictionPolicy,
    ScoringInputs,
    SnapKVPolicy,
    StreamingLLMPolicy,
    make_policy,
    policy_options,
)
from vllm_kvevict.policies.base import PADDING_POSITION, RotaryFrequencies


def _random_inputs(gen, num_kv_heads, group, window, num_live, head_dim, max_pos=None):
    """Compacted-cache-like inputs: each head holds distinct sorted positions.

    The queries sit at the last positions ``[end - window, end)`` where ``end``
    is one past the largest key position, so some keys lie after some queries.
    Position 0 is always kept (a sink), so every query sees at least one key.
    """
    max_pos = max_pos or num_live * 3
    positions = []
    for _ in range(num_kv_heads):
        rest = torch.randperm(max_pos - 1, generator=gen)[: num_live - 1] + 1
        positions.append(torch.cat([torch.zeros(1, dtype=torch.long), rest]).sort().values)
    key_positions = torch.stack(positions)
    end = int(key_positions.max()) + 1
    query_positions = torch.arange(end - window, end)
    keys = torch.randn(num_kv_heads, num_live, head_dim, generator=gen) * 2
    values = torch.randn(num_kv_heads, num_live, head_dim, generator=gen)
    queries = torch.randn(num_kv_heads * group, window, head_dim, generator=gen) * 2
    return ScoringInputs(
        keys, values, key_positions, queries, query_positions, 1.0 / math.sqrt(head_dim)
    )


def _snapkv_brute_force(inputs, kernel_size, pooling):
    keys, positions = inputs.keys.double(), inputs.key_positions
    queries, qpos = inputs.queries.double(), inputs.query_positions
    num_kv_heads, num_live, _ = keys.shape
    num_q_heads, window, _ = queries.shape
    group = num_q_heads // num_kv_heads
    votes = torch.zeros(num_kv_heads, num_live, dtype=torch.float64)
    for h in range(num_kv_heads):
        for g in range(group):
            j = h * group + g  # query head j reads KV head j // G
            for w in range(window):
                visible = [s for s in range(num_live) if positions[h, s] <= qpos[w]]
                logits = {s: float(queries[j, w] @ keys[h, s]) * inputs.scale for s in visible}
                top = max(logits.values())
                denom = sum(math.exp(v - top) for v in logits.values())
                for s in visible:
                    votes[h, s] += math.exp(logits[s] - top) / denom
    votes /= group * window
    pad = kernel_size // 2
    pooled = torch.empty_like(votes)
    for h in range(num_kv_heads):
        for s in range(num_live):
            lo, hi = max(0, s - pad), min(num_live, s + pad + 1)
            window_vals = votes[h, lo:hi]
            if pooling == "max":
                # -inf padding never wins against a probability
                pooled[h, s] = window_vals.max()
            else:
                pooled[h, s] = window_vals.sum() / (hi - lo)
    return pooled


@pytest.mark.parametrize(
    "num_kv_heads,group,window,num_live,head_dim,kernel_size,pooling",
    [
        (2, 2, 4, 20, 8, 7, "max"),
        (2, 2, 4, 20, 8, 5, "avg"),
        (1, 4, 6, 13, 16, 7, "max"),
        (3, 1, 5, 9, 4, 3, "avg"),
        (2, 3, 3, 5, 8, 7, "max"),  # fewer tokens than the kernel
        (2, 3, 3, 4, 8, 7, "avg"),
        (1, 2, 8, 30, 8, 3, "max"),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_snapkv_score_matches_loop(num_kv_heads, group, window, num_live, head_dim, kernel_size, pooling, seed):
    """SnapKV score = pooled mean over GQA group and window of the causal softmax."""
    gen = torch.Generator().manual_seed(seed * 100 + num_live)
    inputs = _random_inputs(gen, num_kv_heads, group, window, num_live, head_dim)
    policy = SnapKVPolicy(kernel_size=kernel_size, pooling=pooling)
    got = policy.score(inputs)
    assert got.shape == (num_kv_heads, num_live)
    want = _snapkv_brute_force(inputs, kernel_size, pooling)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_snapkv_kernel_one_is_raw_votes():
    """kernel_size=1: no smoothing; the votes of each head sum to 1 (a mean of softmaxes)."""
    gen = torch.Generator().manual_seed(7)
    inputs = _random_inputs(gen, 3, 2, 5, 17, 8)
    scores = SnapKVPolicy(kernel_size=1).score(inputs)
    torch.testing.assert_close(scores.sum(dim=-1), torch.ones(3))
    torch.testing.assert_close(scores.double(), _snapkv_brute_force(inputs, 1, "max"), atol=1e-6, rtol=1e-5)


def test_snapkv_heads_independent():
    """Changing one KV head's keys changes only that head's scores."""
    gen = torch.Generator().manual_seed(3)
    inputs = _random_inputs(gen, 3, 2, 4, 12, 8)
    before = SnapKVPolicy().score(inputs)
    inputs.keys[1] = torch.randn(12, 8, generator=gen)
    after = SnapKVPolicy().score(inputs)
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert not torch.allclose(before[1], after[1])


def test_snapkv_query_with_no_visible_key_keeps_scores_finite():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 6, 4, generator=gen)
    inputs = ScoringInputs(
        keys, keys, torch.tensor([[5, 6, 7, 8, 9, 10]]),
        torch.randn(1, 3, 4, generator=gen), torch.tensor([3, 9, 10]), 0.5,
    )
    assert torch.isfinite(SnapKVPolicy().score(inputs)).all()


class FixedScores(EvictionPolicy):
    """A policy whose scores are given, to test select() alone."""

    name = "fixed"

    def __init__(self, scores):
        self.scores = scores

    def score(self, inputs):
        return self.scores


def _brute_select(scores, positions, num_keep, num_sink, num_recent, point):
    rows = []
    for h in range(positions.shape[0]):
        live = range(positions.shape[1])
        protected = [s for s in live if positions[h, s] < num_sink or positions[h, s] >= point - num_recent]
        rest = sorted((s for s in live if s not in protected), key=lambda s: -float(scores[h, s]))
        rows.append(sorted(protected + rest[: num_keep - len(protected)]))
    return torch.tensor(rows)


@pytest.mark.parametrize("seed", range(6))
def test_select_matches_brute_force(seed):
    """select(): [H, num_keep], sorted, unique; protected tokens kept; the rest by score."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads = [1, 2, 4][seed % 3]
    num_live = 20 + 7 * seed
    inputs = _random_inputs(gen, num_kv_heads, 2, 4, num_live, 8, max_pos=num_live * 2)
    point = int(inputs.key_positions.max()) + 1 + seed % 3
    num_sink = seed % 4
    num_recent = [0, 3, 8][seed % 3]
    scores = torch.randn(num_kv_heads, num_live, generator=gen)
    # Protected tokens get the lowest scores, so keeping them is not a by-product of topk.
    protected = (inputs.key_positions < num_sink) | (inputs.key_positions >= point - num_recent)
    scores = scores.masked_fill(protected, -10.0)
    max_protected = int(protected.sum(dim=1).max())
    for num_keep in sorted({max(max_protected, num_sink + num_recent), max_protected + 1, num_live // 2, num_live - 1}):
        if num_keep < max_protected or num_keep >= num_live:
            continue
        kept = FixedScores(scores).select(inputs, num_keep, num_sink, num_recent, point)
        assert kept.shape == (num_kv_heads, num_keep)
        for h in range(num_kv_heads):
            row = kept[h].tolist()
            assert row == sorted(set(row))
        assert torch.equal(kept, _brute_select(scores, inputs.key_positions, num_keep, num_sink, num_recent, point))


def test_select_with_snapkv_scores():
    """select() with real SnapKV scores picks the protected tokens plus the top scores."""
    gen = torch.Generator().manual_seed(11)
    inputs = _random_inputs(gen, 2, 2, 4, 24, 8)
    point = int(inputs.key_positions.max()) + 1
    policy = SnapKVPolicy(kernel_size=3)
    kept = policy.select(inputs, 10, 2, 3, point)
    scores = policy.score(inputs)
    want = _brute_select(scores, inputs.key_positions, 10, 2, 3, point)
    # Max pooling makes neighbours tie, so compare the kept scores, not the indices.
    protected = (inputs.key_positions < 2) | (inputs.key_positions >= point - 3)
    for h in range(2):
        assert kept[h].tolist() == sorted(set(kept[h].tolist()))
        assert set(torch.nonzero(protected[h]).flatten().tolist()) <= set(kept[h].tolist())
        assert torch.equal(scores[h, kept[h]].sort().values, scores[h, want[h]].sort().values)


def test_select_keeps_all_when_budget_covers_everything():
    gen = torch.Generator().manual_seed(5)
    inputs = _random_inputs(gen, 3, 1, 2, 9, 4)
    for num_keep in (9, 10, 100):
        kept = SnapKVPolicy().select(inputs, num_keep, 4, 4, 50)
        assert torch.equal(kept, torch.arange(9).repeat(3, 1))


@pytest.mark.parametrize("seed", range(4))
def test_streamingllm_keeps_sinks_and_most_recent(seed):
    """StreamingLLM keeps positions < num_sink and the most recent of the rest."""
    gen = torch.Generator().manual_seed(seed)
    num_live = 30 + seed * 5
    inputs = _random_inputs(gen, 3, 1, 1, num_live, 4, max_pos=num_live * 2)
    inputs = ScoringInputs(inputs.keys, inputs.values, inputs.key_positions, None, None, 1.0)
    num_sink, num_recent = 1 + seed, 4
    point = int(inputs.key_positions.max()) + 1
    num_keep = 12
    kept = StreamingLLMPolicy().select(inputs, num_keep, num_sink, num_recent, point)
    for h in range(3):
        pos = inputs.key_positions[h].tolist()
        sinks = [s for s in range(num_live) if pos[s] < num_sink]
        others = [s for s in range(num_live) if pos[s] >= num_sink]
        want = sorted(sinks + others[len(others) - (num_keep - len(sinks)):])
        assert kept[h].tolist() == want


def test_streamingllm_dense_sequence():
    """On an uncompacted sequence the kept slots are [0, sink) + [S - (keep - sink), S)."""
    num_live, num_keep, num_sink = 40, 15, 4
    positions = torch.arange(num_live).repeat(2, 1)
    keys = torch.randn(2, num_live, 8)
    inputs = ScoringInputs(keys, keys, positions, None, None, 1.0)
    kept = StreamingLLMPolicy().select(inputs, num_keep, num_sink, 2, num_live)
    want = list(range(num_sink)) + list(range(num_live - (num_keep - num_sink), num_live))
    assert kept.tolist() == [want, want]


def test_policy_registry():
    assert sorted(POLICIES) == [
        "criticalkv", "defensivekv", "expected_attention", "h2o", "keydiff", "knorm", "kvzip",
        "layer_defensivekv", "learned", "momentkv", "pyramidkv", "random", "snapkv", "streamingllm",
        "tova",
    ]
    assert policy_options("snapkv") == {"kernel_size": 15, "pooling": "max"}
    assert policy_options("streamingllm") == {}
    assert SnapKVPolicy.needs_queries and not StreamingLLMPolicy.needs_queries
    assert make_policy("snapkv", {"kernel_size": 3}) == SnapKVPolicy(kernel_size=3)
    assert make_policy("streamingllm") == StreamingLLMPolicy()


@pytest.mark.parametrize("name", ["keydiff", "knorm", "kvzip", "learned", "random", "streamingllm"])
def test_token_wise_scores_stay_on_the_inputs_device(name: str) -> None:
    """A policy that scores without reading values back builds every tensor
    on its inputs' device, so it scores on a GPU: checked on the meta device,
    which holds no data and refuses a CPU tensor beside its own."""
    from vllm_kvevict.moments import EvictedMoments

    heads, group, num_live, window, dim = 2, 2, 48, 4, 16
    meta = dict(device="meta")
    keys = torch.randn(heads, num_live, dim, **meta)
    inputs = ScoringInputs(
        keys, torch.randn(heads, num_live, dim, **meta), torch.arange(num_live, **meta).expand(heads, -1),
        torch.randn(heads * group, window, dim, **meta), torch.arange(num_live - window, num_live, **meta),
        dim**-0.5, EvictedMoments.zeros(None, heads, dim, "meta"), log_beta=torch.zeros(heads, num_live, **meta),
        step=num_live, reconstruction=torch.rand(heads, num_live, **meta),
    )
    scores = make_policy(name).score(inputs)
    assert scores.device.type == "meta" and scores.shape == (heads, num_live)


def test_make_policy_errors():
    with pytest.raises(ValueError, match="criticalkv, defensivekv, expected_attention, h2o, keydiff"):
        make_policy("scissorhands")
    with pytest.raises(ValueError, match="kernel_size, pooling"):
        make_policy("snapkv", {"window": 3})
    with pytest.raises(ValueError, match="none"):
        make_policy("streamingllm", {"kernel_size": 3})
    for bad in (0, 2, 4, -3):
        with pytest.raises(ValueError, match="odd"):
            make_policy("snapkv", {"kernel_size": bad})
    with pytest.raises(ValueError, match="pooling"):
        make_policy("snapkv", {"pooling": "min"})


@pytest.mark.parametrize("options,message", [
    ({"policy": "snapkv", "policy_options": {"kernel_size": 7.0}}, "'kernel_size' must be an integer, got 7.0"),
    ({"policy": "snapkv", "policy_options": {"kernel_size": "7"}}, "must be an integer, got '7'"),
    ({"policy": "snapkv", "policy_options": {"kernel_size": True}}, "must be an integer, got True"),
    ({"policy": "random", "policy_options": {"seed": "x"}}, "'seed' must be an integer"),
    ({"policy": "momentkv", "policy_options": {"rounds": 2.5}}, "'rounds' must be an integer"),
    ({"policy": "snapkv", "policy_options": {"pooling": "mean"}}, "must be one of 'max', 'avg'"),
    ({"policy": "expected_attention", "policy_options": {"use_covariance": 1}}, "must be true or false"),
    ({"policy": "learned", "head_budget": "global", "policy_options": {"gates": 3}}, "must be a string or null"),
    ({"policy": "criticalkv", "policy_options": {"base": "snapkv", "base_options": {"window": 3}}},
     "criticalkv base_options: policy 'snapkv' has no option 'window'"),
    ({"policy": "criticalkv", "policy_options": {"base": "snapkv", "base_options": {"kernel_size": 7.5}}},
     "criticalkv base_options: policy 'snapkv' option 'kernel_size' must be an integer"),
    ({"policy": "criticalkv", "policy_options": {"base_options": [7]}}, "must be a mapping"),
])
def test_policy_options_of_the_wrong_type_are_one_line_at_start_up(options, message):
    """A wrong type is refused when the config is built (one line naming the
    option and what it must be), not at the first eviction."""
    from vllm_kvevict.config import KVEvictionConfigError, build_config

    with pytest.raises(KVEvictionConfigError) as info:
        build_config({"budget": 256, **options})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_numbers_for_float_options_are_taken_as_floats():
    from vllm_kvevict.config import build_config

    policy = build_config({"policy": "expected_attention", "policy_options": {"epsilon": 1}}).build_policy()
    assert policy.epsilon == 1.0 and isinstance(policy.epsilon, float)


@pytest.mark.parametrize("seed", range(6))
def test_grouped_attention_probs_against_a_loop(seed):
    """Causal window attention, one softmax per (query head, query) over the
    keys at or before it, against a loop; keys in any order, padding after
    every query, and queries older than every key of a head (zero weight)."""
    from vllm_kvevict.policies.base import PADDING_POSITION, grouped_attention_probs

    gen = torch.Generator().manual_seed(seed)
    heads, group, window, live, dim = 3, 2, 8, 40, 32
    inputs = _random_inputs(gen, heads, group, window, live, dim)
    key_positions = inputs.key_positions.clone()
    for h in range(heads):  # shuffled order, padding at random places
        key_positions[h] = key_positions[h, torch.randperm(live, generator=gen)]
    key_positions[0, torch.randperm(live, generator=gen)[:5]] = PADDING_POSITION
    if seed % 2:  # head 2 holds only keys after the oldest queries
        key_positions[2] = int(inputs.query_positions[window // 2]) + torch.arange(live)
    inputs.key_positions = key_positions
    probs = grouped_attention_probs(inputs)
    expected = torch.zeros_like(probs)
    for h in range(heads):
        for g in range(group):
            for w in range(window):
                visible = key_positions[h] <= inputs.query_positions[w]
                if not bool(visible.any()):
                    continue
                q = inputs.queries[h * group + g, w].double()
                logits = (inputs.keys[h][visible].double() @ q) * inputs.scale
                expected[h, g, w, visible] = torch.softmax(logits, 0).float()
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)
    if seed % 2:
        assert bool((probs[2, :, : window // 2] == 0).all())


# DefensiveKV's value factor is a share of the layer's KV heads at each
# position, so its heads are coupled by design (tests/test_defensivekv.py
# checks its ragged layers against a reference).
HEAD_COUPLED = ("defensivekv", "layer_defensivekv")


@pytest.mark.parametrize(
    "name", sorted(n for n, cls in POLICIES.items() if cls.needs_queries and n not in HEAD_COUPLED)
)
@pytest.mark.parametrize("seed", range(3))
def test_ragged_heads_scored_apart_get_their_padded_scores(name, seed):
    """Heads holding different numbers of tokens (per-head page tables pad
    the shorter ones) are scored one by one over their own tokens, or whole
    by a policy that skips the padding itself (``scores_ragged_heads``):
    every query-based policy gives each live token the score it gives it in
    the padded layer and in a layer of that head alone, so none couples its
    heads and each head reads its own query group, moments and projection
    slice."""
    gen = torch.Generator().manual_seed(seed)
    heads, group, dim, window, d_model, end = 3, 3, 32, 8, 24, 240
    lengths = [int(n) for n in torch.randperm(50, generator=gen)[:heads] + window + 4]
    width = max(lengths)
    keys = torch.zeros(heads, width, dim)
    values = torch.zeros(heads, width, dim)
    positions = torch.full((heads, width), PADDING_POSITION, dtype=torch.long)
    live = torch.zeros(heads, width, dtype=torch.bool)
    for h, n in enumerate(lengths):
        rest = torch.randperm(end - 1, generator=gen)[: n - 1] + 1
        positions[h, :n] = torch.cat([torch.zeros(1, dtype=torch.long), rest]).sort().values
        keys[h, :n] = torch.randn(n, dim, generator=gen) * 2
        values[h, :n] = torch.randn(n, dim, generator=gen)
        live[h, :n] = True
    moments = EvictedMoments.zeros(None, heads, dim)
    moments.fold_(torch.randn(heads, 20, dim, generator=gen), torch.randn(heads, 20, dim, generator=gen))
    inputs = ScoringInputs(
        keys, values, positions, torch.randn(heads * group, window, dim, generator=gen) * 2,
        torch.arange(end - window, end), 1.0 / math.sqrt(dim), moments,
        rotary=RotaryFrequencies(1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
        output_projection=torch.randn(heads * group, dim, d_model, generator=gen),
    )
    policy = make_policy(name)
    padded = policy.score(inputs).float()
    chosen = score_heads(policy, inputs, live)
    for h, n in enumerate(lengths):
        alone = policy.score(inputs.head(h, n))[0].float()
        torch.testing.assert_close(chosen[h, :n], alone, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(padded[h, :n], alone, rtol=1e-4, atol=1e-6)
        if not policy.scores_ragged_heads:
            assert not chosen[h, n:].any()
