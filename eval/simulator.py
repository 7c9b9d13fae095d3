"""A discrete-event simulation of agent jobs on the real engine core, on a virtual clock.

The real scheduler, policy, estimator and KV cache run unchanged; the `simulated` executor
prices each step with a roofline profile and advances the virtual clock by that time instead
of sleeping. Jobs arrive at given times; each turn's prompt extends the previous one with its
generated tokens and freshly drawn appended tokens; a finished turn's next turn arrives after
its tool duration. Plain chat sessions may run beside the jobs: their turns carry no job (so
nothing of theirs is pinned), extend the session's previous prompt and output the same way,
and the next one arrives the recorded gap after the previous turn's arrival, or when the
previous turn finishes if that is later. Everything is seeded, so a run is deterministic.

The `continuum-oracle` policy is given the true duration of the tool that follows each agent
turn, looked up by request id.

With `SimSettings.num_replicas` > 1, as many engines (`eval.cluster.SimReplica`, each with its
own scheduler, KV pool, host tier and policy instance) share the virtual clock behind one
router (`engine.replicas.routing.make_router`). Each turn is routed when it arrives, among the
replicas' requests in flight (routed and not finished): an agent turn by its job id, a chat
turn by its session id (the HTTP ingress keys a conversation without a job by its opening
messages, which every turn of the session repeats; `engine.replicas.routing_key`); the router
forgets a job or session after its last turn. Every replica steps on its own, the event loop
always taking the earliest of the steps' ends and the turns' arrivals (`eval.cluster` says how
a step runs). One replica is the single engine: the same steps at the same times.
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TraceConfig
from engine.core.engine_core import EngineCore
from engine.core.wire import EngineCoreOutput, EngineCoreRequest
from engine.executor.simulated import SimulatedExecutor
from engine.replicas.routing import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_MIN_MOVE_LOAD,
    ReplicaRouter,
    RouterName,
    make_router,
)
from engine.request import JobInfo, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler.policy import SchedulingPolicy
from engine.scheduler.policy_registry import make_policy
from eval.cluster import (
    RoutingSummary,
    SimReplica,
    VirtualClock,
    cluster_stats,
    replica_ids,
    same_replica_fraction,
)
from eval.policy_variants import EVAL_POLICIES
from eval.replay_metrics import JobRecord, RunMetrics, TurnRecord, summarize_run
from eval.workload import AgentJobSpec, ChatSessionSpec, ChatTurnSpec, TurnSpec

# The policy that is told each tool's true duration (`tool_duration_s=` when built).
ORACLE_POLICY = EVAL_POLICIES["continuum-oracle"]


@dataclass(frozen=True)
class SimSettings:
    """One simulated run: the engine's policy with its options (`KEY`, `VALUE` string pairs,
    as the policy takes them), limits (`max_num_batched_tokens` is the token budget of a step,
    the chunked-prefill size), the cost profile, and the seed of the prompts' token ids.
    `num_kv_blocks=None` sizes the pool from the profile's memory; `kv_offload_gib` > 0 adds
    a host KV tier of that many GiB (0: none). `check_invariants` checks the scheduler after
    every step (slow; for tests). `job_inference` lets the scheduler infer the jobs of plain
    chat sessions (off: they stay plain requests, as in the documented figures, which predate
    it). `num_replicas` engines, each with all of the above, serve the turns behind the
    `router` (`engine.replicas.routing`), seeded by `seed`; `route_load_factor` and
    `route_min_move_load` are the affinity router's load bound. With several replicas, each
    writes its trace beside `trace_path`, its replica id before the suffix. ValueError for
    fewer than one replica, an unknown router, or a bad load bound."""

    policy: str
    policy_options: tuple[tuple[str, str], ...] = ()
    profile: str = "h100-llama3.1-8b"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_offload_gib: float = 0.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    seed: int = 0
    trace_path: str | None = None
    check_invariants: bool = False
    max_steps: int = 5_000_000
    job_inference: bool = False
    num_replicas: int = 1
    router: RouterName = "affinity"
    route_load_factor: float = DEFAULT_LOAD_FACTOR
    route_min_move_load: int = DEFAULT_MIN_MOVE_LOAD

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas!r}")
        self.make_router()

    def make_router(self) -> ReplicaRouter:
        """A new router as the settings describe it; ValueError for an unknown router or a bad
        load bound."""
        return make_router(self.router, seed=self.seed, load_factor=self.route_load_factor,
                           min_move_load=self.route_min_move_load)

    def replica_trace_path(self, replica_id: str) -> str | None:
        """Where replica `replica_id` writes its trace: `trace_path` itself with one replica,
        else `trace_path` with the replica id before its suffix; None without a trace."""
        if self.trace_path is None or self.num_replicas == 1:
            return self.trace_path
        path = Path(self.trace_path)
        return str(path.with_name(f"{path.stem}.{replica_id}{path.suffix}"))

    def engine_config(self, max_model_len: int, trace_path: str | None = None) -> EngineConfig:
        """One engine's config; `trace_path` overrides the settings' (a replica's trace)."""
        return EngineConfig(
            model=ModelConfig(model="tiny", max_model_len=max_model_len),
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              kv_offload_gib=self.kv_offload_gib),
            scheduler=SchedulerConfig(
                max_model_len=max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs, policy=EVAL_POLICIES.get(self.policy, self.policy),
                policy_options=dict(self.policy_options), job_inference=self.job_inference,
            ),
            trace=TraceConfig(path=self.trace_path if trace_path is None else trace_path),
            executor="simulated",
            sim_profile=self.profile,
        )


