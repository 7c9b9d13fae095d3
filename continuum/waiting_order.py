"""Waiting orders: how an agent policy orders each tenant's waiting requests.

Each is a strategy object an `AgentPolicy` composes; `new_queue` builds the queue the
scheduler owns, keyed by the policy's `JobLedger`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from continuum.ledger import JobLedger
from continuum.queues import KeyedRequestQueue, ProgramOrderQueue, QueueKey
from engine.request import Request, RequestStatus
from engine.scheduler.request_queue import RequestQueue


class WaitingOrder(Protocol):
    def new_queue(self, ledger: JobLedger) -> RequestQueue:
        """A queue for one tenant's waiting requests, in this order."""
        ...


@dataclass(frozen=True)
class WaitingBounds:
    """How long a waiting request may be passed over (seconds; docs/decisions/
    0004-waiting-bounds.md): a turn sorts by its job's first arrival but by no time more
    than `max_job_age_s` before its own; a request that waited `max_wait_s`, or one
    without a job that waited `max_plain_wait_s`, is overdue (it heads the queue, and
    pins yield to it)."""

    max_job_age_s: float
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


UNBOUNDED = WaitingBounds(math.inf, math.inf, math.inf)


@dataclass(frozen=True)
class ProgramOrder:
    """Program-level order in tiers (`ProgramOrderQueue`): overdue requests (by arrival),
    overdue plain requests (`JobLedger.is_plain`; by arrival), preempted requests, turns of
    jobs holding a pin, then the rest: turns by their job's first arrival (aged by
    `max_job_age_s`), each plain request ahead of every turn that arrived after it."""

    bounds: WaitingBounds

    def new_queue(self, ledger: JobLedger) -> ProgramOrderQueue:
        max_job_age_s = self.bounds.max_job_age_s
        return ProgramOrderQueue(
            lambda request: ledger.job_order(request, max_job_age_s), ledger.arrival,
            lambda: [pin.job_id for pin in ledger.scheduler.pins],
            self.bounds.overdue_cutoffs, is_plain=ledger.is_plain)


@dataclass(frozen=True)
class ArrivalOrder:
    """FCFS: preempted requests first, then by arrival."""

    def new_queue(self, ledger: JobLedger) -> KeyedRequestQueue:
        def key(request: Request) -> QueueKey:
            return (request.status is not RequestStatus.PREEMPTED, ledger.arrival_order(request))
        return KeyedRequestQueue(key)


@dataclass(frozen=True)
class LeastAttainedService:
    """Program-level least attained service (Autellix's PLAS): by the tokens the request's
    job computed so far, then program-level order; keyed when a request enters the queue."""

    def new_queue(self, ledger: JobLedger) -> KeyedRequestQueue:
        def key(request: Request) -> QueueKey:
            return (attained_service_tokens(request, ledger), *ledger.job_order(request))
        return KeyedRequestQueue(key)


def attained_service_tokens(request: Request, ledger: JobLedger) -> int:
    """The tokens the finished turns of `request`'s job computed (0 without a job)."""
    job = ledger.jobs.get(request.job_id)
    return 0 if job is None else job.attained_service_tokens
