"""Confidence intervals for `kvevict eval`'s scores: percentile bootstrap over
samples (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13).

A task's score is the mean over its samples: its interval resamples that
task's samples with replacement (``bootstrap_mean_interval``). RULER's mean is
the mean over tasks of each task's mean: its interval resamples within each
task, so every resample keeps each task's sample count, and averages the task
means (``stratified_bootstrap``). Two settings on the same samples are compared
through their per-sample differences, paired by sample id
(``paired_difference_interval``), which removes the spread the two settings
share (a sample both fail or both pass adds nothing).

The interval of a value every resample reproduces (all samples equal) has zero
width: the bootstrap knows only the samples it was given. Everything here is
numpy only, seeded, and deterministic for a given seed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap confidence interval over ``n`` samples."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def format(self, digits: int = 0, sign: bool = False) -> str:
        """``mean [low, high]``, e.g. ``50 [20, 80]`` (``+`` on differences with ``sign``)."""
        spec = f"{'+' if sign else ''}.{digits}f"
        return f"{self.mean:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


def _array(values: Iterable[float]) -> np.ndarray:
    array = np.asarray(list(values), dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError("a bootstrap needs at least one value")
    if not np.all(np.isfinite(array)):
        raise ValueError("bootstrap values must be finite")
    return array


def bootstrap_means(values: Sequence[float], resamples: int = RESAMPLES,
                    rng: np.random.Generator | int | None = SEED) -> np.ndarray:
    """The means of ``resamples`` resamples of ``values`` (drawn with replacement,
    each of the same size as ``values``)."""
    array = _array(values)
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, not {resamples}")
    rng = np.random.default_rng(rng)
    rows = max(1, 1_000_000 // array.size)  # bounded memory: a million indices at a time
    return np.concatenate([
        array[rng.integers(0, array.size, size=(min(rows, resamples - start), array.size))].mean(axis=1)
        for start in range(0, resamples, rows)
    ])


def stratified_bootstrap_means(groups: Mapping[Hashable, Sequence[float]], resamples: int = RESAMPLES,
                               rng: np.random.Generator | int | None = SEED) -> np.ndarray:
    """The mean over groups of each group's resampled mean, ``resamples`` times
    (every group resampled within itself, keeping its size; groups drawn in a
    fixed order of their keys)."""
    if not groups:
        raise ValueError("a stratified bootstrap needs at least one group")
    rng = np.random.default_rng(rng)
    ordered = sorted(groups, key=repr)  # the same draws whatever order the groups came in
    return np.mean([bootstrap_means(groups[key], resamples, rng) for key in ordered], axis=0)


def _interval(mean: float, means: np.ndarray, n: int, confidence: float, constant: bool) -> Interval:
    """The percentile interval; samples with no spread give exactly [mean, mean]
    (not the last bits of summation order)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")
    if constant:
        return Interval(float(mean), float(mean), float(mean), n)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(float(mean), float(low), float(high), n)


def bootstrap_mean_interval(values: Sequence[float], *, confidence: float = CONFIDENCE,
                            resamples: int = RESAMPLES, seed: int | None = SEED) -> Interval:
    """The mean of ``values`` and its percentile-bootstrap interval."""
    array = _array(values)
    return _interval(array.mean(), bootstrap_means(array, resamples, seed), array.size, confidence,
                     constant=bool(np.ptp(array) == 0))


def stratified_bootstrap(groups: Mapping[Hashable, Sequence[float]], *, confidence: float = CONFIDENCE,
                         resamples: int = RESAMPLES, seed: int | None = SEED) -> Interval:
    """The mean over groups of the group means (RULER's average over tasks) and
    its percentile-bootstrap interval, resampling within each group."""
    arrays = {key: _array(groups[key]) for key in sorted(groups, key=repr)}
    if not arrays:
        raise ValueError("a stratified bootstrap needs at least one group")
    mean = float(np.mean([a.mean() for a in arrays.values()]))
    means = stratified_bootstrap_means(arrays, resamples, seed)
    return _interval(mean, means, sum(a.size for a in arrays.values()), confidence,
                     constant=all(np.ptp(a) == 0 for a in arrays.values()))


def paired_differences(a: Mapping[K, float], b: Mapping[K, float]) -> dict[K, float]:
    """``a[id] - b[id]`` for every sample id, in a fixed order of the ids (so an
    interval does not depend on the order samples were recorded in); both must
    hold the same ids."""
    only_a, only_b = a.keys() - b.keys(), b.keys() - a.keys()
    if only_a or only_b:
        def some(keys: set) -> str:
            return ", ".join(sorted(map(repr, keys))[:3]) + (", ..." if len(keys) > 3 else "")
        raise ValueError(
            "paired samples must have the same ids: "
            + "; ".join(f"{len(keys)} only in {side} ({some(keys)})"
                        for side, keys in (("A", only_a), ("B", only_b)) if keys))
    if not a:
        raise ValueError("no paired samples")
    return {key: a[key] - b[key] for key in sorted(a, key=repr)}  # one order, whatever a's


def paired_difference_interval(a: Mapping[K, float], b: Mapping[K, float], *,
                               strata: Callable[[K], Hashable] | None = None,
                               confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                               seed: int | None = SEED) -> Interval:
    """The mean difference A - B over samples paired by id, and its interval:
    the bootstrap of the per-sample differences, or, with ``strata`` (a
    sample id -> its group, e.g. its task), the mean over groups of each group's
    mean difference, resampled within each group."""
    differences = paired_differences(a, b)
    if strata is None:
        return bootstrap_mean_interval(list(differences.values()), confidence=confidence,
                                       resamples=resamples, seed=seed)
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for key, difference in differences.items():
        groups[strata(key)].append(difference)
    return stratified_bootstrap(groups, confidence=confidence, resamples=resamples, seed=seed)
