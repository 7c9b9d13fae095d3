"""Victims under memory pressure: which pin or running request gives way when a running
request cannot get blocks.

A `VictimRule` answers `SchedulingPolicy.select_victim`; a `PinOrder` ranks the live pins
a rule gives up first. Strategy objects an `AgentPolicy` composes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from continuum.ledger import JobLedger
from continuum.waiting_order import attained_service_tokens
from engine.kv_cache.pins import Pin
from engine.request import Request
from engine.scheduler.policy import Victim

# A request preempted this often is preempted again only when no other running request can
# be (docs/decisions/0007-victim-order.md).
MAX_PREEMPTIONS = 3


class VictimRule(Protocol):
    def select(self, request: Request, now_s: float, ledger: JobLedger) -> Victim | None:
        """For running `request`, short of blocks: a running request to preempt (maybe
        itself), a live pin to release, or None (it waits this step)."""
        ...


class PinOrder(Protocol):
    def first(self, exclude_job_id: str | None, now_s: float, ledger: JobLedger) -> Pin | None:
        """The policy's live pin to release first (the job `exclude_job_id`'s last of all),
        or None when it holds none."""
        ...


def is_prefilling(request: Request) -> bool:
    """Whether a running request still has more than its next token to compute (a prompt,
    or a context recomputed after a preemption)."""
    return request.num_tokens - request.num_computed_tokens > 1


@dataclass(frozen=True)
class LatestAdmitted:
    """The running request admitted most recently (the least computed since, so the least
    recomputed), a request preempted `max_preemptions` times only when no other can be. A
    request still prefilling never preempts another: while another running request is
    decoding (and will finish or free blocks) it waits, keeping its blocks, else it preempts
    itself."""

    max_preemptions: int = MAX_PREEMPTIONS

    def select(self, request: Request, now_s: float, ledger: JobLedger) -> Victim | None:
        running = ledger.scheduler.running
        if is_prefilling(request):
            decoding = any(other is not request and not is_prefilling(other)
                           for other in running)
            return None if decoding else request
        index = max(range(len(running)), key=lambda i: (
            running[i].num_preemptions < self.max_preemptions, i))
        return running[index]


@dataclass(frozen=True)
class NewestRunning:
    """Stock V1: the running request admitted last."""

    def select(self, request: Request, now_s: float, ledger: JobLedger) -> Victim:
        return ledger.scheduler.running[-1]


@dataclass(frozen=True)
class MostServedJob:
    """Autellix: the running request whose job has the most attained service, counting the
    request's own progress; ties go to the latest admitted."""

    def select(self, request: Request, now_s: float, ledger: JobLedger) -> Victim:
        running = ledger.scheduler.running
        index = max(range(len(running)), key=lambda i: (
            attained_service_tokens(running[i], ledger) + running[i].num_computed_tokens, i))
        return running[index]


@dataclass(frozen=True)
class PinsFirst:
    """Pins are released before any running request is preempted (docs/decisions/
    0005-pins-before-preemption.md): the first pin of `pins` (with `spare_own_job`, the
    requester's own job's last); with no pin, the victim of `requests`."""

    pins: PinOrder
    requests: VictimRule
    spare_own_job: bool = True

    def select(self, request: Request, now_s: float, ledger: JobLedger) -> Victim | None:
        exclude_job_id = request.job_id if self.spare_own_job else None
        pin = self.pins.first(exclude_job_id, now_s, ledger)
        return pin if pin is not None else self.requests.select(request, now_s, ledger)


@dataclass(frozen=True)
class LatestIdleJobPin:
    """Continuum's order: pins whose job has a turn waiting to reuse them last, the excluded
    job's last of all; among the others the pin of the job that arrived last first."""

    def first(self, exclude_job_id: str | None, now_s: float, ledger: JobLedger) -> Pin | None:
        return max(ledger.policy_pins(), default=None, key=lambda pin: (
            ledger.num_waiting(pin.job_id) == 0, pin.job_id != exclude_job_id,
            ledger.job_arrival_rank(pin.job_id)))


@dataclass(frozen=True)
class LeastWastePin:
    """InferCept's order: the pin cheapest to recompute (fewest blocks) first, then the
    oldest; the excluded job's last."""

    def first(self, exclude_job_id: str | None, now_s: float, ledger: JobLedger) -> Pin | None:
        return min(ledger.policy_pins(), default=None, key=lambda pin: (
            pin.job_id == exclude_job_id, pin.num_blocks, pin.pinned_at_s))
