"""The Continuum policies' TTL estimator: built from the policy's options and what the engine
offers, and guarded so that no estimator failure can fail a scheduler step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from continuum.options import ContinuumOptions
from engine.scheduler.policy import PolicyEnvironment, RetentionInputs, SchedulerView
from estimator.base import ToolCall, TTLDecision, TTLEstimator
from estimator.cost_model import HostReloadCost, PrefillCostModel, read_prefill_profile
from estimator.registry import PRICES_REBUILDS, EstimatorSettings, make_estimator
from estimator.state_file import load_state_or_cold_start, save_state
from estimator.traces import TraceJob, read_trace_jobs

logger = logging.getLogger(__name__)


def build_estimator(options: ContinuumOptions, scheduler: SchedulerView) -> TTLEstimator:
    """The configured estimator: `R` priced by the given or measured prefill profile, or, for
    a context the engine's host tier can hold, by the load time measured at start-up
    (`prefill_profile=none`: R = 0 either way), then the saved state if one loads, else
    warm-started from the traces (a saved state already holds what an earlier warm start
    taught). ValueError if a trace or the profile file is bad; a corrupt state file only
    warns."""
    prices_rebuilds = (options.estimator in PRICES_REBUILDS
                       and options.prefill_profile != "none")
    settings = EstimatorSettings(
        prefill_cost=_prefill_cost(options, scheduler.environment),
        reload_cost=measured_reload_cost(scheduler) if prices_rebuilds else None,
        rebuild_cost=options.rebuild_cost, pin_cost=options.pin_cost,
        max_ttl_s=options.max_ttl_s, prefill_fit=options.prefill_fit,
        cold_start_samples=options.cold_start_samples,
    )
    estimator = make_estimator(options.estimator, settings)
    loaded = (options.estimator_state is not None
              and load_state_or_cold_start(estimator, options.estimator_state))
    if not loaded:
        for path in options.estimator_warm_start:
            estimator.warm_start(read_trace_jobs(path))
    return estimator


def _prefill_cost(options: ContinuumOptions,
                  environment: PolicyEnvironment) -> PrefillCostModel | None:
    source = options.prefill_profile
    if options.estimator not in PRICES_REBUILDS:
        return None  # nothing to price: do not time prefills for it
    if source == "none":
        return PrefillCostModel()
    if source != "auto":
        return PrefillCostModel.fit(read_prefill_profile(source))
    return measured_prefill_cost(environment)


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


def save_estimator(estimator: TTLEstimator, options: ContinuumOptions) -> None:
    """Saves what the estimator learned to the configured state file, if any; an unwritable
    file is logged, not raised (the engine is stopping)."""
    if options.estimator_state is None:
        return
    try:
        save_state(estimator, options.estimator_state)
    except (OSError, ValueError, TypeError) as error:
        logger.error("cannot save the estimator state to %s: %s", options.estimator_state, error)


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

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.inner.observe_prefill(num_tokens, seconds)

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

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self._guard("observe_prefill", super().observe_prefill, num_tokens, seconds)

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
