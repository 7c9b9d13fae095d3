"""T (sliding mean of queueing delays) and eta = -corr(k, N - k) on constructed job sets."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.signals import RemainingTurnsCorrelation, SlidingMean
from estimator.ttl_estimator import MAX_JOB_TURNS, MAX_OBSERVED_S


def test_sliding_mean_keeps_the_latest_window() -> None:
    mean = SlidingMean(window=3)
    assert mean.mean is None
    for value in (1.0, 2.0, 3.0, 10.0):
        mean.add(value)
    assert mean.mean == pytest.approx(5.0) and mean.values == [2.0, 3.0, 10.0]
    with pytest.raises(ValueError):
        SlidingMean(0)


def test_sliding_mean_forgets_the_rounding_of_values_gone_from_the_window() -> None:
    mean = SlidingMean(window=3)
    for value in (1e16, 1.0, 1.0, 1.0):
        mean.add(value)
    assert mean.mean == 1.0


def test_sliding_mean_survives_hostile_values() -> None:
    mean = SlidingMean(window=4)
    for value in (1e308, 1e308, math.inf, math.nan, -math.inf):
        mean.add(value)  # NaN is dropped; the rest clamped into [0, a day]
    assert mean.values == [MAX_OBSERVED_S] * 3 + [0.0]
    assert mean.mean == pytest.approx(0.75 * MAX_OBSERVED_S)
    capped = SlidingMean(window=2, max_value_s=10.0)
    capped.add(11.0)
    assert capped.mean == 10.0
    for max_value_s in (0.0, 2 * MAX_OBSERVED_S, math.nan):
        with pytest.raises(ValueError):
            SlidingMean(max_value_s=max_value_s)


def _eta(num_turns: list[int]) -> float:
    turns = RemainingTurnsCorrelation()
    turns.extend(num_turns)
    return turns.eta


def _numpy_eta(num_turns: list[int]) -> float:
    done = [k for n in num_turns for k in range(1, n)]
    left = [n - k for n in num_turns for k in range(1, n)]
    return float(-np.corrcoef(done, left)[0, 1])


def test_jobs_of_one_length_give_eta_one() -> None:
    # k and N - k sum to N for every decision: perfectly anti-correlated.
    assert _eta([6, 6, 6]) == pytest.approx(1.0)


def test_constructed_job_sets_match_the_definition() -> None:
    # Lengths 2 and 4: decisions (k, N-k) = (1,1), (1,3), (2,2), (3,1):
    # mean k = 7/4, var k = 11/16, cov = (1 + 3 + 4 + 3)/4 - 49/16 = -5/16: eta = 5/11.
    assert _eta([2, 4]) == pytest.approx(5 / 11)
    assert _eta([2, 10, 30, 3, 7]) == pytest.approx(_numpy_eta([2, 10, 30, 3, 7]))


def test_eta_defaults_while_undefined() -> None:
    assert _eta([]) == 1.0
    assert _eta([1, 1, 1]) == 1.0  # one-turn jobs make no pin decisions
    assert _eta([2]) == 1.0  # one decision: no variance
    assert RemainingTurnsCorrelation(default=0.5).eta == 0.5


def test_job_lengths_are_bounded_and_long_jobs_keep_eta_finite() -> None:
    turns = RemainingTurnsCorrelation()
    for bad in (-1, MAX_JOB_TURNS + 1, 10**400):
        with pytest.raises(ValueError, match="num_turns"):
            turns.add(bad)
    assert len(turns) == 0
    turns.extend([MAX_JOB_TURNS] * 3 + [2] * 3)
    assert math.isfinite(turns.eta) and -1.0 <= turns.eta <= 1.0
    turns.extend([MAX_JOB_TURNS] * 3)  # a long burst keeps the exact sums exact
    assert turns.eta == pytest.approx(_numpy_eta_weighted({MAX_JOB_TURNS: 6, 2: 3}))


def _numpy_eta_weighted(counts: dict[int, int]) -> float:
    """`_numpy_eta` for jobs too long to list decision by decision (closed-form moments)."""
    sums = np.zeros(4)
    for n, copies in counts.items():
        m = n - 1
        k = np.arange(1, m + 1, dtype=float)
        sums += copies * np.array([m, k.sum(), (k * k).sum(), (k * (n - k)).sum()])
    count, sum_k, sum_k2, sum_rest = sums
    variance = sum_k2 / count - (sum_k / count) ** 2
    return float(-(sum_rest / count - (sum_k / count) ** 2) / variance)


def test_only_the_latest_jobs_count() -> None:
    turns = RemainingTurnsCorrelation(max_jobs=2)
    turns.extend([50, 2, 4])
    assert turns.num_turns == [2, 4] and turns.eta == pytest.approx(5 / 11)


@given(st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=40))
def test_eta_is_the_clipped_negative_correlation(num_turns) -> None:
    eta = _eta(num_turns)
    assert -1.0 <= eta <= 1.0
    done = [k for n in num_turns for k in range(1, n)]
    if len(set(done)) > 1:
        assert eta == pytest.approx(_numpy_eta(num_turns), abs=1e-9)
