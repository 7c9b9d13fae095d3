"""The learned duration predictor: gradient-boosted quantiles, and the pinball loss."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator.learned import QuantileBoostingPredictor, pinball_loss
from estimator.predictor import CallFeatures, DurationRecord
from estimator.ttl_estimator import MAX_CONTEXT_TOKENS, MAX_JOB_TURNS, MAX_OBSERVED_S


def test_pinball_loss_hand_computed() -> None:
    # Level .5 is half the absolute error; at level .9 an under-prediction of 1 costs .9 and
    # an over-prediction of 1 costs .1.
    assert pinball_loss([0.5], np.array([[1.0]]), np.array([3.0])) == pytest.approx(1.0)
    assert pinball_loss([0.9], np.array([[2.0], [4.0]]), np.array([3.0, 3.0])) == (
        pytest.approx((0.9 + 0.1) / 2))


def _records(num_records: int, seed: int = 0) -> list[DurationRecord]:
    """Two tools: `sleep` takes about its job's previous duration, `ls` about 0.1 s."""
    rng = np.random.default_rng(seed)
    records = []
    for index in range(num_records):
        if index % 2:
            previous = float(rng.uniform(1, 5))
            features = CallFeatures("sleep", index % 7, 1000, (("sleep", previous),))
            records.append(DurationRecord(features, previous * float(rng.uniform(0.9, 1.1))))
        else:
            features = CallFeatures("ls", index % 7, 500, ())
            records.append(DurationRecord(features, float(rng.uniform(0.05, 0.15))))
    return records


def test_the_predictor_learns_conditional_quantiles() -> None:
    predictor = QuantileBoostingPredictor(max_iter=50)
    predictor.fit(_records(600))
    assert predictor.is_fitted
    rows = predictor.predict_quantiles([
        CallFeatures("ls", 2, 500, ()),
        CallFeatures("sleep", 3, 1000, (("sleep", 4.0),)),
        CallFeatures("never-seen", 0, 10, ()),
    ])
    assert rows.shape == (3, len(predictor.levels))
    assert np.all(np.diff(rows, axis=1) >= 0) and np.all(rows >= 0)
    assert 0.05 <= rows[0, 5] <= 0.15  # the median of `ls`
    assert 3.3 <= rows[1, 5] <= 4.7  # `sleep` after a 4 s sleep
    cdf = predictor.predict_cdf(CallFeatures("ls", 2, 500, ()))
    assert cdf.probabilities[-1] == predictor.levels[-1]


def test_fitting_is_deterministic_and_needs_enough_records() -> None:
    first, second = QuantileBoostingPredictor(max_iter=20), QuantileBoostingPredictor(max_iter=20)
    first.fit(_records(300))
    second.fit(_records(300))
    features = [CallFeatures("sleep", 1, 1000, (("sleep", 2.0),))]
    assert np.array_equal(first.predict_quantiles(features), second.predict_quantiles(features))
    small = QuantileBoostingPredictor(min_records=100)
    small.fit(_records(99))
    assert not small.is_fitted


@pytest.mark.parametrize("levels", [(), (0.5, 0.1), (0.0, 0.5), (0.5, 1.0)])
def test_bad_levels_are_rejected(levels) -> None:
    with pytest.raises(ValueError):
        QuantileBoostingPredictor(levels=levels)


def test_records_without_any_tool_name_or_history_still_train() -> None:
    records = [DurationRecord(CallFeatures(None, i % 5, 100 * i, ()), 0.1 * (i % 7))
               for i in range(120)]
    predictor = QuantileBoostingPredictor(max_iter=10)
    predictor.fit(records)
    assert predictor.is_fitted
    assert predictor.predict_quantiles([CallFeatures("new", 1, 50, ())]).shape == (1, 13)


def test_hostile_features_and_durations_do_not_raise() -> None:
    predictor = QuantileBoostingPredictor(max_iter=10)
    records = [
        *_records(120),
        DurationRecord(CallFeatures("ls", 10**400, 10**400, (("ls", 1e308),)), 1e308),
        DurationRecord(CallFeatures("ls", 0, 0, (("ls", math.nan),)), math.inf),
    ]
    predictor.fit(records)
    rows = predictor.predict_quantiles([CallFeatures("ls", 10**400, -5, (("ls", -1.0),))])
    assert np.all(np.isfinite(rows)) and np.all(rows <= MAX_OBSERVED_S)


def test_saved_features_are_bounded() -> None:
    features = CallFeatures.bounded("ls", 10**400, -3, (("ls", 0.5),))
    assert (features.turn_index, features.num_context_tokens) == (MAX_JOB_TURNS, 0)
    assert CallFeatures.from_list(features.to_list()) == features
    for bad in (["ls", -1, 5, []], ["ls", 1, MAX_CONTEXT_TOKENS + 1, []],
                ["ls", 1, 5, [["ls", 1e308]]], ["ls", 1, 5, [["ls", 1.0]] * 9],
                ["ls", 1e400, 5, []]):
        with pytest.raises(ValueError):
            CallFeatures.from_list(bad)
