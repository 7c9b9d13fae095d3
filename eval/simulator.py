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
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TraceConfig
from engine.core.engine_core import EngineCore
from engine.core.wire import EngineCoreRequest
from engine.executor.simulated import SimulatedExecutor
from engine.request import JobInfo, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler.policy import SchedulingPolicy
from engine.scheduler.registry import make_policy
from eval.metrics import JobRecord, RunMetrics, TurnRecord, summarize_run
from eval.workload import AgentJobSpec, ChatSessionSpec, ChatTurnSpec, TurnSpec

# How far the virtual clock moves when a step can schedule nothing (as an idle engine polls).
IDLE_STEP_S = 0.001
# The policy that is told each tool's true duration (`tool_duration_s=` when built).
ORACLE_POLICY = "continuum-oracle"


class VirtualClock:
    """Seconds that pass only when `advance` is called (the executor's `sleep`)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@dataclass(frozen=True)
class SimSettings:
    """One simulated run: the engine's policy with its options (`KEY`, `VALUE` string pairs,
    as the policy takes them), limits (`max_num_batched_tokens` is the token budget of a step,
    the chunked-prefill size), the cost profile, and the seed of the prompts' token ids.
    `num_kv_blocks=None` sizes the pool from the profile's memory; `kv_offload_gib` > 0 adds
    a host KV tier of that many GiB (0: none). `check_invariants` checks the scheduler after
    every step (slow; for tests). `job_inference` lets the scheduler infer the jobs of plain
    chat sessions (off: they stay plain requests, as in the documented figures, which predate
    it)."""

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

    def engine_config(self, max_model_len: int) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model="tiny", max_model_len=max_model_len),
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              kv_offload_gib=self.kv_offload_gib),
            scheduler=SchedulerConfig(
                max_model_len=max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs, policy=self.policy,
                policy_options=dict(self.policy_options), job_inference=self.job_inference,
            ),
            trace=TraceConfig(path=self.trace_path),
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
    stream: int
    turn_index: int
    prompt: list[int]
    arrival_s: float
    output: list[int] = field(default_factory=list)
    started_s: float | None = None
    first_token_s: float | None = None
    num_cached_tokens: int = 0


class Simulation:
    """Runs `jobs` arriving at `arrivals_s` (parallel lists), and the `chat` sessions, through
    one engine core. After `run`, `records` holds each job's turns, then each session's."""

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
        config = settings.engine_config(_round_up(longest, 16))
        self.executor = SimulatedExecutor(config, sleep=self.clock.advance)
        self._tool_durations_s: dict[str, float | None] = {}
        self.core = EngineCore(config, executor=self.executor, clock=self.clock,
                               policy=self._make_policy())
        starts = [*arrivals_s, *chat.arrivals_s]
        self._events = [_TurnArrival(t, i, i, 0) for i, t in enumerate(starts)]
        heapq.heapify(self._events)
        self._num_events = len(self._events)
        self._live: dict[str, _LiveTurn] = {}
        self._unstarted: set[str] = set()
        self._contexts: dict[int, list[int]] = {}
        self.records = [JobRecord(stream_id, start_s)
                         for stream_id, start_s in zip(ids, starts, strict=True)]

    def _make_policy(self) -> SchedulingPolicy:
        name, options = self.settings.policy, dict(self.settings.policy_options)
        if name == ORACLE_POLICY:
            return make_policy(name, options, tool_duration_s=self.true_tool_duration_s)
        return make_policy(name, options)

    def true_tool_duration_s(self, request_id: str) -> float | None:
        """Seconds of the tool that runs after the agent turn `request_id`; None after a
        job's last turn, for a chat request, or for an id never submitted."""
        return self._tool_durations_s.get(request_id)

    def run(self) -> RunMetrics:
        """Runs every job and session to its end; the figures of the run."""
        core = self.core
        num_steps = 0
        try:
            while self._events or core.has_work():
                self._submit_due_turns()
                if not core.has_work():
                    self.clock.now_s = max(self.clock.now_s, self._events[0].time_s)
                    continue
                if num_steps >= self.settings.max_steps:
                    raise RuntimeError(f"jobs unfinished after {num_steps} steps")
                self._step()
                num_steps += 1
            stats = core.stats()
            pool = core.scheduler.kv_cache_manager.block_pool
            leaked_blocks = pool.num_blocks - pool.num_free_blocks - (
                core.scheduler.pins.num_pinned_blocks
            )
        finally:
            core.shutdown()
        num_jobs = len(self.jobs)
        return summarize_run(self.records[:num_jobs], stats, busy_s=self.executor.busy_s,
                             leaked_blocks=leaked_blocks,
                             chat=self.records[num_jobs:] if self.sessions else None)

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
        self.core.add_request(EngineCoreRequest(
            request_id=request_id, prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=turn.num_output_tokens, ignore_eos=True),
            job=job_info,
        ))
        self._live[request_id] = _LiveTurn(stream, turn_index, prompt, self.clock.now_s)
        self._unstarted.add(request_id)

    def _turn(self, stream: int, turn_index: int) -> tuple[TurnSpec | ChatTurnSpec, JobInfo | None]:
        """The turn's token counts, and its job (None for a chat request)."""
        if stream >= len(self.jobs):
            return self.sessions[stream - len(self.jobs)].turns[turn_index], None
        job = self.jobs[stream]
        turn = job.turns[turn_index]
        return turn, JobInfo(job_id=job.job_id, is_last_step=turn_index == len(job.turns) - 1,
                             tool_name=turn.tool_name)

    def _step(self) -> None:
        core = self.core
        started_s = self.clock.now_s
        outputs = core.step()
        if self.settings.check_invariants:
            core.check_invariants()
        self._note_starts(started_s)
        if self.clock.now_s == started_s:
            self.clock.advance(IDLE_STEP_S)
        for output in outputs:
            live = self._live[output.request_id]
            if live.first_token_s is None and output.new_token_ids:
                live.first_token_s = self.clock.now_s
                live.num_cached_tokens = output.num_cached_tokens
            live.output.extend(output.new_token_ids)
            if output.finish_reason is not None:
                self._finish(output.request_id)

    def _note_starts(self, step_started_s: float) -> None:
        requests = self.core.scheduler.requests
        # A request gone from the scheduler finished within the step that started it.
        started = [rid for rid in self._unstarted
                   if rid not in requests or requests[rid].status != RequestStatus.WAITING]
        for request_id in started:
            self._live[request_id].started_s = step_started_s
            self._unstarted.discard(request_id)

    def _finish(self, request_id: str) -> None:
        live = self._live.pop(request_id)
        self._unstarted.discard(request_id)
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
