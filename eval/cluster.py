"""Simulated engine replicas on one virtual clock, for the discrete-event simulator.

Each `SimReplica` is a whole engine, as one simulated engine is on its own: its engine core
(scheduler, KV pool and host tier, policy instance with its estimator) and its `simulated`
executor. All of them read one `VirtualClock`. `Simulation` (`eval.simulator`) routes every
turn to one of them and runs their steps in time order.

A replica's step runs whole when it starts: the core schedules at the step's start, the
executor's sleep moves the clock to the step's end while the core applies the sampled
tokens, and the clock is then set back to the start for the other replicas. The step's
outputs reach the clients at its end (`end_step`). Requests routed to a replica while its
step runs wait until it ends, as the core process reads its input between steps, so each
core sees its own time go forward only, and no request before its time. Between a step's
start and end only that replica's core is ahead of the clock, and nothing else reads it:
the router's loads are the requests routed to a replica and not yet finished for their
clients (`num_in_flight`).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import msgspec

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.wire import EngineCoreOutput, EngineCoreRequest, EngineStats
from engine.executor.simulated import SimulatedExecutor
from engine.scheduler.policy import SchedulingPolicy

# How far the virtual clock moves when a step can schedule nothing (as an idle engine polls).
IDLE_STEP_S = 0.001


class VirtualClock:
    """Seconds that pass only when `advance` is called (the executor's `sleep`) or the
    simulation sets `now_s`."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class SimReplica:
    """One simulated engine, named `replica_id`, on the shared `clock`. Owned by one
    `Simulation`, which hands it requests (`take`), starts a step when it is idle
    (`start_step`) and ends the step at the time `start_step` returned (`end_step`)."""

    def __init__(self, replica_id: str, config: EngineConfig, clock: VirtualClock,
                 policy: SchedulingPolicy, *, check_invariants: bool = False) -> None:
        self.replica_id = replica_id
        self.clock = clock
        self.executor = SimulatedExecutor(config, sleep=clock.advance)
        self.core = EngineCore(config, executor=self.executor, clock=clock, policy=policy)
        self.check_invariants = check_invariants
        self.num_routed = 0
        self.num_in_flight = 0
        self._held: list[EngineCoreRequest] = []
        self._step_end_s: float | None = None
        self._step_outputs: list[EngineCoreOutput] = []

    @property
    def is_stepping(self) -> bool:
        """Whether a step started and has not ended."""
        return self._step_end_s is not None

    @property
    def step_end_s(self) -> float | None:
        """When the step in progress ends (virtual seconds); None while none runs."""
        return self._step_end_s

    def take(self, request: EngineCoreRequest) -> bool:
        """A request routed here: queued in the core now when no step runs (True), else held
        until the step ends (False). Counts it in flight until `finished` is called."""
        self.num_routed += 1
        self.num_in_flight += 1
        if self.is_stepping:
            self._held.append(request)
            return False
        self.core.add_request(request)
        return True

    def finished(self) -> None:
        """One of the requests routed here finished."""
        self.num_in_flight -= 1

    def has_work(self) -> bool:
        return self.core.has_work()

    def start_step(self) -> float:
        """Runs one engine step from the clock's time; returns when it ends (at least
        `IDLE_STEP_S` later). The clock is back at the step's start on return."""
        if self.is_stepping:
            raise RuntimeError(f"replica {self.replica_id} is already stepping")
        started_s = self.clock.now_s
        self._step_outputs = self.core.step()
        if self.check_invariants:
            self.core.check_invariants()
        end_s = self.clock.now_s
        if end_s == started_s:
            end_s += IDLE_STEP_S
        self.clock.now_s = started_s
        self._step_end_s = end_s
        return end_s

    def end_step(self) -> tuple[list[EngineCoreOutput], list[EngineCoreRequest]]:
        """Ends the step in progress (the clock at its end): its outputs, and the requests
        held while it ran, now queued in the core in the order they came."""
        if not self.is_stepping:
            raise RuntimeError(f"replica {self.replica_id} has no step to end")
        outputs, self._step_outputs = self._step_outputs, []
        self._step_end_s = None
        held, self._held = self._held, []
        for request in held:
            self.core.add_request(request)
        return outputs, held

    def leaked_blocks(self) -> int:
        """KV blocks neither free nor pinned (0 once every request finished)."""
        scheduler = self.core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        return pool.num_blocks - pool.num_free_blocks - scheduler.pins.num_pinned_blocks


def replica_ids(num_replicas: int) -> list[str]:
    """`replica-0` ... , zero-padded so that they sort in order."""
    width = len(str(num_replicas - 1))
    return [f"replica-{index:0{width}d}" for index in range(num_replicas)]


def cluster_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' counters summed (`kv_usage` averaged, modes on if any replica's is); one
    replica's as they are."""
    if len(stats) == 1:
        return stats[0]
    fields = [msgspec.structs.asdict(one) for one in stats]
    merged: dict[str, object] = {}
    for name, first in fields[0].items():
        values = [one[name] for one in fields]
        if isinstance(first, dict):
            merged[name] = dict(functools.reduce(lambda a, b: a + Counter(b), values, Counter()))
        elif isinstance(first, bool):  # a mode (async_scheduling): on if any replica's is
            merged[name] = any(values)
        elif None in values:  # a figure some replica does not have (num_cpu_threads)
            merged[name] = None
        else:
            merged[name] = sum(values)
    merged["kv_usage"] = sum(one.kv_usage for one in stats) / len(stats)
    return EngineStats(**merged)


@dataclass(frozen=True)
class RoutingSummary:
    """Where a run's requests went: `router` (its name), `counts` (requests per routing kind,
    `engine.replicas.routing.RoutingKind`), `requests_per_replica` (replica id -> requests
    routed there, in id order), and `same_replica_turn_fraction`: of the agent turns after a
    job's first, the share that ran on the replica of the job's previous turn (None when no
    job had a second turn)."""

    router: str
    counts: Mapping[str, int]
    requests_per_replica: Mapping[str, int]
    same_replica_turn_fraction: float | None

    def to_dict(self) -> dict:
        return {"router": self.router, "routing_counts": dict(self.counts),
                "requests_per_replica": dict(self.requests_per_replica),
                "same_replica_turn_fraction": self.same_replica_turn_fraction}


def same_replica_fraction(placements: Sequence[Sequence[str]]) -> float | None:
    """Of the turns after the first of each sequence of replica ids (one per job), the share
    on the same replica as the turn before; None without such turns."""
    pairs = [pair for turns in placements for pair in pairwise(turns)]
    if not pairs:
        return None
    return sum(1 for before, after in pairs if before == after) / len(pairs)
