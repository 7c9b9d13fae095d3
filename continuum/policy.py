"""The Continuum policy: KV pins with TTLs, program-level order with bounded waiting, and
pins released before any running request is preempted."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from continuum.estimation import (
    GuardedEstimator,
    build_estimator,
    retention_inputs,
    save_estimator,
)
from continuum.jobs import Job
from continuum.options import ContinuumFixedOptions, ContinuumOptions
from continuum.program_order import JobFCFSPolicy
from engine.kv_cache.pins import Pin, PinReleaseReason
from engine.request import Request
from engine.scheduler.policy import Retention, SchedulerView, Victim
from estimator.base import ToolCall, TTLEstimator
from estimator.signals import PinLossRate
from estimator.solver import PinValue


class ContinuumPolicy(JobFCFSPolicy):
    """Continuum scheduling for agent jobs: program-level order (`JobFCFSPolicy`) with pins;
    requests without a job are ordinary requests, never pinned. Options: `ContinuumOptions`
    (`--policy-option KEY=VALUE`).

    - Retention: a non-final turn of a job that called a tool (named by the client or parsed
      from its output) is pinned for the estimator's TTL when it is positive (Eq. 2 by
      default, its pins priced by the memory they take, `pin_cost=priced-capped`, and its R the
      prefill time times the requests whose steps a rebuild would lengthen,
      `rebuild_cost=prefill-times-running`, and its cold-start prior used only until the
      first tool duration is observed, `cold_start_samples=0`); a turn that called no tool
      is not pinned. At most one pin per job (a newer one replaces the
      older). With `max_pinned_fraction` < 1, a new pin first has the pins of jobs that
      arrived later released (latest first), else it is declined. The pin is released when
      the job's next turn is admitted, after that turn took its prefix hit.
    - Expiry (`pin_expiry`): at step start, when `now > deadline` and no turn of the job is
      waiting; at the end of the step's planning, when `now > deadline` (a turn of the job
      that was waiting was not admitted): a deadline is a hard end.
    - Arrival holds (`arrival_hold=until-admitted`, off by default): a job's next turn that
      arrives while its job holds no pin has its cached prefix held as its job's pin
      (`Pin.holds_waiting_turn`) until it is admitted, for at most `max_wait_s`; it then
      waits in the pinned tier, and still counts as a turn back without its KV for T.
    - Waiting order: as `JobFCFSPolicy`'s, turns of jobs holding a pin in their own tier.
    - Memory for running requests (`pin_victims=first`): pins are released first
      (`pin_to_release_first`: holds of waiting turns first, pins whose job's turn waits
      last, then the latest job's first, the request's own job's last); then the victims
      of `JobFCFSPolicy` (by `victim_order`; a request still prefilling waits or yields its
      own blocks).
    - Admission (`prefill_admission=whole-prompt`): a prompt starts once the blocks of all
      its chunks are free or held by pins its later chunks may take (`reservable_pins`: by
      default those of jobs that arrived after its own, other jobs' holds of waiting turns,
      and pins whose job's turn waits behind it; every other job's once it is overdue).
    - A waiting head that cannot get blocks has pins released for it (latest job
      first, its own job's last) at once when nothing runs, and while others run once it is
      overdue (`is_overdue`: it has waited `pin_yield_wait_s` or `max_wait_s`, whichever is
      shorter, or `max_plain_wait_s` for a plain request; its own job's pin is then kept);
      with `pin_yield=later-jobs`, the pins of jobs that arrived after its job yield at once.
      So pins never hold memory a running request needs, and keep memory from a waiting
      request only until their deadline or until it is overdue.
    """

    options_type = ContinuumOptions
    options: ContinuumOptions

    def __init__(self, options: ContinuumOptions | None = None, *,
                 estimator: TTLEstimator | None = None) -> None:
        super().__init__(options)
        self._given_estimator = estimator
        self.estimator: GuardedEstimator
        self.pin_losses = PinLossRate()

    def bind(self, scheduler: SchedulerView) -> None:
        super().bind(scheduler)
        inner = self._given_estimator
        if inner is None:
            inner = self.default_estimator(self.options, scheduler)
        self.estimator = GuardedEstimator(inner)

    def default_estimator(self, options: ContinuumOptions,
                          scheduler: SchedulerView) -> TTLEstimator:
        """The estimator when none was given: the one the options name."""
        return build_estimator(options, scheduler)

    # What the estimator learns from.
    def on_request_arrived(self, request: Request, now_s: float) -> None:
        super().on_request_arrived(request, now_s)
        job = self.job_of(request)
        if job is not None and job.num_turns_finished > 0:
            self.estimator.observe_next_turn(job.job_id, now_s)

    def on_request_admitted(self, request: Request, reused_pin: Pin | None,
                            now_s: float) -> None:
        super().on_request_admitted(request, reused_pin, now_s)
        job = self.job_of(request)
        # A pin held from the turn's own arrival kept its prefix while it waited, not while
        # its tool ran: the turn came back without a pin all the same.
        retained = reused_pin is not None and not reused_pin.holds_waiting_turn
        returned_without_kv = (job is not None and job.num_turns_finished > 0
                               and not retained and request.num_preemptions == 0)
        if returned_without_kv:
            self.estimator.observe_queueing_delay(now_s - self.arrival(request)[0])

    def arrival_hold_s(self, request: Request, num_hit_tokens: int,
                       now_s: float) -> float | None:
        """With `arrival_hold=until-admitted`, a job's next turn has its cached prefix held
        until it is admitted, for at most `max_wait_s` (when it heads the queue anyway) or
        `max_ttl_s`; not past the pin cap."""
        job = self.job_of(request)
        if self.options.arrival_hold == "none" or job is None or job.num_turns_finished == 0:
            return None
        if self.options.max_pinned_fraction < 1:
            cap_blocks = self.options.max_pinned_fraction * self.scheduler.num_kv_blocks
            needed = num_hit_tokens // self.scheduler.block_size
            if self.scheduler.pins.num_pinned_blocks + needed > cap_blocks:
                return None
        return min(self.options.max_wait_s, self.options.max_ttl_s)

    def on_request_finished(self, request: Request, now_s: float) -> Retention | None:
        prefill = request.uninterrupted_prefill
        if prefill is not None:
            self.estimator.observe_prefill(*prefill)
        return super().on_request_finished(request, now_s)

    def forget_job(self, job: Job) -> None:
        self.estimator.observe_job_end(job.job_id, job.num_turns_finished)

    def on_shutdown(self) -> None:
        save_estimator(self.estimator, self.options)

    # Retention.
    def retention(self, request: Request, job: Job, now_s: float) -> Retention:
        call = self.tool_call(request, job, now_s)
        if call is None:
            return self.no_tool_call()
        if self.options.pin_loss == "discounted":
            call = dataclasses.replace(call, pin_loss_rate_per_s=self.pin_losses.rate_per_s)
        self.estimator.observe_tool_call(call)
        return self.pin_decision(call, request, job)

    def on_pin_released(self, pin: Pin) -> None:
        super().on_pin_released(pin)
        if pin.released_at_s is not None and not pin.holds_waiting_turn:
            self.pin_losses.add(pin.released_at_s - pin.pinned_at_s,
                                taken=pin.release_reason is PinReleaseReason.PRESSURE)

    def pin_decision(self, call: ToolCall, request: Request, job: Job) -> Retention:
        """The estimator's TTL for the call, with the pins to release first to keep pins
        under the cap, or declined if the cap leaves no room; `job.pin_value` becomes what
        the pin is expected to save."""
        decision = self.estimator.decide(call)
        inputs = retention_inputs(call, decision)
        job.pin_value = PinValue(decision.benefit_s or 0.0, decision.ttl_s,
                                 decision.duration_cdf)
        if decision.ttl_s <= 0:
            return Retention(decision.ttl_s, inputs)
        released = self._pins_to_make_room(request, call.job_id)
        if released is None:
            return Retention(0.0, dataclasses.replace(inputs, declined_by="pin-cap"))
        return Retention(decision.ttl_s, inputs, release_job_ids=released)

    def _pins_to_make_room(self, request: Request, job_id: str) -> tuple[str, ...] | None:
        """The jobs whose pins must go for a new pin of `request`'s blocks to fit under the pin
        cap: other jobs' holds of waiting turns' prefixes first, then the pins of jobs that
        arrived after `job_id`'s, latest first; None if it cannot."""
        if self.options.max_pinned_fraction >= 1:
            return ()
        cap_blocks = self.options.max_pinned_fraction * self.scheduler.num_kv_blocks
        pins = self.scheduler.pins
        own = pins.get(job_id)
        needed = request.num_computed_tokens // self.scheduler.block_size
        held = pins.num_pinned_blocks - (0 if own is None else own.num_blocks)
        rank = self.job_arrival_rank(job_id)
        holds = [pin for pin in pins if pin.holds_waiting_turn and pin.job_id != job_id]
        later = sorted((pin for pin in pins if self.job_arrival_rank(pin.job_id) > rank
                        and not pin.holds_waiting_turn),
                       key=lambda pin: self.job_arrival_rank(pin.job_id), reverse=True)
        released: list[str] = []
        for pin in holds + later:
            if held + needed <= cap_blocks:
                break
            released.append(pin.job_id)
            held -= pin.num_blocks
        return tuple(released) if held + needed <= cap_blocks else None

    # Memory pressure.
    def select_victim(self, request: Request, now_s: float) -> Victim | None:
        if self.options.pin_victims == "first":
            pin = self.pin_to_release_first(request.job_id, now_s)
            return pin if pin is not None else super().select_victim(request, now_s)
        victim = super().select_victim(request, now_s)
        if victim is request or victim is None:
            pin = self.pin_to_release_first(request.job_id, now_s)
            if pin is not None:
                return pin
        return victim

    def expired_pins(self, now_s: float) -> Sequence[Pin]:
        return super().expired_pins(now_s) if self.options.pin_expiry == "hard" else ()

    def pin_to_release_first(self, exclude_job_id: str | None, now_s: float) -> Pin | None:
        """The pin least worth keeping: holds of waiting turns' prefixes
        (`arrival_hold`) first, pins whose job's turn is waiting to reuse them last, and the
        job `exclude_job_id`'s last of all; among the others, by `pin_release_order`:
        the latest job's first, or the one expected to save the least per block for each
        further second held at `now_s`."""
        if self.options.pin_release_order == "latest-job":
            return max(self.scheduler.pins, default=None, key=lambda pin: (
                pin.holds_waiting_turn, self.num_waiting(pin.job_id) == 0,
                pin.job_id != exclude_job_id, self.job_arrival_rank(pin.job_id)))
        return max(self.scheduler.pins, default=None, key=lambda pin: (
            pin.holds_waiting_turn, self.num_waiting(pin.job_id) == 0,
            pin.job_id != exclude_job_id,
            -self.saving_rate_per_block(pin, now_s), self.job_arrival_rank(pin.job_id)))

    def saving_rate_per_block(self, pin: Pin, now_s: float) -> float:
        """Seconds the pin is expected to save, per block, for each further second it is held
        (`PinValue.saving_rate`); 0 when its job's books do not price it."""
        job = self.jobs.get(pin.job_id)
        value = None if job is None else job.pin_value
        if value is None or pin.num_blocks == 0:
            return 0.0
        return value.saving_rate(now_s - pin.pinned_at_s) / pin.num_blocks

    def reservable_pins(self, request: Request, now_s: float) -> Iterable[Pin]:
        """With `reservable_pins=later-jobs`, the pins of jobs that arrived after `request`'s,
        other jobs' holds of waiting turns, and the pins of jobs whose turn waits (behind
        the head `request`, so it cannot reuse them before `request` starts); every other
        job's once `request` is overdue (they all yield to it then). Program-level order: a
        later job's prompt does not start on the memory pinned for an earlier job's next
        turn. These are the blocks it may count on, not a choice of which pins its chunks
        take under pressure (`pin_to_release_first` decides that)."""
        others = super().reservable_pins(request, now_s)
        if self.options.reservable_pins == "other-jobs" or self.is_overdue(request, now_s):
            return others
        rank = self.job_rank(request)
        return [pin for pin in others if pin.holds_waiting_turn
                or self.num_waiting(pin.job_id) > 0 or self.job_arrival_rank(pin.job_id) > rank]

    def select_pin_to_release(self, request: Request, now_s: float) -> Pin | None:
        if not self.scheduler.running:
            return self.latest_job_pin(exclude_job_id=request.job_id)
        later = self.latest_job_pin(exclude_job_id=request.job_id)
        if (self.options.pin_yield == "later-jobs" and later is not None
                and self.job_arrival_rank(later.job_id) > self.job_rank(request)):
            return later
        if not self.is_overdue(request, now_s):
            return None
        return None if later is None or later.job_id == request.job_id else later

    def is_overdue(self, request: Request, now_s: float) -> bool:
        """Whether a waiting request has waited long enough for every pin to yield to it:
        `pin_yield_wait_s` or `max_wait_s`, whichever is shorter, or, for a plain request
        (`is_plain`), `max_plain_wait_s`."""
        waited_s = now_s - self.arrival(request)[0]
        bound_s = min(self.options.pin_yield_wait_s, self.options.max_wait_s)
        if self.is_plain(request):
            bound_s = min(bound_s, self.options.max_plain_wait_s)
        return waited_s >= bound_s


class ContinuumFixedPolicy(ContinuumPolicy):
    """Continuum with the preview release's TTL rule by default: pin for exactly 2.0 s when
    the tool's mean observed duration is at most 2.0 s or unknown. Isolates what the
    estimator adds."""

    options_type = ContinuumFixedOptions

