"""The scheduling policy interface: the scheduler is mechanism, a policy object decides.

A policy decides the order of waiting requests, whether a finished turn's blocks are retained
(pinned, with a TTL), which running request or pin gives way under memory pressure, what a
waiting prompt must find free before it starts, which pins to release for it, and which pins
have run out. The scheduler calls it and carries out what its methods return; the policy
reads the scheduler (`SchedulerView`) and learns what happened from the scheduler's event
stream (`bind` returns its subscriber), acting on nothing but its own books.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from engine.kv_cache.pins import Pin, PinTable
from engine.request import Request
from engine.scheduler.events import SchedulerSubscriber
from engine.scheduler.options import parse_policy_options
from engine.scheduler.request_queue import RequestQueue, WaitingRequests
from engine.scheduler.retention import Retention

Victim = Request | Pin
JobBooks = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SweepDecision:
    """A policy's time-driven upkeep (`SchedulingPolicy.sweep`): `expired_pins`, live pins
    whose TTL ran out, which the scheduler releases (EXPIRED) in this order; and
    `forgotten_job_ids`, the jobs the policy dropped from its books (idle past its timeout,
    counting those pins as released), in the order it did so."""

    expired_pins: tuple[Pin, ...] = ()
    forgotten_job_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Reservation:
    """What a waiting prompt must find before it is admitted (`SchedulingPolicy.reservation`):
    the blocks of `num_tokens` tokens past its prefix hit free, or held by `pins` (live pins
    of other jobs, which its later chunks may take). `num_tokens` of this step's chunk alone
    is vLLM's rule; more makes a long prompt wait until its later chunks fit too."""

    num_tokens: int
    pins: tuple[Pin, ...] = ()


@dataclass(frozen=True)
class PolicyEnvironment:
    """What the engine offers a policy beyond the scheduler's state; built by the engine core
    and fixed for the scheduler's life.

    - `profile_prefill`: measures (num_tokens, seconds) of prefills on the device (None when
      the executor cannot); only callable from `bind`, before any request holds blocks.
    - `decode`: token ids to text with the model's tokenizer (None without one), so a policy
      can read which tool a turn called.
    - `profile_kv_reload`: measures (num_tokens, seconds) of loading that many tokens' KV
      from the host tier into the device pool (None without a host tier, or when the
      executor cannot); like `profile_prefill`, only callable from `bind`.
    """

    profile_prefill: Callable[[], list[tuple[int, float]]] | None = None
    decode: Callable[[Sequence[int]], str] | None = None
    profile_kv_reload: Callable[[], list[tuple[int, float]]] | None = None


class SchedulerView(Protocol):
    """What a policy may see of the scheduler (read-only)."""

    @property
    def running(self) -> list[Request]:
        """RUNNING requests in admission order (do not mutate)."""
        ...

    @property
    def waiting(self) -> WaitingRequests:
        """The waiting requests: each tenant's in the policy's own order, the tenants taking
        turns (`tenant_queue.TenantFairQueue`; without tenants, the policy's order)."""
        ...

    @property
    def pins(self) -> PinTable:
        """Live pins, oldest first."""
        ...

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV pool."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        ...

    @property
    def num_host_kv_blocks(self) -> int:
        """Blocks in the host tier (0: none)."""
        ...

    @property
    def environment(self) -> PolicyEnvironment:
        """What the engine offers beyond the scheduler's state."""
        ...


