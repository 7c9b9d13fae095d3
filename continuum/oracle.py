"""`continuum-oracle`: Continuum whose TTLs know each tool call's true duration.

The upper bound for any TTL rule, for the simulator (only it knows how long a tool will
run): Eq. 2 with the call's duration known, i.e. pin for exactly that duration when the
saving `T * eta + R` exceeds it, else not at all. `T`, `eta` and `R` are those the
configured estimator would use.
"""

from __future__ import annotations

from collections.abc import Callable

from continuum.estimation import EstimatorWrapper
from continuum.options import ContinuumOptions
from continuum.policy import ContinuumPolicy
from engine.scheduler.policy import SchedulerView
from estimator.base import ToolCall, TTLDecision, TTLEstimator
from estimator.solver import DurationCDF

# A pin must outlast the next turn's arrival at exactly `finish + duration`.
ORACLE_SLACK_S = 1e-3

ToolDurationLookup = Callable[[str], float | None]


class OracleTTLEstimator(EstimatorWrapper):
    """Decides with the true duration of the call (`tool_duration_s(request_id)`, None when
    unknown: then `inner` decides); everything observed goes to `inner`, which supplies the
    saving `T * eta + R`."""

    def __init__(self, inner: TTLEstimator, tool_duration_s: ToolDurationLookup) -> None:
        super().__init__(inner)
        self._tool_duration_s = tool_duration_s

    def decide(self, call: ToolCall) -> TTLDecision:
        decision = self.inner.decide(call)
        duration_s = None if call.request_id is None else self._tool_duration_s(call.request_id)
        if duration_s is None or decision.benefit_s is None:
            return decision
        ttl_s = duration_s + ORACLE_SLACK_S if duration_s < decision.benefit_s else 0.0
        return TTLDecision(ttl_s, "oracle", num_samples=decision.num_samples,
                           queueing_delay_s=decision.queueing_delay_s, eta=decision.eta,
                           rebuild_s=decision.rebuild_s, benefit_s=decision.benefit_s,
                           duration_cdf=DurationCDF((duration_s,), (1.0,)))


class ContinuumOraclePolicy(ContinuumPolicy):
    """Continuum with `OracleTTLEstimator` over the configured estimator (Eq. 2 by default).
    Built with `tool_duration_s`, which maps a finished turn's request id to the duration of
    the tool it called; only a simulator can supply it."""

    def __init__(self, options: ContinuumOptions | None = None, *,
                 tool_duration_s: ToolDurationLookup | None = None) -> None:
        if tool_duration_s is None:
            raise ValueError("continuum-oracle needs every tool call's true duration "
                             "(tool_duration_s); only the simulator (bench sim) has them")
        super().__init__(options)
        self._tool_duration_s = tool_duration_s

    def default_estimator(self, options: ContinuumOptions,
                          scheduler: SchedulerView) -> TTLEstimator:
        return OracleTTLEstimator(super().default_estimator(options, scheduler),
                                  self._tool_duration_s)
