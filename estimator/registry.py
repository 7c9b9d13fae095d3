"""Estimators by name, as the engine's flags and the benchmark name them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from estimator.base import TTLEstimator
from estimator.cost_model import PrefillCostModel
from estimator.eq2 import Eq2Estimator
from estimator.fixed import FixedTTLEstimator
from estimator.learned import QuantileBoostingPredictor
from estimator.traces import TraceJob

# New finished tool calls between background retrainings of the learned predictor.
LEARNED_REFIT_EVERY = 1000


def _fixed(prefill_cost: PrefillCostModel | None) -> TTLEstimator:
    return FixedTTLEstimator(2.0)


def _eq2_empirical(prefill_cost: PrefillCostModel | None) -> TTLEstimator:
    return Eq2Estimator(prefill_cost=prefill_cost)


def _eq2_learned(prefill_cost: PrefillCostModel | None) -> TTLEstimator:
    return Eq2Estimator(prefill_cost=prefill_cost, predictor=QuantileBoostingPredictor(),
                        refit_every=LEARNED_REFIT_EVERY)


ESTIMATORS: dict[str, Callable[[PrefillCostModel | None], TTLEstimator]] = {
    "fixed-2s": _fixed,
    "eq2-empirical": _eq2_empirical,
    "eq2-learned": _eq2_learned,
}


def make_estimator(name: str, prefill_cost: PrefillCostModel | None = None) -> TTLEstimator:
    """A fresh estimator by name; ValueError naming the choices if unknown."""
    factory = ESTIMATORS.get(name)
    if factory is None:
        raise ValueError(f"unknown estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    return factory(prefill_cost)


def warm_start(estimator: TTLEstimator, jobs: Iterable[TraceJob]) -> None:
    """Teaches an estimator the jobs of traces, if it can learn from them."""
    if isinstance(estimator, Eq2Estimator):
        estimator.warm_start(jobs)
    elif isinstance(estimator, FixedTTLEstimator):
        for job in jobs:
            for call in job.calls:
                estimator.history.add(call.tool_name, call.duration_s)
