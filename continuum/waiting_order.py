"""Waiting orders: how an agent policy orders each tenant's waiting requests.

Each is a strategy object an `AgentPolicy` composes; `new_queue` builds the queue the
scheduler owns, keyed by the policy's `JobLedger`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from continuum.ledger import JobLedger
from continuum.queues import ProgramOrderQueue
from engine.request import Request, RequestStatus
from engine.scheduler.request_queue import KeyedRequestQueue, QueueKey, RequestQueue


class WaitingOrder(Protocol):
    @property
    def ages_by_service(self) -> bool:
        """Whether the order reads the engine seconds jobs consumed (`Job.attained_service_s`),
        which the policy then prices by the prefills the engine times at start-up."""
        ...

    def new_queue(self, ledger: JobLedger) -> RequestQueue:
        """A queue for one tenant's waiting requests, in this order."""
        ...


@dataclass(frozen=True)
class WaitingBounds:
    """How long a waiting request may be passed over (seconds): a request that waited
    `max_wait_s`, or one without a job that waited `max_plain_wait_s`, is overdue (it heads
    the queue, and pins yield to it; docs/decisions/0004-waiting-bounds.md)."""

    max_wait_s: float
    max_plain_wait_s: float

    def overdue_cutoffs(self, now_s: float) -> tuple[float, float]:
        """The arrival times at or before which a request, and a request without a job, are
        overdue at `now_s`."""
        return (now_s - self.max_wait_s, now_s - self.max_plain_wait_s)

    def is_overdue(self, request: Request, now_s: float, ledger: JobLedger) -> bool:
        """Whether waiting `request` has waited past its bound at `now_s`."""
        waited_s = now_s - ledger.arrival(request)[0]
        bound_s = self.max_wait_s
        if ledger.is_plain(request):
            bound_s = min(bound_s, self.max_plain_wait_s)
        return waited_s >= bound_s


UNBOUNDED = WaitingBounds(math.inf, math.inf)


@dataclass(frozen=True)
class ProgramOrder:
    """Program-level order aged by service, in tiers (`ProgramOrderQueue`): overdue requests
    (by arrival), overdue plain requests (`JobLedger.is_plain`; by arrival), preempted
    requests, then turns by their job's first arrival moved later by `service_weight`
    times the engine seconds the job consumed (`JobLedger.service_aged_order`), a turn of a
    job holding a live pin placed `pin_lead_s` earlier than that, and each plain request
    ahead of every turn that arrived after it. A job's turns thus pass a younger job's
    only until it has consumed (the younger job's later arrival + `pin_lead_s`) /
    `service_weight` engine seconds more than it, however long the queue."""

    bounds: WaitingBounds
    service_weight: float
    pin_lead_s: float

    @property
    def ages_by_service(self) -> bool:
        return self.service_weight > 0

    def new_queue(self, ledger: JobLedger) -> ProgramOrderQueue:
        service_weight = self.service_weight
        return ProgramOrderQueue(
            lambda request: ledger.service_aged_order(request, service_weight), ledger.arrival,
            lambda: [pin.job_id for pin in ledger.scheduler.pins],
            self.bounds.overdue_cutoffs, is_plain=ledger.is_plain, pin_lead_s=self.pin_lead_s)


@dataclass(frozen=True)
class ArrivalOrder:
    """FCFS: preempted requests first, then by arrival."""

    ages_by_service = False

    def new_queue(self, ledger: JobLedger) -> KeyedRequestQueue:
        def key(request: Request) -> QueueKey:
            return (request.status is not RequestStatus.PREEMPTED, ledger.arrival_order(request))
        return KeyedRequestQueue(key)


@dataclass(frozen=True)
class LeastAttainedService:
    """Program-level least attained service (Autellix's PLAS): by the tokens the request's
    job computed so far, then program-level order; keyed when a request enters the queue."""

    ages_by_service = False

    def new_queue(self, ledger: JobLedger) -> KeyedRequestQueue:
        def key(request: Request) -> QueueKey:
            return (attained_service_tokens(request, ledger), *ledger.job_order(request))
        return KeyedRequestQueue(key)


def attained_service_tokens(request: Request, ledger: JobLedger) -> int:
    """The tokens the finished turns of `request`'s job computed (0 without a job)."""
    job = ledger.jobs.get(request.job_id)
    return 0 if job is None else job.attained_service_tokens
