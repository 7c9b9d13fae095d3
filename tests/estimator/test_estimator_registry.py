"""Estimators by name, built with `EstimatorSettings`."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from estimator.cost_model import PrefillCostModel
from estimator.eq2 import DEFAULT_MAX_TTL_S, Eq2Estimator
from estimator.estimator_registry import (
    ESTIMATORS,
    EstimatorName,
    EstimatorSettings,
    make_estimator,
)
from estimator.fixed import FixedTTLEstimator
from estimator.learned import QuantileBoostingPredictor


def test_the_names_and_their_defaults() -> None:
    assert set(ESTIMATORS) == {"eq2-empirical", "eq2-learned", "fixed-2s"}
    assert isinstance(make_estimator("fixed-2s"), FixedTTLEstimator)
    empirical = make_estimator("eq2-empirical")
    assert isinstance(empirical, Eq2Estimator) and empirical.predictor is None
    # What `continuum` runs (docs/decisions/0001-0003), stated once in estimator/eq2.py.
    assert (empirical.prefill_cost, empirical.rebuild_cost, empirical.pin_cost,
            empirical.cold_start_samples, empirical.max_ttl_s) == (
        None, "prefill-times-running", "priced-capped", 0, DEFAULT_MAX_TTL_S)
    learned = make_estimator("eq2-learned")
    assert isinstance(learned, Eq2Estimator)
    assert isinstance(learned.predictor, QuantileBoostingPredictor)


def test_settings_reach_every_eq2_estimator() -> None:
    settings = EstimatorSettings(prefill_cost=PrefillCostModel(intercept_s=0.5),
                                 rebuild_cost="prefill-times-running", max_ttl_s=30.0)
    for name in ("eq2-empirical", "eq2-learned"):
        estimator = make_estimator(name, settings)
        assert isinstance(estimator, Eq2Estimator)
        assert estimator.prefill_cost == settings.prefill_cost
        assert (estimator.rebuild_cost, estimator.max_ttl_s) == ("prefill-times-running", 30.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_ttl_s = 1.0  # type: ignore[misc]


def test_unknown_names_and_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown estimator"):
        make_estimator("eq3")
    with pytest.raises(ValueError, match="max_ttl_s"):
        make_estimator("eq2-empirical", EstimatorSettings(max_ttl_s=-1.0))


def test_the_estimator_name_type_lists_exactly_the_registered_estimators() -> None:
    assert set(typing.get_args(EstimatorName)) == set(ESTIMATORS)
