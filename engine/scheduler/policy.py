"""The scheduling policy interface: the scheduler is mechanism, a policy object decides.

A policy decides the order of waiting requests, whether a finished turn's blocks are retained
(pinned, with a TTL), which running request or pin of its own gives way under memory pressure
(for a running request or the waiting head), what a waiting prompt must find free before it
starts, and which jobs it forgets. The scheduler calls it and carries out what its methods
return; the policy reads the scheduler (`SchedulerView`) and learns what happened from the
scheduler's event stream (`bind` returns its subscriber), acting on nothing but its own books.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from engine.kv_cache.pins import Pin, PinTable
from engine.request import Request, RequestStatus
from engine.scheduler.events import SchedulerSubscriber
from engine.scheduler.options import parse_policy_options
from engine.scheduler.request_queue import RequestQueue, WaitingRequests
from engine.scheduler.retention import Retention

Victim = Request | Pin
JobBooks = dict[str, Any]


@dataclass(frozen=True, slots=True)
class SweepDecision:
    """A policy's time-driven upkeep (`SchedulingPolicy.sweep`): `forgotten_job_ids`, the
    jobs the policy dropped from its books (idle past its timeout), in the order it did
    so."""

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
        """Time-driven upkeep: which jobs idle beyond the policy's timeout the policy forgot
        (from its own books). Called at the start of every step and, while no request is
        unfinished, between steps at most once per sweep interval, after the scheduler
        released the pins past their deadline. A sweep with nothing due changes nothing."""
        ...

    def retention(self, request: Request, now_s: float) -> Retention | None:
        """`request` finished (its status says how; called before its `RequestFinished`
        event). For a non-final turn of a job that finished normally: whether to pin its
        cached blocks, and why; None to free them with nothing to explain (requests without
        a job, aborted or final turns, policies that never pin)."""
        ...

    def select_victim(self, request: Request, now_s: float) -> Victim | None:
        """`request` cannot get blocks, and no pin of another tenant over its share or of a
        client it may take is left (`engine.scheduler.victim_chain`). Running: a running
        request to preempt (possibly `request` itself), a live pin of the policy's own, or
        None: `request` waits this step, keeping its blocks (the step then admits nobody);
        None only while another running request can finish or free blocks, so that the
        engine keeps moving. Waiting (the head, for its admission or the room its
        `reservation` asks): a live pin of the policy's own to release for it, or None to
        leave it waiting; not None forever while the policy's pins alone block an otherwise
        idle engine."""
        ...

    def reservation(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                    now_s: float) -> Reservation:
        """What the waiting head `request` (its prefix hit `num_hit_tokens`) must find before
        it is admitted to compute `num_new_tokens` this step: at least those tokens' blocks.
        Called before every admission attempt; the scheduler allocates only this step's."""
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
    nothing learned, vLLM's admission (this step's chunk), stock V1's victim (the running
    request admitted last), and pins released for a waiting head only when nothing is
    running: other jobs' pins first (most recently pinned first), the request's own job's
    pin last (its prefix hit usually needs those blocks); only the policy's own pins (a
    plugin's that retains).

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

    def retention(self, request: Request, now_s: float) -> Retention | None:
        return None

    def reservation(self, request: Request, num_hit_tokens: int, num_new_tokens: int,
                    now_s: float) -> Reservation:
        return Reservation(num_new_tokens)

    def select_victim(self, request: Request, now_s: float) -> Victim | None:
        running = self.scheduler.running
        if request.status is RequestStatus.RUNNING:
            return running[-1]
        if running:
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
