"""Estimators by name, as policy options and the benchmark name them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

from engine.registry import Registry
from estimator.cost_model import HostReloadCost, PrefillCostModel
from estimator.eq2 import (
    DEFAULT_COLD_START_SAMPLES,
    DEFAULT_MAX_TTL_S,
    DEFAULT_PIN_COST,
    DEFAULT_REBUILD_COST,
    Eq2Estimator,
    RebuildCost,
)
from estimator.fixed import FixedTTLEstimator
from estimator.learned import QuantileBoostingPredictor
from estimator.solver import PinCost
from estimator.ttl_estimator import TTLEstimator

# New finished tool calls between background retrainings of the learned predictor.
LEARNED_REFIT_EVERY = 1000

# The estimators `make_estimator` knows, as a type for options that name one.
EstimatorName = Literal["eq2-empirical", "eq2-learned", "fixed-2s"]


@dataclass(frozen=True)
class EstimatorSettings:
    """What every estimator may be built with: `prefill_cost` prices rebuilding a context
    (None: R = 0) as `rebuild_cost` says, `reload_cost` reloading one the host tier holds
    (None: no tier); `pin_cost` is what Eq. 2 charges a pin; `max_ttl_s` caps Eq. 2's
    TTLs; Eq. 2 leaves its cold-start prior once more than `cold_start_samples` tool
    durations are observed. The defaults are Eq. 2's, those `continuum` runs."""

    prefill_cost: PrefillCostModel | None = None
    reload_cost: HostReloadCost | None = None
    rebuild_cost: RebuildCost = DEFAULT_REBUILD_COST
    pin_cost: PinCost = DEFAULT_PIN_COST
    max_ttl_s: float = DEFAULT_MAX_TTL_S
    cold_start_samples: int = DEFAULT_COLD_START_SAMPLES


def _fixed(settings: EstimatorSettings) -> TTLEstimator:
    return FixedTTLEstimator(2.0)


def _eq2_keywords(settings: EstimatorSettings) -> dict[str, Any]:
    return {field.name: getattr(settings, field.name) for field in fields(settings)}


def _eq2_empirical(settings: EstimatorSettings) -> TTLEstimator:
    return Eq2Estimator(**_eq2_keywords(settings))


def _eq2_learned(settings: EstimatorSettings) -> TTLEstimator:
    return Eq2Estimator(**_eq2_keywords(settings), predictor=QuantileBoostingPredictor(),
                        refit_every=LEARNED_REFIT_EVERY)


ESTIMATORS: Registry[Callable[[EstimatorSettings], TTLEstimator]] = Registry("estimator", {
    "eq2-empirical": _eq2_empirical,
    "eq2-learned": _eq2_learned,
    "fixed-2s": _fixed,
})


# The estimators whose TTLs depend on `EstimatorSettings.prefill_cost` and `reload_cost`.
PRICES_REBUILDS = frozenset({"eq2-empirical", "eq2-learned"})


def make_estimator(name: str, settings: EstimatorSettings | None = None) -> TTLEstimator:
    """A fresh estimator by name; ValueError naming the choices if unknown."""
    return ESTIMATORS.load(name)(EstimatorSettings() if settings is None else settings)
