"""Retention gates and global top-B (learned global eviction, the policy side),
against the paper's closed forms, explicit sums and brute force."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvevict.eviction.allocation import global_top_b
from vllm_kvevict.policies.retention_gate import (
    RetentionGateConfig,
    RetentionGates,
    lookahead_log_score,
)


def test_gate_shapes_dtype_and_the_untrained_gate_keeps_everything() -> None:
    config = RetentionGateConfig(hidden_size=64, num_layers=3, num_kv_heads=4, width=32)
    gates = RetentionGates(config)
    hidden = torch.randn(2, 7, 64, dtype=torch.float64).to(torch.bfloat16)
    gates = gates.to(torch.bfloat16)
    for layer in range(3):
        log_beta = gates(layer, hidden)
        assert log_beta.shape == (2, 7, 4) and log_beta.dtype == torch.float32
        assert bool((log_beta <= 0).all())
    # bias 18: log σ(18) = -log(1 + e^-18) ≈ -1.5e-8, in fp32 from an fp32 gate.
    fp32 = RetentionGates(config)
    with torch.no_grad():
        log_beta = fp32(1, torch.randn(5, 64))
    assert torch.allclose(log_beta, torch.full_like(log_beta, -math.log1p(math.exp(-18.0))), atol=5e-9)


def test_readout_is_one_module_for_every_layer_when_tied() -> None:
    tied = RetentionGates(RetentionGateConfig(hidden_size=16, num_layers=4, num_kv_heads=2, width=8))
    assert all(tied.readout(layer)[0] is tied.readout(0)[0] for layer in range(4))
    untied = RetentionGates(RetentionGateConfig(hidden_size=16, num_layers=4, num_kv_heads=2, width=8,
                                                tie_readout=False))
    assert len({id(untied.readout(layer)[0]) for layer in range(4)}) == 4


@pytest.mark.parametrize("hidden, layers, heads, stored, unique", [
    # The authors' rg10 gate (the paper's §4.1): width 512, 8 KV heads.
    (1024, 28, 8, 22_163_680, 22_052_872),   # Qwen3-0.6B
    (2560, 36, 8, 56_807_712, 56_664_072),   # Qwen3-4B
])
def test_parameter_counts_match_the_specs_table(hidden, layers, heads, stored, unique) -> None:
    config = RetentionGateConfig(hidden_size=hidden, num_layers=layers, num_kv_heads=heads)
    tied = sum(p.numel() for p in RetentionGates(config).parameters())
    per_layer_readout = heads * 512 + heads
    assert tied == unique
    assert tied + (layers - 1) * per_layer_readout == stored


@pytest.mark.parametrize("beta", [0.5, 0.99, 1 - 1e-8])
@pytest.mark.parametrize("horizon", [1, 2, 7])
def test_lookahead_score_is_the_explicit_sum(beta: float, horizon: int) -> None:
    """The lookahead score (§4.2) in closed form against Σ_{k=1..H} β^(t + k - i), in fp64 logs (ages up to 1e6)."""
    positions = torch.tensor([0, 1, 10, 1000, 999_999], dtype=torch.int64)
    step = 1_000_000
    log_beta = torch.full((5,), math.log(beta), dtype=torch.float64)
    got = lookahead_log_score(log_beta, positions, step, horizon)
    for i, position in enumerate(positions.tolist()):
        terms = [(step + k - position) * math.log(beta) for k in range(1, horizon + 1)]
        top = max(terms)
        expected = top + math.log(sum(math.exp(t - top) for t in terms))
        assert got[i].item() == pytest.approx(expected, rel=1e-9, abs=1e-9)
    # fp32, as served: within fp32 rounding of the fp64 value.
    got32 = lookahead_log_score(log_beta.float(), positions, step, horizon)
    assert torch.allclose(got32.double(), got, rtol=1e-5, atol=1e-5)


def test_longer_horizons_favour_long_lived_tokens() -> None:
    """A recent short-lived token beats an old long-lived one myopically, and
    loses to it when the horizon is long (the paper's §4.2)."""
    log_beta = torch.log(torch.tensor([0.99, 0.999], dtype=torch.float64))
    positions = torch.tensor([99, 1])  # ages 2 and 100 at step 100: 0.98 against 0.905
    myopic = lookahead_log_score(log_beta, positions, 100, horizon=1)
    far = lookahead_log_score(log_beta, positions, 100, horizon=1000)
    assert myopic[0] > myopic[1] and far[0] < far[1]


def brute_force_keep(scores: torch.Tensor, budget: int) -> set[tuple[int, int]]:
    entries = [(scores[s, n].item(), s, n) for s in range(scores.shape[0]) for n in range(scores.shape[1])
               if scores[s, n] > float("-inf")]
    entries.sort(reverse=True)
    return {(s, n) for _, s, n in entries[:budget]}


def random_streams(generator: torch.Generator, streams: int, width: int) -> torch.Tensor:
    """Streams of different lengths and score scales (heads that need more)."""
    scale = torch.rand(streams, 1, generator=generator) * 4
    scores = torch.randn(streams, width, generator=generator, dtype=torch.float64) * scale
    lengths = torch.randint(1, width + 1, (streams,), generator=generator)
    scores[torch.arange(width)[None, :] >= lengths[:, None]] = float("-inf")
    return scores


def test_global_top_b_keeps_exactly_the_best_b_across_streams() -> None:
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    for _ in range(20):
        scores = random_streams(generator, 12, 40)
        live = int((scores > float("-inf")).sum())
        budget = int(torch.randint(1, live + 5, (1,), generator=generator))
        keep = global_top_b(scores, budget)
        assert int(keep.sum()) == min(budget, live)
        assert {tuple(x) for x in keep.nonzero().tolist()} == brute_force_keep(scores, budget)
    lengths = global_top_b(scores, live // 2).sum(-1)
    assert len(set(lengths.tolist())) > 1  # different lengths for different streams


def test_floor_keeps_each_streams_best_and_the_budget_exactly() -> None:
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    for _ in range(20):
        scores = random_streams(generator, 8, 30)
        live_per_stream = (scores > float("-inf")).sum(-1)
        live = int(live_per_stream.sum())
        floor = 3
        budget = int(torch.randint(floor * 8, live + 1, (1,), generator=generator))
        keep = global_top_b(scores, budget, floor=floor)
        assert int(keep.sum()) == min(budget, live)
        counts = keep.sum(-1)
        assert bool((counts >= torch.clamp(live_per_stream, max=floor)).all())
        for s in range(8):  # within a stream, the kept are its best
            kept, dropped = scores[s][keep[s]], scores[s][~keep[s] & (scores[s] > float("-inf"))]
            if kept.numel() and dropped.numel():
                assert kept.min() > dropped.max()
    with pytest.raises(ValueError, match="floor"):
        global_top_b(scores, 10, floor=2)


def test_pinned_entries_always_stay() -> None:
    scores = torch.randn(4, 10, dtype=torch.float64)
    scores[:, 0] = float("inf")  # sinks
    keep = global_top_b(scores, 6)
    assert bool(keep[:, 0].all()) and int(keep.sum()) == 6
