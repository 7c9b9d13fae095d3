"""What a waiting prompt must find before it starts, and which pins yield to it.

An `AdmissionRule` answers `SchedulingPolicy.reservation`, a `PinYield`
`SchedulingPolicy.select_victim` for a waiting head. Strategy objects an `AgentPolicy`
composes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from continuum.ledger import JobLedger
from continuum.victims import PinOrder
from continuum.waiting_order import WaitingBounds
from engine.kv_cache.pins import Pin
from engine.request import Request
from engine.scheduler.policy import Reservation

# Blocks per running request that must be free or reservable beyond a prompt's own before it
# starts: room for the running requests' next tokens (docs/decisions/
# 0006-whole-prompt-admission.md).
ADMISSION_HEADROOM_BLOCKS = 1


class AdmissionRule(Protocol):
    def reservation(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                    now_s: float, ledger: JobLedger) -> Reservation: ...


class ReservablePins(Protocol):
    def pins_for(self, request: Request, now_s: float, ledger: JobLedger) -> Iterable[Pin]:
        """The live pins, none of `request`'s own job, whose blocks count as room for the
        waiting head `request`'s later chunks."""
        ...


class PinYield(Protocol):
    def pin_to_release(self, request: Request, now_s: float, ledger: JobLedger) -> Pin | None:
        """For the blocked waiting head `request`: a live pin to release, or None."""
        ...


@dataclass(frozen=True)
class ThisChunk:
    """vLLM's rule: a prompt starts once its first chunk's blocks can be had."""

    def reservation(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                    now_s: float, ledger: JobLedger) -> Reservation:
        return Reservation(num_new_tokens)


@dataclass(frozen=True)
class OtherJobsPins:
    """Every other job's pin."""

    def pins_for(self, request: Request, now_s: float, ledger: JobLedger) -> list[Pin]:
        return [pin for pin in ledger.scheduler.pins if pin.job_id != request.job_id]


@dataclass(frozen=True)
class LaterJobsPins:
    """The pins of jobs that arrived after `request`'s and of jobs whose turn waits (behind
    the head `request`, so it cannot reuse them before `request` starts); every other job's
    once `request` is overdue. Program-level order: a later job's prompt does not start on
    the memory pinned for an earlier job's next turn."""

    bounds: WaitingBounds

    def pins_for(self, request: Request, now_s: float, ledger: JobLedger) -> list[Pin]:
        others = OtherJobsPins().pins_for(request, now_s, ledger)
        if self.bounds.is_overdue(request, now_s, ledger):
            return others
        rank = ledger.job_rank(request)
        return [pin for pin in others if ledger.num_waiting(pin.job_id) > 0
                or ledger.job_arrival_rank(pin.job_id) > rank]


@dataclass(frozen=True)
class WholePrompt:
    """A prompt starts once the blocks of all its chunks are free or held by `reservable`
    pins, and `headroom_blocks` more per running request (docs/decisions/
    0006-whole-prompt-admission.md), so that it need not stall or be preempted halfway."""

    reservable: ReservablePins
    headroom_blocks: int = ADMISSION_HEADROOM_BLOCKS

    def reservation(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                    now_s: float, ledger: JobLedger) -> Reservation:
        scheduler = ledger.scheduler
        headroom = self.headroom_blocks * len(scheduler.running) * scheduler.block_size
        num_tokens = max(num_new_tokens, request.num_tokens - num_hit_tokens + headroom)
        if num_tokens <= num_new_tokens or not scheduler.running:
            return Reservation(num_tokens)
        return Reservation(num_tokens, tuple(self.reservable.pins_for(request, now_s, ledger)))


@dataclass(frozen=True)
class YieldWhenIdle:
    """Pins yield only while nothing runs: other jobs' pins first (the most recently pinned
    first), the request's own job's last (its prefix hit usually needs those blocks)."""

    def pin_to_release(self, request: Request, now_s: float, ledger: JobLedger) -> Pin | None:
        scheduler = ledger.scheduler
        if scheduler.running:
            return None
        return max(ledger.policy_pins(), default=None,
                   key=lambda pin: (pin.job_id != request.job_id, pin.pinned_at_s))


@dataclass(frozen=True)
class YieldWhenOverdue:
    """The latest job's pin yields (its own job's last) at once while nothing runs, and
    while others run once the head is overdue (`bounds`; its own job's pin is then kept),
    so pins keep memory from a waiting request only until it is overdue
    (docs/decisions/0005-pins-before-preemption.md)."""

    bounds: WaitingBounds

    def pin_to_release(self, request: Request, now_s: float, ledger: JobLedger) -> Pin | None:
        latest = ledger.latest_job_pin(exclude_job_id=request.job_id)
        if not ledger.scheduler.running:
            return latest
        if not self.bounds.is_overdue(request, now_s, ledger):
            return None
        return None if latest is None or latest.job_id == request.job_id else latest


@dataclass(frozen=True)
class YieldInOrder:
    """The first pin of `pins` yields at once, the head's own job's last."""

    pins: PinOrder

    def pin_to_release(self, request: Request, now_s: float, ledger: JobLedger) -> Pin | None:
        return self.pins.first(request.job_id, now_s, ledger)
