"""The bootstrap intervals of `kvevict eval` (``evaluation/stats.py``) against
closed forms, exact enumeration of small bootstrap distributions, and coverage
over simulated datasets. Inputs are fresh random draws unless a test needs a
fixed seed to be deterministic (the coverage tests)."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys

import numpy as np
import pytest

from vllm_kvevict.evaluation.stats import (
    Interval,
    bootstrap_mean_interval,
    bootstrap_means,
    paired_difference_interval,
    paired_differences,
    stratified_bootstrap,
    stratified_bootstrap_means,
)

Z95 = 1.959963984540054


def test_the_module_imports_neither_vllm_nor_torch() -> None:
    code = ("import sys, vllm_kvevict.evaluation.stats; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_large_normal_sample_interval_is_mean_plus_minus_1_96_s_over_sqrt_n() -> None:
    rng = np.random.default_rng()
    n = 1000
    values = rng.normal(rng.uniform(-50, 50), rng.uniform(1, 30), size=n)
    interval = bootstrap_mean_interval(values, resamples=20000, seed=int(rng.integers(2**31)))
    half = Z95 * values.std(ddof=1) / math.sqrt(n)
    assert interval.mean == pytest.approx(values.mean(), abs=1e-9)
    assert interval.n == n
    # Monte Carlo error of a 2.5% quantile of 20000 resamples: ~1% of the half-width.
    assert interval.low == pytest.approx(values.mean() - half, abs=0.06 * half)
    assert interval.high == pytest.approx(values.mean() + half, abs=0.06 * half)


def test_bootstrap_variance_of_the_mean_is_the_plug_in_variance_over_n() -> None:
    rng = np.random.default_rng()
    values = rng.choice([0.0, 25.0, 50.0, 100.0], size=int(rng.integers(5, 15)))
    values[0], values[1] = 0.0, 100.0  # some spread
    means = bootstrap_means(values, resamples=40000, rng=int(rng.integers(2**31)))
    assert means.var() == pytest.approx(values.var(ddof=0) / values.size, rel=0.06)
    assert means.mean() == pytest.approx(values.mean(), abs=0.05 * values.std())


def exact_quantile(atoms: np.ndarray, q: float) -> float:
    """The q-quantile of the uniform distribution over ``atoms`` (the inverse CDF)."""
    ordered = np.sort(atoms)
    return float(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)])


def check_against_exact(interval: Interval, resampled: np.ndarray, atoms: np.ndarray) -> None:
    """Monte Carlo resample means against the exact bootstrap distribution
    (``atoms``: every equally likely resample's statistic). DKW: the CDFs of
    20000 draws are within 0.02 with probability 1 - 2e-7."""
    grid = np.unique(atoms)
    exact_cdf = np.searchsorted(np.sort(atoms), grid, side="right") / atoms.size
    mc_cdf = np.searchsorted(np.sort(resampled), grid, side="right") / resampled.size
    assert np.max(np.abs(exact_cdf - mc_cdf)) < 0.02
    assert exact_quantile(atoms, 0.015) <= interval.low <= exact_quantile(atoms, 0.035)
    assert exact_quantile(atoms, 0.965) <= interval.high <= exact_quantile(atoms, 0.985)


def test_small_sample_interval_matches_the_enumerated_bootstrap_distribution() -> None:
    rng = np.random.default_rng()
    values = rng.normal(size=5) * 10
    atoms = np.array([values[list(idx)].mean() for idx in itertools.product(range(5), repeat=5)])
    seed = int(rng.integers(2**31))
    interval = bootstrap_mean_interval(values, resamples=20000, seed=seed)
    check_against_exact(interval, bootstrap_means(values, 20000, seed), atoms)


def test_stratified_interval_matches_the_enumerated_bootstrap_distribution() -> None:
    rng = np.random.default_rng()
    groups = {"vt": rng.normal(size=3) * 10, "cwe": rng.normal(size=4) * 10 + 30}
    first = [groups["vt"][list(i)].mean() for i in itertools.product(range(3), repeat=3)]
    second = [groups["cwe"][list(i)].mean() for i in itertools.product(range(4), repeat=4)]
    atoms = (np.array(first)[:, None] + np.array(second)[None, :]).ravel() / 2
    seed = int(rng.integers(2**31))
    interval = stratified_bootstrap(groups, resamples=20000, seed=seed)
    # The mean of the group means, not of the 7 pooled samples.
    assert interval.mean == pytest.approx((groups["vt"].mean() + groups["cwe"].mean()) / 2)
    assert interval.n == 7
    check_against_exact(interval, stratified_bootstrap_means(groups, 20000, seed), atoms)


def test_stratified_variance_is_the_sum_of_the_group_variances() -> None:
    rng = np.random.default_rng()
    groups = {task: rng.normal(rng.uniform(0, 100), rng.uniform(1, 20), size=int(rng.integers(3, 30)))
              for task in ("a", "b", "c", "d")}
    means = stratified_bootstrap_means(groups, resamples=40000, rng=int(rng.integers(2**31)))
    expected = sum(v.var(ddof=0) / v.size for v in groups.values()) / len(groups) ** 2
    assert means.var() == pytest.approx(expected, rel=0.06)


def test_groups_of_one_sample_or_no_spread_have_a_zero_width_interval() -> None:
    rng = random.Random()
    singles = {f"t{i}": [rng.uniform(0, 100)] for i in range(5)}
    interval = stratified_bootstrap(singles)
    assert interval.low == interval.mean == interval.high == pytest.approx(
        sum(v[0] for v in singles.values()) / 5)
    value = rng.choice([0.0, 100.0, 1 / 3])
    interval = bootstrap_mean_interval([value] * 20)
    assert interval.low == interval.mean == interval.high == pytest.approx(value)


def test_intervals_are_deterministic_for_a_seed_and_reject_bad_input() -> None:
    values = np.random.default_rng().uniform(0, 100, size=20)
    assert bootstrap_mean_interval(values, seed=3) == bootstrap_mean_interval(values, seed=3)
    assert bootstrap_mean_interval(values, seed=3) != bootstrap_mean_interval(values, seed=4)
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_mean_interval([1.0, math.nan])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_mean_interval(values, confidence=1.5)
    with pytest.raises(ValueError, match="at least one group"):
        stratified_bootstrap({})


def test_a_wider_confidence_gives_a_wider_interval() -> None:
    values = np.random.default_rng().normal(size=50)
    narrow = bootstrap_mean_interval(values, confidence=0.5)
    wide = bootstrap_mean_interval(values, confidence=0.99)
    assert wide.low < narrow.low < narrow.mean < narrow.high < wide.high


def coverage(draw, truth: float, datasets: int, seed: int, stratified: bool = False) -> float:
    rng = np.random.default_rng(seed)
    hits = 0
    for i in range(datasets):
        data = draw(rng)
        interval = (stratified_bootstrap(data, resamples=1000, seed=i) if stratified
                    else bootstrap_mean_interval(data, resamples=1000, seed=i))
        hits += interval.low <= truth <= interval.high
    return hits / datasets


def test_coverage_is_close_to_95_percent_on_normal_data() -> None:
    # 1000 seeded datasets: the binomial standard error of the rate is 0.7 points.
    # The percentile interval of a mean of 40 normal values covers ~94%.
    rate = coverage(lambda rng: rng.normal(10.0, 3.0, size=40), 10.0, 1000, seed=11)
    assert 0.925 <= rate <= 0.97


def test_coverage_of_ruler_like_scores_stratified_over_tasks() -> None:
    """Seven tasks of 20 pass/fail samples (0 or 100) with different pass
    rates: RULER's mean over tasks is covered close to 95%."""
    rates = np.array([0.9, 0.6, 0.4, 0.3, 0.15, 0.5, 0.75])
    truth = float(rates.mean() * 100)

    def draw(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {f"task{i}": 100.0 * (rng.random(20) < p) for i, p in enumerate(rates)}
    rate = coverage(draw, truth, 600, seed=5, stratified=True)
    assert 0.92 <= rate <= 0.975


def test_identical_settings_differ_by_exactly_zero() -> None:
    rng = random.Random()
    scores = {("vt", i): rng.choice([0.0, 20.0, 100.0]) for i in range(30)}
    interval = paired_difference_interval(scores, dict(scores))
    assert interval == Interval(0.0, 0.0, 0.0, 30) and not interval.excludes_zero
    by_task = paired_difference_interval(scores, dict(scores), strata=lambda key: key[0])
    assert by_task == Interval(0.0, 0.0, 0.0, 30)


def test_pairing_is_by_sample_id_not_by_order() -> None:
    rng = random.Random()
    ids = [(task, i) for task in ("vt", "cwe", "qa_1") for i in range(rng.randint(3, 12))]
    a = {key: rng.choice([0.0, 25.0, 50.0, 100.0]) for key in ids}
    b = {key: a[key] - 25.0 for key in ids}  # B is 25 points below A on every sample
    shuffled = list(b.items())
    rng.shuffle(shuffled)
    interval = paired_difference_interval(a, dict(shuffled))
    assert interval == Interval(25.0, 25.0, 25.0, len(ids)) and interval.excludes_zero
    # Otherwise, the bootstrap of the per-sample differences (same seed, same ids).
    b = {key: rng.choice([0.0, 25.0, 50.0, 100.0]) for key in ids}
    differences = [a[key] - b[key] for key in ids]
    shuffled = list(b.items())
    rng.shuffle(shuffled)
    in_order = paired_difference_interval(a, b, seed=7)
    assert paired_difference_interval(a, dict(shuffled), seed=7) == in_order
    reordered = list(a.items())
    rng.shuffle(reordered)
    assert paired_difference_interval(dict(reordered), b, seed=7) == in_order
    # The bootstrap of the per-sample differences, in a fixed order of the ids.
    ordered = sorted(ids, key=repr)
    assert in_order == bootstrap_mean_interval([a[k] - b[k] for k in ordered], seed=7)
    # With strata: the mean over tasks of each task's mean difference.
    groups: dict[str, list[float]] = {}
    for (task, _), d in zip(ids, differences):
        groups.setdefault(task, []).append(d)
    stratified = paired_difference_interval(a, b, strata=lambda key: key[0], seed=7)
    ordered_groups = {task: [a[k] - b[k] for k in ordered if k[0] == task] for task in groups}
    assert stratified == stratified_bootstrap(ordered_groups, seed=7)
    assert stratified == stratified_bootstrap(dict(reversed(ordered_groups.items())), seed=7)
    assert stratified.mean == pytest.approx(np.mean([np.mean(v) for v in groups.values()]))


def test_pairing_removes_the_spread_both_settings_share() -> None:
    """A and B = A + small noise: the paired interval is ~ mean(d) ± 1.96 sd(d)/sqrt(n),
    far narrower than the unpaired sqrt(var A + var B)."""
    rng = np.random.default_rng()
    n = 3000
    base = rng.normal(50, 20, size=n)
    noise = rng.normal(-1.0, 2.0, size=n)
    a = {i: float(base[i]) for i in range(n)}
    b = {i: float(base[i] + noise[i]) for i in range(n)}
    interval = paired_difference_interval(a, b, resamples=20000, seed=int(rng.integers(2**31)))
    d = -noise
    half = Z95 * d.std(ddof=1) / math.sqrt(n)
    assert interval.mean == pytest.approx(d.mean(), abs=1e-9)
    assert interval.low == pytest.approx(d.mean() - half, abs=0.06 * half)
    assert interval.high == pytest.approx(d.mean() + half, abs=0.06 * half)
    unpaired = Z95 * math.sqrt((base.var(ddof=1) + (base + noise).var(ddof=1)) / n)
    assert interval.high - interval.low < 0.3 * unpaired


def test_mismatched_sample_sets_are_refused_with_the_ids() -> None:
    a = {("vt", 0): 100.0, ("vt", 1): 0.0, ("vt", 2): 50.0}
    b = {("vt", 0): 100.0, ("vt", 1): 0.0, ("vt", 7): 0.0}
    with pytest.raises(ValueError, match=r"1 only in A \(\('vt', 2\)\); 1 only in B \(\('vt', 7\)\)"):
        paired_difference_interval(a, b)
    with pytest.raises(ValueError, match="only in B"):
        paired_differences({}, {("vt", 0): 1.0})
    with pytest.raises(ValueError, match="no paired samples"):
        paired_differences({}, {})


def test_interval_formatting() -> None:
    assert Interval(50.0, 20.0, 80.0, 20).format() == "50 [20, 80]"
    assert Interval(-3.25, -6.5, 0.0, 140).format(1, sign=True) == "-3.2 [-6.5, +0.0]"
    assert Interval(1.0, 0.5, 2.0, 3).excludes_zero and not Interval(1.0, 0.0, 2.0, 3).excludes_zero
    assert Interval(-1.0, -2.0, -0.5, 3).excludes_zero