@dataclass(frozen=True)
class ChatLoad:
    """Plain chat sessions run beside the jobs, the i-th arriving at `arrivals_s[i]`."""

    sessions: tuple[ChatSessionSpec, ...] = ()
    arrivals_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.sessions) != len(self.arrivals_s):
            raise ValueError("need one arrival time per chat session")


@dataclass(order=True)
class _TurnArrival:
    time_s: float
    order: int
    stream: int = field(compare=False)
    turn_index: int = field(compare=False)


@dataclass
class _LiveTurn:
    """A routed turn; `arrival_s` is when its replica took it in."""

    stream: int
    turn_index: int
    prompt: list[int]
    arrival_s: float
    replica: SimReplica
    output: list[int] = field(default_factory=list)
    started_s: float | None = None
    first_token_s: float | None = None
    num_cached_tokens: int = 0


class Simulation:
    """Runs `jobs` arriving at `arrivals_s` (parallel lists), and the `chat` sessions, through
    `settings.num_replicas` engines behind one router. After `run`, `records` holds each job's
    turns, then each session's, and `routing_summary` says where the turns ran.

    A turn's queueing delay and TTFT count from when its replica took it in: at its arrival,
    or at the end of the step that replica was running then."""

    def __init__(
        self, jobs: Sequence[AgentJobSpec], arrivals_s: Sequence[float], settings: SimSettings,
        chat: ChatLoad = ChatLoad(),
    ) -> None:
        if len(jobs) != len(arrivals_s) or not jobs:
            raise ValueError("need one arrival time per job, and at least one job")
        self.jobs = list(jobs)
        self.sessions = list(chat.sessions)
        ids = [job.job_id for job in self.jobs] + [s.session_id for s in self.sessions]
        if len(set(ids)) != len(ids):
            raise ValueError("job and chat session ids must be distinct")
        self.settings = settings
        self.clock = VirtualClock()
        longest = max(item.max_seq_len for item in [*self.jobs, *self.sessions])
        max_model_len = _round_up(longest, 16)
        self._tool_durations_s: dict[str, float | None] = {}
        self.router = settings.make_router()
        self.replicas = [
            SimReplica(replica_id,
                       settings.engine_config(max_model_len,
                                              settings.replica_trace_path(replica_id)),
                       self.clock, self._make_policy(),
                       check_invariants=settings.check_invariants)
            for replica_id in replica_ids(settings.num_replicas)
        ]
        self._replicas_by_id = {replica.replica_id: replica for replica in self.replicas}
        starts = [*arrivals_s, *chat.arrivals_s]
        self._events = [_TurnArrival(t, i, i, 0) for i, t in enumerate(starts)]
        heapq.heapify(self._events)
        self._num_events = len(self._events)
        self._num_steps = 0
        self._live: dict[str, _LiveTurn] = {}
        self._unstarted: dict[str, set[str]] = {rid: set() for rid in self._replicas_by_id}
        self._contexts: dict[int, list[int]] = {}
        self._placements: list[list[str]] = [[] for _ in self.jobs]
        self.records = [JobRecord(stream_id, start_s)
                         for stream_id, start_s in zip(ids, starts, strict=True)]

    @property
    def core(self) -> EngineCore:
        """The first replica's engine core (the engine, with one replica)."""
        return self.replicas[0].core

    @property
    def executor(self) -> SimulatedExecutor:
        """The first replica's executor (the engine's, with one replica)."""
        return self.replicas[0].executor

    def placements(self) -> dict[str, list[str]]:
        """Each job's replica ids, turn by turn, as routed so far."""
        return {job.job_id: list(replicas)
                for job, replicas in zip(self.jobs, self._placements, strict=True)}

    def _make_policy(self) -> SchedulingPolicy:
        name, options = self.settings.policy, dict(self.settings.policy_options)
        name = EVAL_POLICIES.get(name, name)
        if name == ORACLE_POLICY:
            return make_policy(name, options, tool_duration_s=self.true_tool_duration_s)
        return make_policy(name, options)

    def true_tool_duration_s(self, request_id: str) -> float | None:
        """Seconds of the tool that runs after the agent turn `request_id`; None after a
        job's last turn, for a chat request, or for an id never submitted."""
        return self._tool_durations_s.get(request_id)

    def run(self) -> RunMetrics:
        """Runs every job and session to its end; the figures of the run, over all jobs
        (engine counters summed over the replicas, `busy_fraction` their mean)."""
        try:
            next_s: float | None = self.clock.now_s
            while next_s is not None:
                self.clock.now_s = next_s
                self._end_due_steps()
                self._submit_due_turns()
                self._start_steps()
                next_s = self._next_event_s()
            stats = cluster_stats([replica.core.stats() for replica in self.replicas])
            leaked_blocks = sum(replica.leaked_blocks() for replica in self.replicas)
        finally:
            for replica in self.replicas:
                replica.core.shutdown()
        num_jobs = len(self.jobs)
        busy_s = sum(replica.executor.busy_s for replica in self.replicas) / len(self.replicas)
        return summarize_run(self.records[:num_jobs], stats, busy_s=busy_s,
                             leaked_blocks=leaked_blocks,
                             chat=self.records[num_jobs:] if self.sessions else None)

    def routing_summary(self) -> RoutingSummary:
        """Where the turns routed so far went, and why."""
        return RoutingSummary(
            self.settings.router, dict(self.router.counts),
            {replica.replica_id: replica.num_routed for replica in self.replicas},
            same_replica_fraction(self._placements),
        )

    def _next_event_s(self) -> float | None:
        """The earliest step end or turn arrival; None when nothing is left to happen."""
        times = [replica.step_end_s for replica in self.replicas
                 if replica.step_end_s is not None]
        if self._events:
            times.append(self._events[0].time_s)
        return min(times, default=None)

    def _end_due_steps(self) -> None:
        for replica in self.replicas:
            if replica.step_end_s is None or replica.step_end_s > self.clock.now_s:
                continue
            outputs, taken_in = replica.end_step()
            for request in taken_in:
                self._taken_in(replica, request.request_id)
            self._deliver(outputs)

    def _start_steps(self) -> None:
        for replica in self.replicas:
            if replica.is_stepping or not replica.has_work():
                continue
            if self._num_steps >= self.settings.max_steps:
                raise RuntimeError(f"jobs unfinished after {self._num_steps} steps")
            started_s = self.clock.now_s
            replica.start_step()
            self._num_steps += 1
            self._note_starts(replica, started_s)

    def _submit_due_turns(self) -> None:
        while self._events and self._events[0].time_s <= self.clock.now_s:
            event = heapq.heappop(self._events)
            self._submit(event.stream, event.turn_index)

    def _submit(self, stream: int, turn_index: int) -> None:
        stream_id = self.records[stream].job_id
        turn, job_info = self._turn(stream, turn_index)
        rng = random.Random(zlib.crc32(f"{self.settings.seed}:{stream_id}:{turn_index}".encode()))
        vocab_size = self.core.vocab_size
        prompt = self._contexts.pop(stream, []) + [
            rng.randrange(vocab_size) for _ in range(turn.num_appended_tokens)
        ]
        request_id = f"{stream_id}#{turn_index}"
        if job_info is not None:
            self._tool_durations_s[request_id] = self.jobs[stream].turns[turn_index].tool_duration_s
        replica = self._route(stream, stream_id)
        self._live[request_id] = _LiveTurn(stream, turn_index, prompt, self.clock.now_s,
                                           replica)
        taken_in = replica.take(EngineCoreRequest(
            request_id=request_id, prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=turn.num_output_tokens, ignore_eos=True),
            job=job_info,
        ))
        if taken_in:
            self._taken_in(replica, request_id)

    def _route(self, stream: int, key: str) -> SimReplica:
        """The replica the router sends a turn of job or session `key` to, by the replicas'
        requests in flight."""
        loads = {replica.replica_id: replica.num_in_flight for replica in self.replicas}
        decision = self.router.choose(key, loads)
        self.router.routed(key, decision)
        if stream < len(self.jobs):
            self._placements[stream].append(decision.replica_id)
        return self._replicas_by_id[decision.replica_id]

    def _taken_in(self, replica: SimReplica, request_id: str) -> None:
        self._live[request_id].arrival_s = self.clock.now_s
        self._unstarted[replica.replica_id].add(request_id)

    def _turn(self, stream: int, turn_index: int) -> tuple[TurnSpec | ChatTurnSpec, JobInfo | None]:
        """The turn's token counts, and its job (None for a chat request)."""
        if stream >= len(self.jobs):
            return self.sessions[stream - len(self.jobs)].turns[turn_index], None
        job = self.jobs[stream]
        turn = job.turns[turn_index]
        return turn, JobInfo(job_id=job.job_id, is_last_step=turn_index == len(job.turns) - 1,
                             tool_name=turn.tool_name)

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's outputs reach their clients (the clock at the step's end)."""
        for output in outputs:
            live = self._live[output.request_id]
            if live.first_token_s is None and output.new_token_ids:
                live.first_token_s = self.clock.now_s
                live.num_cached_tokens = output.num_cached_tokens
            live.output.extend(output.new_token_ids)
            if output.finish_reason is not None:
                self._finish(output.request_id)

    def _note_starts(self, replica: SimReplica, step_started_s: float) -> None:
        requests = replica.core.scheduler.requests
        unstarted = self._unstarted[replica.replica_id]
        # A request gone from the scheduler finished within the step that started it.
        started = [rid for rid in unstarted
                   if rid not in requests or requests[rid].status != RequestStatus.WAITING]
        for request_id in started:
            self._live[request_id].started_s = step_started_s
            unstarted.discard(request_id)

    def _finish(self, request_id: str) -> None:
        live = self._live.pop(request_id)
        self._unstarted[live.replica.replica_id].discard(request_id)
        live.replica.finished()
        now_s = self.clock.now_s
        record = self.records[live.stream]
        started_s = now_s if live.started_s is None else live.started_s
        record.turns.append(TurnRecord(
            queue_s=started_s - live.arrival_s,
            ttft_s=(now_s if live.first_token_s is None else live.first_token_s) - live.arrival_s,
            num_prompt_tokens=len(live.prompt), num_cached_tokens=live.num_cached_tokens,
            num_output_tokens=len(live.output),
        ))
        next_s = self._next_arrival_s(live, now_s)
        if next_s is None:
            record.finished_s = now_s
            self.router.forget(record.job_id)
            return
        self._contexts[live.stream] = live.prompt + live.output
        heapq.heappush(self._events, _TurnArrival(next_s, self._num_events, live.stream,
                                                  live.turn_index + 1))
        self._num_events += 1

    def _next_arrival_s(self, live: _LiveTurn, now_s: float) -> float | None:
        """When the turn after `live` (which finished at `now_s`) arrives; None if it was the
        last of its job or session."""
        if live.stream < len(self.jobs):
            tool_s = self.jobs[live.stream].turns[live.turn_index].tool_duration_s
            return None if tool_s is None else now_s + tool_s
        gap_s = self.sessions[live.stream - len(self.jobs)].turns[live.turn_index].gap_s
        return None if gap_s is None else max(now_s, live.arrival_s + gap_s)


def simulate(
    jobs: Sequence[AgentJobSpec], arrivals_s: Sequence[float], settings: SimSettings,
    chat: ChatLoad = ChatLoad(),
) -> RunMetrics:
    """Runs one simulation; see `Simulation`."""
    return Simulation(jobs, arrivals_s, settings, chat).run()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
