"""The scheduling policy interface: the scheduler is mechanism, a policy object decides.

A policy decides the order of waiting requests, whether a finished turn's blocks are retained
(pinned, with a TTL), which running request or pin gives way under memory pressure, and which
pins to release so that a waiting request can be admitted. The scheduler calls it; the policy
acts on the scheduler only through `SchedulerView`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from engine.config import EstimatorConfig
from engine.kv_cache.pins import Pin, PinReleaseReason, PinTable
from engine.request import Request
from engine.scheduler.request_queue import RequestQueue
from engine.scheduler.tracer import SchedulerTracer

Victim = Request | Pin


class PolicyJobState(msgspec.Struct, kw_only=True):
    """A job-aware policy's books on one job; times are seconds on the scheduler's clock.

    `pins_released` counts the job's pins by `PinReleaseReason` value; `last_ttl_s` is the
    TTL the policy chose for the job's latest retained turn; `last_tool_name` the tool its
    latest finished turn called, as the policy understood it (None: unknown).
    """

    first_arrival_s: float
    last_active_s: float
    num_turns_arrived: int
    num_turns_finished: int
    num_pins_created: int
    pins_released: dict[str, int]
    last_ttl_s: float | None = None
    last_tool_name: str | None = None


@dataclass(frozen=True)
class PolicyEnvironment:
    """What the engine offers a policy beyond the scheduler's state; built by the engine core
    and fixed for the scheduler's life.

    - `estimator`: how to set up a TTL estimator, for policies that use one.
    - `profile_prefill`: measures (num_tokens, seconds) of prefills on the device (None when
      the executor cannot); only callable from `bind`, before any request holds blocks.
    - `decode`: token ids to text with the model's tokenizer (None without one), so a policy
      can read which tool a turn called.
    """

    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    profile_prefill: Callable[[], list[tuple[int, float]]] | None = None
    decode: Callable[[Sequence[int]], str] | None = None


class SchedulerView(Protocol):
    """What a policy may see of the scheduler (read-only) and the one action it may take."""

    @property
    def running(self) -> list[Request]:
        """RUNNING requests in admission order (do not mutate)."""
        ...

    @property
    def waiting(self) -> RequestQueue:
        """The waiting queue, in the policy's own order."""
        ...

    @property
    def pins(self) -> PinTable:
        """Live pins, oldest first."""
        ...

    @property
    def environment(self) -> PolicyEnvironment:
        """What the engine offers beyond the scheduler's state."""
        ...

    @property
    def tracer(self) -> SchedulerTracer | None:
        """The step tracer (None: tracing is off); a policy may explain its TTLs to it."""
        ...

    def release_pin(self, job_id: str, reason: PinReleaseReason) -> Pin | None:
        """Releases the job's pin (for example on TTL expiry); its blocks become evictable."""
        ...


class SchedulingPolicy(Protocol):
    """Decisions the scheduler delegates. Times are seconds on the scheduler's clock.

    Call order: `bind` once at scheduler construction; `on_step_start` at the start of every
    `schedule()`; `on_request_arrived` from `add_request`, before the request joins the
    waiting queue; `on_request_admitted` after a waiting request took its blocks and its job's
    pin was released (`on_pin_released` with reason REUSED comes first); `on_request_finished`
    for every finished request (aborts included), before `retention_ttl_s`; `on_pin_added` and
    `on_pin_released` whenever the pin table changes, whatever the cause; `on_job_ended` when a
    job's last turn finished or the job was released; `on_shutdown` once when the engine
    stops (to save what the policy learned).
    """

    def bind(self, scheduler: SchedulerView) -> None: ...

    def new_waiting_queue(self) -> RequestQueue: ...

    def on_step_start(self, now_s: float) -> None: ...

    def on_request_arrived(self, request: Request, now_s: float) -> None: ...

    def on_request_admitted(self, request: Request, now_s: float) -> None: ...

    def on_request_finished(self, request: Request, now_s: float) -> None: ...

    def on_job_ended(self, job_id: str, now_s: float) -> None: ...

    def on_pin_added(self, pin: Pin) -> None:
        """A pin now holds blocks for `pin.job_id` (since `pin.pinned_at_s`)."""
        ...

    def on_pin_released(self, pin: Pin) -> None:
        """`pin` stopped holding blocks (`pin.release_reason`, at `pin.released_at_s`)."""
        ...

    def on_shutdown(self) -> None: ...

    def job_state(self, job_id: str) -> PolicyJobState | None:
        """The policy's books on the job, or None if it keeps none."""
        ...

    @property
    def num_jobs(self) -> int:
        """How many jobs the policy keeps state for (bounded by its idle timeout)."""
        ...

    def retention_ttl_s(self, request: Request, now_s: float) -> float | None:
        """For a request of a job that finished normally: seconds to pin its blocks, or None
        to free them at once."""
        ...

    def select_victim(self, request: Request) -> Victim:
        """`request` (RUNNING) cannot get blocks: a running request to preempt (possibly
        `request` itself) or a live pin to release."""
        ...

    def select_pin_to_release(self, request: Request) -> Pin | None:
        """The waiting head `request` cannot get blocks: a live pin to release for it, or None
        to leave it waiting. Must not return None forever while pins alone block an otherwise
        idle engine."""
        ...


class BasePolicy:
    """Defaults shared by policies: no retention, notifications ignored, and pins released for
    admission only when nothing is running: other jobs' pins first (most recently pinned
    first), the request's own job's pin last (its prefix hit usually needs those blocks)."""

    scheduler: SchedulerView

    def bind(self, scheduler: SchedulerView) -> None:
        self.scheduler = scheduler

    def on_step_start(self, now_s: float) -> None:
        pass

    def on_request_arrived(self, request: Request, now_s: float) -> None:
        pass

    def on_request_admitted(self, request: Request, now_s: float) -> None:
        pass

    def on_request_finished(self, request: Request, now_s: float) -> None:
        pass

    def on_job_ended(self, job_id: str, now_s: float) -> None:
        pass

    def on_pin_added(self, pin: Pin) -> None:
        pass

    def on_pin_released(self, pin: Pin) -> None:
        pass

    def on_shutdown(self) -> None:
        pass

    def job_state(self, job_id: str) -> PolicyJobState | None:
        return None

    @property
    def num_jobs(self) -> int:
        return 0

    def retention_ttl_s(self, request: Request, now_s: float) -> float | None:
        return None

    def select_pin_to_release(self, request: Request) -> Pin | None:
        if self.scheduler.running:
            return None
        return max(
            self.scheduler.pins,
            key=lambda pin: (pin.job_id != request.job_id, pin.pinned_at_s),
            default=None,
        )