class SchedulingPolicy(Protocol):
    """Decisions the scheduler delegates. Times are seconds on the scheduler's clock.

    Built by the registry with `from_options` (its options validated into its own frozen
    config). `bind` is called once, at scheduler construction; it returns the subscriber
    through which the policy learns what happens (arrivals, admissions, finished requests,
    pins, ended jobs: the scheduler's event stream, `engine.scheduler.events`; closed when
    the engine stops, so that the policy can save what it learned), or None. Each tenant's
    waiting requests live in a queue from `new_waiting_queue`, which the scheduler owns.
    Its `name` is what traces call it.
    """

    name: str

    def bind(self, scheduler: SchedulerView) -> SchedulerSubscriber | None:
        """Called once, at the end of the scheduler's construction."""
        ...

    def new_waiting_queue(self) -> RequestQueue:
        """A queue for the waiting requests of one tenant (None without tenants), in the
        policy's order; the scheduler owns it until none waits, and tells it the time at
        every step start (`advance_to`). Across tenants the scheduler takes turns."""
        ...

    def sweep(self, now_s: float) -> SweepDecision:
        """Time-driven upkeep: which pins past their deadline the scheduler releases, and
        which jobs idle beyond the policy's timeout the policy forgot (from its own books).
        Called at the start of every step and, while no request is unfinished, between steps
        at most once per sweep interval. A sweep with nothing due changes nothing."""
        ...

    def expired_pins(self, now_s: float) -> Sequence[Pin]:
        """Live pins to release (EXPIRED) at the end of planning a step, after its admissions
        had the chance to reuse them."""
        ...

    def retention(self, request: Request, now_s: float) -> Retention | None:
        """`request` finished (its status says how; called before its `RequestFinished`
        event). For a non-final turn of a job that finished normally: whether to pin its
        cached blocks, and why; None to free them with nothing to explain (requests without
        a job, aborted or final turns, policies that never pin)."""
        ...

    def select_victim(self, request: Request, now_s: float) -> Victim | None:
        """`request` (RUNNING) cannot get blocks: a running request to preempt (possibly
        `request` itself), a live pin of the policy's own (`source` "policy": clients' pins
        are the scheduler's to give up, before it asks), or None: `request` waits this step,
        keeping its blocks (the step then admits nobody). None only while another running
        request can finish or free blocks, so that the engine keeps moving."""
        ...

    def reservation(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                    now_s: float) -> Reservation:
        """What the waiting head `request` (its prefix hit `num_hit_tokens`) must find before
        it is admitted to compute `num_new_tokens` this step: at least those tokens' blocks.
        Called before every admission attempt; the scheduler allocates only this step's."""
        ...

    def select_pin_to_release(self, request: Request, now_s: float) -> Pin | None:
        """The waiting head `request` cannot get blocks: a live pin of the policy's own to
        release for it, or None to leave it waiting. Must not return None forever while its
        pins alone block an otherwise idle engine."""
        ...

    def job_state(self, job_id: str) -> JobBooks | None:
        """The policy's books on the job as JSON-ready data, or None if it keeps none."""
        ...

    @property
    def num_jobs(self) -> int:
        """How many jobs the policy keeps state for (bounded by its idle timeout)."""
        ...

    @property
    def num_jobs_created(self) -> int:
        """How many jobs the policy has started books for, since it was built."""
        ...


class BasePolicy:
    """Defaults for policies without jobs (FCFS, priority, plugins): no options, no retention,
    nothing learned, vLLM's admission (this step's chunk), and pins released for admission
    only when nothing is running: other jobs' pins first (most recently pinned first), the
    request's own job's pin last (its prefix hit usually needs those blocks); only the
    policy's own pins (a plugin's that retains).

    A policy with options sets `options_type` to a frozen dataclass (see
    `engine.scheduler.options`) and takes the parsed value as its `options` argument.
    """

    options_type: ClassVar[type | None] = None
    scheduler: SchedulerView

    @property
    def name(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}"

    @classmethod
    def from_options(cls, options: Mapping[str, object], **kwargs: Any) -> BasePolicy:
        """The policy built with its options parsed and validated; ValueError naming a bad
        or unknown key."""
        parsed = parse_policy_options(cls.options_type, options,
                                      owner=f"scheduling policy {cls.__name__}")
        return cls(**kwargs) if parsed is None else cls(options=parsed, **kwargs)

    def bind(self, scheduler: SchedulerView) -> SchedulerSubscriber | None:
        self.scheduler = scheduler
        return None

    def sweep(self, now_s: float) -> SweepDecision:
        return SweepDecision()

    def expired_pins(self, now_s: float) -> Sequence[Pin]:
        return ()

    def retention(self, request: Request, now_s: float) -> Retention | None:
        return None

    def reservation(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                    now_s: float) -> Reservation:
        return Reservation(num_new_tokens)

    def select_pin_to_release(self, request: Request, now_s: float) -> Pin | None:
        if self.scheduler.running:
            return None
        return max(
            (pin for pin in self.scheduler.pins if pin.source == "policy"),
            key=lambda pin: (pin.job_id != request.job_id, pin.pinned_at_s),
            default=None,
        )

    def job_state(self, job_id: str) -> JobBooks | None:
        return None

    @property
    def num_jobs(self) -> int:
        return 0

    @property
    def num_jobs_created(self) -> int:
        return 0
