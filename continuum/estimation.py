"""The Continuum policies' TTL estimator: built from the policy's choice and what the engine
offers, and guarded so that no estimator failure can fail a scheduler step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from engine.scheduler.policy import PolicyEnvironment, SchedulerView
from engine.scheduler.retention import RetentionInputs
from estimator.cost_model import HostReloadCost, PrefillCostModel
from estimator.eq2 import (
    DEFAULT_COLD_START_SAMPLES,
    DEFAULT_MAX_TTL_S,
    DEFAULT_PIN_COST,
    DEFAULT_REBUILD_COST,
    RebuildCost,
)
from estimator.estimator_registry import (
    PRICES_REBUILDS,
    EstimatorName,
    EstimatorSettings,
    make_estimator,
)
from estimator.solver import PinCost
from estimator.state_file import load_state_or_cold_start, save_state
from estimator.traces import TraceJob
from estimator.ttl_estimator import ToolCall, TTLDecision, TTLEstimator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EstimatorChoice:
    """Which estimator a Continuum policy builds (`name`, capped at `max_ttl_s`), and how
    Eq. 2 prices a pin: R as `rebuild_cost` (docs/decisions/0002-rebuild-cost.md), the pin
    as `pin_cost` (0001-memory-priced-pins.md), its cold-start prior held while at most
    `cold_start_samples` tool durations are known (0003-cold-start.md). `state_file`: a
    saved state to load at start (if present and valid). `prefill_cost` prices rebuilds
    instead of the prefills timed at start-up (None: timed)."""

    name: EstimatorName
    max_ttl_s: float = DEFAULT_MAX_TTL_S
    state_file: str | None = None
    rebuild_cost: RebuildCost = DEFAULT_REBUILD_COST
    pin_cost: PinCost = DEFAULT_PIN_COST
    cold_start_samples: int = DEFAULT_COLD_START_SAMPLES
    prefill_cost: PrefillCostModel | None = None


def build_estimator(choice: EstimatorChoice, scheduler: SchedulerView) -> TTLEstimator:
    """The chosen estimator: R priced by the prefills the engine times at start-up, or, for
    a context the engine's host tier can hold, by the load time measured then; then the
    saved state if one loads (a corrupt state file only warns). Call from `bind` only."""
    prices_rebuilds = choice.name in PRICES_REBUILDS
    prefill_cost = choice.prefill_cost
    if prefill_cost is None and prices_rebuilds:
        prefill_cost = measured_prefill_cost(scheduler.environment)
    settings = EstimatorSettings(
        prefill_cost=prefill_cost if prices_rebuilds else None,
        reload_cost=measured_reload_cost(scheduler) if prices_rebuilds else None,
        rebuild_cost=choice.rebuild_cost, pin_cost=choice.pin_cost,
        max_ttl_s=choice.max_ttl_s, cold_start_samples=choice.cold_start_samples,
    )
    estimator = make_estimator(choice.name, settings)
    if choice.state_file is not None:
        load_state_or_cold_start(estimator, choice.state_file)
    return estimator


def measured_prefill_cost(environment: PolicyEnvironment) -> PrefillCostModel | None:
    """The fit of the prefills the engine times (`environment.profile_prefill`); None when it
    cannot time them, or when fewer than two lengths fit the KV pool (warned). Call from
    `bind` only."""
    return _fit_profile(environment.profile_prefill, "prefill")


def measured_reload_cost(scheduler: SchedulerView) -> HostReloadCost | None:
    """The fit of the host-tier loads the engine times (`environment.profile_kv_reload`),
    for contexts up to the tier's size; None without a tier, when the engine cannot time
    loads, or when fewer than two lengths could be timed (warned). Call from `bind` only."""
    profile = scheduler.environment.profile_kv_reload
    if profile is None or scheduler.num_host_kv_blocks <= 0:
        return None
    model = _fit_profile(profile, "host-tier load")
    if model is None:
        return None
    return HostReloadCost(model, scheduler.num_host_kv_blocks * scheduler.block_size)


def _fit_profile(profile: Callable[[], list[tuple[int, float]]] | None,
                 what: str) -> PrefillCostModel | None:
    if profile is None:
        return None
    points = profile()
    if len({n for n, _ in points}) < 2:
        logger.warning("too few %s lengths could be timed to price them: left unpriced", what)
        return None
    return PrefillCostModel.fit(points)


def save_estimator(estimator: TTLEstimator, state_file: str) -> None:
    """Saves what the estimator learned to `state_file`; an unwritable file is logged, not
    raised (the engine is stopping)."""
    try:
        save_state(estimator, state_file)
    except (OSError, ValueError, TypeError) as error:
        logger.error("cannot save the estimator state to %s: %s", state_file, error)


def retention_inputs(call: ToolCall, decision: TTLDecision) -> RetentionInputs:
    """A decision and its inputs, as the trace records them."""
    return RetentionInputs(
        ttl_s=decision.ttl_s, source=decision.basis, tool=call.tool_name,
        num_samples=decision.num_samples, queueing_delay_s=decision.queueing_delay_s,
        eta=decision.eta, rebuild_s=decision.rebuild_s, benefit_s=decision.benefit_s,
        memory_price=decision.memory_price,
    )


class EstimatorWrapper:
    """An estimator that forwards everything to `inner`; subclasses change what they must."""

    def __init__(self, inner: TTLEstimator) -> None:
        self.inner = inner

    def decide(self, call: ToolCall) -> TTLDecision:
        return self.inner.decide(call)

    def observe_tool_call(self, call: ToolCall) -> None:
        self.inner.observe_tool_call(call)

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        self.inner.observe_next_turn(job_id, arrived_at_s)

    def observe_queueing_delay(self, delay_s: float) -> None:
        self.inner.observe_queueing_delay(delay_s)

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        self.inner.observe_job_end(job_id, num_turns)

    def warm_start(self, jobs: Iterable[TraceJob]) -> None:
        self.inner.warm_start(jobs)

    def state(self) -> dict[str, Any] | None:
        return self.inner.state()

    def load_state(self, state: object) -> None:
        self.inner.load_state(state)


class GuardedEstimator(EstimatorWrapper):
    """Wraps an estimator so that none of its failures reaches the scheduler step: a failed
    decision is "do not pin" (basis `estimator-error`), a failed observation is dropped. The
    first failure of each method is logged with its traceback, later ones counted."""

    def __init__(self, inner: TTLEstimator) -> None:
        super().__init__(inner)
        self.num_failures: dict[str, int] = {}

    def decide(self, call: ToolCall) -> TTLDecision:
        decision = self._guard("decide", super().decide, call)
        return decision if isinstance(decision, TTLDecision) else TTLDecision(0.0,
                                                                               "estimator-error")

    def observe_tool_call(self, call: ToolCall) -> None:
        self._guard("observe_tool_call", super().observe_tool_call, call)

    def observe_next_turn(self, job_id: str, arrived_at_s: float) -> None:
        self._guard("observe_next_turn", super().observe_next_turn, job_id, arrived_at_s)

    def observe_queueing_delay(self, delay_s: float) -> None:
        self._guard("observe_queueing_delay", super().observe_queueing_delay, delay_s)

    def observe_job_end(self, job_id: str, num_turns: int) -> None:
        self._guard("observe_job_end", super().observe_job_end, job_id, num_turns)

    def _guard(self, method: str, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except Exception:  # an estimator bug must cost a pin, never the engine
            count = self.num_failures.get(method, 0) + 1
            self.num_failures[method] = count
            if count == 1:
                logger.exception("the TTL estimator failed in %s; it is skipped", method)
            elif count % 1000 == 0:
                logger.error("the TTL estimator has failed %d times in %s", count, method)
            return None
