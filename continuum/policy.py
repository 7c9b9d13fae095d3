"""The Continuum policy (DESIGN.md section 6): KV pins with TTLs, program-level order, and
pin-preferring preemption."""

from __future__ import annotations

from continuum.estimation import estimator_from_environment
from continuum.job_aware import DEFAULT_JOB_IDLE_TIMEOUT_S, JobAwarePolicy, youngest
from continuum.queues import TieredRequestQueue
from engine.kv_cache.pins import Pin
from engine.request import Request
from engine.scheduler.policy import PolicyEnvironment, SchedulerView, Victim
from estimator.base import TTLEstimator
from estimator.fixed import FixedTTLEstimator


class ContinuumPolicy(JobAwarePolicy):
    """Continuum scheduling for agent jobs; requests without a job are plain FCFS (exactly
    V1's order with chunked prefill; without it, a prompt passed over for the budget can make
    two preempted requests come back in arrival order where V1 takes the later-preempted
    first).

    - Retention: a non-final turn of a job is pinned for the estimator's TTL when it is
      positive (at most one pin per job; a newer pin replaces the older). The estimator is by
      default the engine's configured one (Eq. 2); the tool is the client's `tool_name` or
      parsed from the turn's output. The pin is released when the job's next turn is
      admitted, after that turn took its prefix hit.
    - Expiry: at step start, when `now > deadline` and no turn of the job is waiting.
    - Waiting order: preempted requests, then turns of jobs holding a pin, then the rest;
      within a tier by the job's first arrival, then the request's.
    - Victims: the youngest running request of a job without a pin. Only when the request
      that needs blocks is the sole such candidate are pins released (latest job first)
      before it is preempted.
    - Admission: while anything runs, the waiting head waits for memory; when nothing runs,
      pins are released (latest job first, the head's own job last) until it fits.
    """

    def __init__(
        self,
        *,
        estimator: TTLEstimator | None = None,
        job_idle_timeout_s: float = DEFAULT_JOB_IDLE_TIMEOUT_S,
    ) -> None:
        super().__init__(estimator=estimator, job_idle_timeout_s=job_idle_timeout_s)

    def bind(self, scheduler: SchedulerView) -> None:
        super().bind(scheduler)
        if self.estimator is None:
            self.estimator = self.default_estimator(scheduler.environment)

    @staticmethod
    def default_estimator(environment: PolicyEnvironment) -> TTLEstimator:
        """The estimator when none was given: the engine's configured one (Eq. 2 by
        default)."""
        return estimator_from_environment(environment)

    def make_queue(self) -> TieredRequestQueue:
        return TieredRequestQueue(self.job_order, pinned_job_ids=self._pinned_job_ids)

    def _pinned_job_ids(self) -> list[str]:
        return [pin.job_id for pin in self.scheduler.pins]

    def select_victim(self, request: Request) -> Victim:
        running = self.scheduler.running
        victim = youngest(running, lambda r: not self.holds_pin(r.job_id))
        if victim is None or (victim is request and self._is_sole_candidate(request)):
            pin = self.latest_job_pin()
            if pin is not None:
                return pin
        return running[-1] if victim is None else victim

    def _is_sole_candidate(self, request: Request) -> bool:
        return not any(
            other is not request and not self.holds_pin(other.job_id)
            for other in self.scheduler.running
        )

    def select_pin_to_release(self, request: Request) -> Pin | None:
        if self.scheduler.running:
            return None
        return self.latest_job_pin(exclude_job_id=request.job_id)


class ContinuumFixedPolicy(ContinuumPolicy):
    """Continuum with the preview release's TTL rule: pin for exactly 2.0 s when the tool's
    mean observed duration is at most 2.0 s or unknown. Isolates what the estimator adds."""

    @staticmethod
    def default_estimator(environment: PolicyEnvironment) -> TTLEstimator:
        return FixedTTLEstimator(2.0)
