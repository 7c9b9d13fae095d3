"""`AgentPolicy`: a job-aware scheduling policy composed of strategy objects.

Every agent policy the engine registers (`continuum.presets`) is an `AgentPolicy` with its
own `Strategies`; a baseline is a different composition. The policy keeps the job books
(`JobLedger`), feeds them and its retention rule the scheduler's events, and answers the
scheduler's questions by asking the strategy in charge.
"""

from __future__ import annotations

from dataclasses import dataclass

from continuum.admission_rules import AdmissionRule, PinYield
from continuum.estimation import measured_prefill_cost
from continuum.ledger import JobLedger, ServiceCost
from continuum.retention_rules import RetentionRule
from continuum.victims import VictimRule
from continuum.waiting_order import WaitingOrder
from engine.request import Request, RequestStatus
from engine.scheduler import events
from engine.scheduler.policy import (
    JobBooks,
    Reservation,
    SchedulerView,
    SweepDecision,
    Victim,
)
from engine.scheduler.request_queue import RequestQueue
from engine.scheduler.retention import Retention


@dataclass(frozen=True)
class Strategies:
    """The objects an agent policy is made of, one job each: the waiting `order`, the
    `retention` rule (TTLs, the estimator and its price), the `victims` of memory pressure
    (pin release order and preemption), `admission` (what a waiting prompt reserves), and
    the `pin_yield` to a blocked waiting head."""

    order: WaitingOrder
    retention: RetentionRule
    victims: VictimRule
    admission: AdmissionRule
    pin_yield: PinYield


class AgentPolicy:
    """A `SchedulingPolicy` for agent jobs, named `name` (as traces record it). Jobs with no
    unfinished turn and no pin are forgotten after `job_idle_timeout_s`; at each sweep, pins
    past their deadline are released unless a turn of their job waits. Requests without a
    job are one-turn jobs, never pinned."""

    def __init__(self, name: str, strategies: Strategies, *, job_idle_timeout_s: float) -> None:
        self.name = name
        self.strategies = strategies
        self.ledger = JobLedger(job_idle_timeout_s)

    def bind(self, scheduler: SchedulerView) -> _Learner:
        self.ledger.scheduler = scheduler
        if self.strategies.order.ages_by_service:
            self.ledger.service_cost = ServiceCost(measured_prefill_cost(scheduler.environment))
        self.strategies.retention.bind(scheduler)
        return _Learner(self.ledger, self.strategies.retention)

    def new_waiting_queue(self) -> RequestQueue:
        return self.strategies.order.new_queue(self.ledger)

    def sweep(self, now_s: float) -> SweepDecision:
        idle = self.ledger.pop_idle_jobs(now_s)
        for job in idle:
            self.strategies.retention.forget(job)
        return SweepDecision(tuple(job.job_id for job in idle))

    def retention(self, request: Request, now_s: float) -> Retention | None:
        job = self.ledger.job_of(request)
        if (job is None or request.status is RequestStatus.FINISHED_ABORTED
                or request.job is None or request.job.is_last_step):
            return None
        return self.strategies.retention.decide(request, job, now_s, self.ledger)

    def select_victim(self, request: Request, now_s: float) -> Victim | None:
        if request.status is RequestStatus.RUNNING:
            return self.strategies.victims.select(request, now_s, self.ledger)
        return self.strategies.pin_yield.pin_to_release(request, now_s, self.ledger)

    def reservation(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                    now_s: float) -> Reservation:
        return self.strategies.admission.reservation(request, num_hit_tokens, num_new_tokens,
                                                     now_s, self.ledger)

    def job_state(self, job_id: str) -> JobBooks | None:
        job = self.ledger.jobs.get(job_id)
        return None if job is None else job.books()

    @property
    def num_jobs(self) -> int:
        return len(self.ledger.jobs)

    @property
    def num_jobs_created(self) -> int:
        return self.ledger.jobs.num_created


class _Learner:
    """The policy's subscriber to the scheduler's events: the books first, then the
    retention rule; a job that ended leaves both. Closing it (engine shutdown) closes the
    retention rule, which saves what it learned."""

    def __init__(self, ledger: JobLedger, retention: RetentionRule) -> None:
        self._ledger = ledger
        self._retention = retention

    def started(self, event: events.SchedulerStarted) -> None:
        pass

    def receive(self, event: events.SchedulerEvent) -> bool:
        ended = self._ledger.record(event)
        self._retention.learn(event, self._ledger)
        if ended is not None:
            self._retention.forget(ended)
        return True

    def close(self) -> None:
        self._retention.close()
