"""The scheduling policy interface: the scheduler is mechanism, a policy object decides.

A policy decides the order of waiting requests, whether a finished turn's blocks are retained
(pinned, with a TTL), which running request or pin gives way under memory pressure, which
pins to release so that a waiting request can be admitted, and which pins have run out. The
scheduler calls it and carries out what its hooks return; the policy only reads the
scheduler (`SchedulerView`) and acts on nothing but its own books.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from engine.kv_cache.pins import Pin, PinTable
from engine.request import Request
from engine.scheduler.options import parse_policy_options
from engine.scheduler.request_queue import RequestQueue, WaitingRequests

Victim = Request | Pin
JobBooks = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RetentionInputs:
    """Why a policy chose a TTL (`ttl_s`, before anything overruled it; 0: do not pin) for a
    finished turn that called `tool`, or for the cached prefix of a turn that arrived, for
    whoever records it (the trace).

    `source` names the rule: for Eq. 2 the distribution that decided (`cold-start`, `tool`,
    `pooled`, `learned`), else the policy's rule (`fixed`, `constant`, `until-next-turn`,
    `no-tool-call`; InferCept with swap: `preserve`, `discard` or `swap`; `arrival-hold`
    for a prefix held from a turn's arrival, `SchedulingPolicy.arrival_hold_s`). Eq. 2's inputs,
    when it decided: `num_samples` of the distribution, `queueing_delay_s` (T), `eta`,
    `rebuild_s` (R), `benefit_s` (T * eta + R) and `memory_price` (seconds of the others'
    delay a second of the pin costs, with a priced `pin_cost`). `declined_by` names what
    overruled a positive TTL (`pin-cap`: the pins' share of the pool was full)."""

    ttl_s: float | None
    source: str
    tool: str | None = None
    num_samples: int | None = None
    queueing_delay_s: float | None = None
    eta: float | None = None
    rebuild_s: float | None = None
    benefit_s: float | None = None
    declined_by: str | None = None
    memory_price: float | None = None


@dataclass(frozen=True, slots=True)
class Retention:
    """A policy's decision on a finished turn of a job: pin its cached blocks for `ttl_s`
    seconds (> 0; `math.inf` holds them until released), or not at all (0). `inputs` say
    why, for the scheduler's event stream (a pin is then traced as pinned or declined).
    `offload`: when not pinned, whether the blocks freed go to the host tier (if the engine
    has one) or are left to be recomputed. `release_job_ids`: the jobs whose pins the
    scheduler releases (PRESSURE) before pinning, to make room for the new pin."""

    ttl_s: float
    inputs: RetentionInputs
    offload: bool = True
    release_job_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if math.isnan(self.ttl_s) or self.ttl_s < 0:
            raise ValueError(f"a retention ttl_s must be >= 0, got {self.ttl_s!r}")

    @property
    def pins(self) -> bool:
        return self.ttl_s > 0


@dataclass(frozen=True, slots=True)
class SweepDecision:
    """A policy's time-driven upkeep (`SchedulingPolicy.sweep`): `expired_pins`, live pins
    whose TTL ran out, which the scheduler releases (EXPIRED) in this order; and
    `forgotten_job_ids`, the jobs the policy dropped from its books (idle past its timeout,
    counting those pins as released), in the order it did so."""

    expired_pins: tuple[Pin, ...] = ()
    forgotten_job_ids: tuple[str, ...] = ()


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

    Built by the registry with `from_options` (a classmethod: the policy's options, validated
    into its own frozen config). Call order: `bind` once at scheduler construction; `sweep`
    at the start of every `schedule()` and, while no request is unfinished, on a timer
    between steps (`Scheduler.sweep`); `new_waiting_queue` each time a tenant (None without
    tenants) begins waiting, for a queue of that tenant's requests that the scheduler then
    owns until none waits (it takes turns among the tenants' queues,
    `tenant_queue.TenantFairQueue`, and tells each the time at every step start, after
    `sweep`), so a queue keeps no order of its own beyond its requests' keys;
    `on_request_arrived` from `add_request`, before the request joins the waiting queue;
    `on_request_admitted` after a waiting request took its blocks and its job's pin was
    released (`on_pin_released` with reason REUSED comes first); `expired_pins` at the end
    of planning every step;
    `on_request_finished` for every finished request (aborts included), whose answer the
    scheduler carries out; `on_pin_added` and `on_pin_released` whenever the pin table
    changes, whatever the cause; `on_job_ended` when a job's last turn finished or the job
    was released; `on_shutdown` once when the engine stops (to save what the policy
    learned).
    """

    def bind(self, scheduler: SchedulerView) -> None: ...

    def new_waiting_queue(self) -> RequestQueue: ...

    def sweep(self, now_s: float) -> SweepDecision:
        """Time-driven upkeep: which pins past their deadline the scheduler releases, and
        which jobs idle beyond the policy's timeout the policy forgot (from its own books).

        Called by the scheduler at the start of every step and, while no request is
        unfinished, between steps at most once per sweep interval of the engine core's idle
        loop (`EngineCoreProc.SWEEP_INTERVAL_S`; no model step runs then). `now_s` is the
        scheduler's clock (seconds). A sweep with nothing due must change nothing."""
        ...

    def on_request_arrived(self, request: Request, now_s: float) -> None: ...

    def arrival_hold_s(self, request: Request, num_hit_tokens: int,
                       now_s: float) -> float | None:
        """A turn of a job that holds no pin arrived with `num_hit_tokens` of its prompt
        cached on the device (> 0): seconds to hold those blocks as its job's pin, so that
        they are not evicted while it waits (released when it is admitted, at the deadline,
        or under pressure like any pin); None (or 0): no hold. Called in `add_request`,
        after `on_request_arrived`."""
        ...

    def on_request_admitted(self, request: Request, reused_pin: Pin | None,
                            now_s: float) -> None:
        """`request` took its blocks; `reused_pin` is its job's pin, released because the
        request took over its blocks (None if the job held none; its own held prefix when
        `reused_pin.holds_waiting_turn`)."""
        ...

    def on_request_finished(self, request: Request, now_s: float) -> Retention | None:
        """`request` finished (its status says how). For a turn of a job that finished
        normally: whether to pin its cached blocks, and why; None to free them with nothing to
        explain (requests without a job, aborted or final turns, policies that never pin)."""
        ...

    def on_job_ended(self, job_id: str, now_s: float) -> None: ...

    def on_pin_added(self, pin: Pin) -> None:
        """A pin now holds blocks for `pin.job_id` (since `pin.pinned_at_s`)."""
        ...

    def on_pin_released(self, pin: Pin) -> None:
        """`pin` stopped holding blocks (`pin.release_reason`, at `pin.released_at_s`)."""
        ...

    def on_shutdown(self) -> None: ...

    def job_state(self, job_id: str) -> JobBooks | None:
        """The policy's books on the job as JSON-ready data, or None if it keeps none."""
        ...

    @property
    def num_jobs(self) -> int:
        """How many jobs the policy keeps state for (bounded by its idle timeout)."""
        ...

    def select_victim(self, request: Request, now_s: float) -> Victim | None:
        """`request` (RUNNING) cannot get blocks at the step of time `now_s`: a running
        request to preempt (possibly
        `request` itself), a live pin to release, or None: `request` waits this step,
        keeping its blocks (the step then admits nobody). None only while another running
        request can finish or free blocks, so that the engine keeps moving."""
        ...

    def expired_pins(self, now_s: float) -> Sequence[Pin]:
        """Live pins to release (EXPIRED) at the end of planning a step, after its admissions
        had the chance to reuse them. `now_s` is the step's time on the scheduler's clock."""
        ...

    def select_pin_to_release(self, request: Request, now_s: float) -> Pin | None:
        """The waiting head `request` cannot get blocks: a live pin to release for it, or None
        to leave it waiting. Must not return None forever while pins alone block an otherwise
        idle engine."""
        ...

    def num_tokens_to_reserve(self, request: Request, num_hit_tokens: int,
                              num_new_tokens: int) -> int:
        """Tokens past its prefix hit (`num_hit_tokens`) whose blocks must be free or held by
        `reservable_pins` before the waiting head `request` is admitted to compute
        `num_new_tokens` this step: at least `num_new_tokens` (vLLM's rule: this step's
        chunk); more makes a long prompt wait until the blocks of its later chunks are there
        too. Called before every admission attempt; the scheduler allocates only this step's
        blocks."""
        ...

    def reservable_pins(self, request: Request, now_s: float) -> Iterable[Pin]:
        """The live pins, none of `request`'s own job, whose blocks count as room for the
        waiting head `request`'s later chunks at the step of time `now_s` (those chunks may
        take them under memory pressure, `select_victim`, or `select_pin_to_release` may
        give them up). Called when `num_tokens_to_reserve` asks for more than this step's
        chunk while other requests run."""
        ...


class BasePolicy:
    """Defaults shared by policies: no options, no retention, notifications ignored, every
    other job's pin counted as room for a waiting prompt's later chunks, and pins released
    for admission only when nothing is running: other jobs' pins first (most recently pinned
    first), the request's own job's pin last (its prefix hit usually needs those blocks).

    A policy with options sets `options_type` to a frozen dataclass (see
    `engine.scheduler.options`) and takes the parsed value as its `options` argument.
    """

    options_type: ClassVar[type | None] = None
    scheduler: SchedulerView

    @classmethod
    def from_options(cls, options: Mapping[str, object], **kwargs: Any) -> BasePolicy:
        """The policy built with its options parsed and validated; ValueError naming a bad
        or unknown key."""
        parsed = parse_policy_options(cls.options_type, options,
                                      owner=f"scheduling policy {cls.__name__}")
        return cls(**kwargs) if parsed is None else cls(options=parsed, **kwargs)

    def bind(self, scheduler: SchedulerView) -> None:
        self.scheduler = scheduler

    def sweep(self, now_s: float) -> SweepDecision:
        return SweepDecision()

    def on_request_arrived(self, request: Request, now_s: float) -> None:
        pass

    def arrival_hold_s(self, request: Request, num_hit_tokens: int,
                       now_s: float) -> float | None:
        return None

    def on_request_admitted(self, request: Request, reused_pin: Pin | None,
                            now_s: float) -> None:
        pass

    def on_request_finished(self, request: Request, now_s: float) -> Retention | None:
        return None

    def on_job_ended(self, job_id: str, now_s: float) -> None:
        pass

    def on_pin_added(self, pin: Pin) -> None:
        pass

    def on_pin_released(self, pin: Pin) -> None:
        pass

    def on_shutdown(self) -> None:
        pass

    def job_state(self, job_id: str) -> JobBooks | None:
        return None

    @property
    def num_jobs(self) -> int:
        return 0

    def expired_pins(self, now_s: float) -> Sequence[Pin]:
        return ()

    def num_tokens_to_reserve(self, request: Request, num_hit_tokens: int,
                              num_new_tokens: int) -> int:
        return num_new_tokens

    def reservable_pins(self, request: Request, now_s: float) -> Iterable[Pin]:
        return [pin for pin in self.scheduler.pins if pin.job_id != request.job_id]

    def select_pin_to_release(self, request: Request, now_s: float) -> Pin | None:
        if self.scheduler.running:
            return None
        return max(
            self.scheduler.pins,
            key=lambda pin: (pin.job_id != request.job_id, pin.pinned_at_s),
            default=None,
        )
