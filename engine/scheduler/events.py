"""The scheduler's event stream: what happened, as it happened, for whoever subscribes.

The scheduler emits every event to one `SchedulerEvents` stream; subscribers (the tracer
today) receive them in order, synchronously, from the scheduler's thread. An event carries
explicit values and the live objects it is about (requests, pins), which a subscriber reads
at once and never keeps or changes. Nothing the scheduler decides depends on a subscriber.

Order within a step: `StepStarted`, then `Admitted` / `Preempted` as planning goes,
`StepPlanned`; after the step ran, `ApplyingOutput`, `RequestFinished` (with
`RetentionDecided` for a job's turn), then `StepEnded`: the events between `ApplyingOutput`
and `StepEnded` are that step's. With async scheduling step N+1 is planned (`StepStarted` to
`StepPlanned`) before step N's output is applied. `RequestArrived`, `PinReleased` and
`JobEnded` come whenever they happen (`RequestArrived` before the request joins the waiting
queue); `Flushed` marks the end of events between steps (an idle sweep's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.config import SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import PrefixHit
from engine.kv_cache.pins import Pin, PinTable
from engine.kv_cache.transfers import KVTransfers
from engine.request import Request
from engine.scheduler.retention import RetentionInputs

PreemptionReason = Literal["out_of_blocks", "tenant_share"]


@dataclass(frozen=True, slots=True)
class SchedulerStarted:
    """Sent to each subscriber when it subscribes: the policy (`SchedulingPolicy.name`),
    the scheduler's clock at that time, the pool and the step limits, and the next step."""

    policy_name: str
    clock_origin_s: float
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    first_step: int


@dataclass(frozen=True, slots=True)
class PoolState:
    """The block pool entering a step: totals, free blocks (those still caching a prefix
    among them), blocks held by pins (each once, however many pins share it), and the jobs
    holding pins."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_pinned_blocks: int
    pinned_job_ids: list[str]


@dataclass(frozen=True, slots=True)
class StepStarted:
    """Step `step` is being planned at `now_s`: the requests running and waiting (the live
    list and queue, iterated in queue order: read them at once) and the pool entering it,
    under the step's limits."""

    step: int
    now_s: float
    running: Sequence[Request]
    waiting: Iterable[Request]
    pool: PoolState
    token_budget: int
    max_num_seqs: int

    @classmethod
    def of(cls, step: int, now_s: float, running: Sequence[Request],
           waiting: Iterable[Request], block_pool: BlockPool, pins: PinTable,
           config: SchedulerConfig) -> StepStarted:
        """The state entering step `step`: requests, the block pool and the pins."""
        return cls(
            step, now_s, running, waiting,
            PoolState(
                num_total_blocks=block_pool.num_blocks,
                num_free_blocks=block_pool.num_free_blocks,
                num_cached_free_blocks=block_pool.num_cached_free_blocks,
                num_pinned_blocks=pins.num_pinned_blocks,
                pinned_job_ids=[pin.job_id for pin in pins],
            ),
            token_budget=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        )


@dataclass(frozen=True, slots=True)
class RequestArrived:
    """`request` joined the waiting queue; if its job was inferred, `inferred_from` is the
    finished request whose turn it continues (None: it started the job)."""

    request: Request
    now_s: float
    inferred_from: str | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    """A waiting request took its blocks (`hit` is its prefix in both tiers; `resumed`: it
    had been preempted); `job_pin` is its job's pin, still live."""

    request: Request
    hit: PrefixHit
    job_pin: Pin | None
    resumed: bool
    now_s: float


@dataclass(frozen=True, slots=True)
class Preempted:
    """`request` is about to lose its `num_computed_tokens` for `needed_by`: a running
    request that could not get blocks ("out_of_blocks"), or because `request`'s tenant is
    over its share of the batch and KV pool while `needed_by`'s is within its own
    ("tenant_share", `engine.scheduler.tenant_shares`: for a waiting `needed_by`, or in place
    of the policy's victim)."""

    request: Request
    needed_by: Request
    reason: PreemptionReason = "out_of_blocks"


@dataclass(frozen=True, slots=True)
class StepPlanned:
    """The step's plan: who was admitted, tokens per request and in all, host-tier copies."""

    admitted: Sequence[Request]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    transfers: KVTransfers
    now_s: float


@dataclass(frozen=True, slots=True)
class ApplyingOutput:
    """Step `step`'s output is being applied: the events until `StepEnded` are its."""

    step: int


@dataclass(frozen=True, slots=True)
class StepEnded:
    """Step `step`'s output was applied: its events are complete. Events until the next
    `ApplyingOutput` belong to `next_step`, the next step to be planned (`step + 1`, or
    `step + 2` with async scheduling, where step + 1 was planned before this output)."""

    step: int
    next_step: int


@dataclass(frozen=True, slots=True)
class Flushed:
    """Events between steps (an idle sweep's pin releases) are complete."""


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """`request` left the scheduler (its status says how)."""

    request: Request
    now_s: float


@dataclass(frozen=True, slots=True)
class RetentionDecided:
    """The scheduler carried out a policy's retention decision on a job's finished turn,
    explained by `inputs`: it pinned `request`'s blocks (`pin`) or freed them (None)."""

    request: Request
    pin: Pin | None
    inputs: RetentionInputs
    now_s: float


@dataclass(frozen=True, slots=True)
class PinReleased:
    """`pin` stopped holding blocks (`pin.release_reason`, at `pin.released_at_s`)."""

    pin: Pin


@dataclass(frozen=True, slots=True)
class JobEnded:
    """The job ended (`reason`: the pin release reason's value)."""

    job_id: str
    reason: str
    now_s: float


SchedulerEvent = (StepStarted | RequestArrived | Admitted | Preempted | StepPlanned
                  | ApplyingOutput | StepEnded | Flushed | RequestFinished | RetentionDecided
                  | PinReleased | JobEnded)


class SchedulerSubscriber(Protocol):
    """Receives a scheduler's events (see the module docstring for their order)."""

    def started(self, event: SchedulerStarted) -> None:
        """Subscribed to a scheduler in this state; ValueError to refuse (then not
        subscribed)."""
        ...

    def receive(self, event: SchedulerEvent) -> bool:
        """One event; False to receive no more (the stream then drops and closes it)."""
        ...

    def close(self) -> None:
        """No more events will come."""
        ...


class SchedulerEvents:
    """The one stream a scheduler emits to; owned by the scheduler."""

    def __init__(self) -> None:
        self._subscribers: list[SchedulerSubscriber] = []

    @property
    def subscribers(self) -> tuple[SchedulerSubscriber, ...]:
        """Those subscribed now, in the order they subscribed (empty: events go nowhere)."""
        return tuple(self._subscribers)

    def __bool__(self) -> bool:
        """Whether anyone subscribes (so an event is worth building)."""
        return bool(self._subscribers)

    def subscribe(self, subscriber: SchedulerSubscriber, state: SchedulerStarted) -> None:
        """Adds `subscriber`, first telling it the scheduler's `state`."""
        subscriber.started(state)
        self._subscribers.append(subscriber)

    def emit(self, event: SchedulerEvent) -> None:
        """Hands `event` to every subscriber, dropping those that want no more."""
        if not self._subscribers:
            return
        for subscriber in tuple(self._subscribers):
            if not subscriber.receive(event):
                self._subscribers.remove(subscriber)
                subscriber.close()

    def close(self) -> None:
        """Closes every subscriber; the stream then has none."""
        subscribers, self._subscribers = self._subscribers, []
        for subscriber in subscribers:
            subscriber.close()
