"""A discrete-event simulation of agent jobs on the real engine core, on a virtual clock.

The real scheduler, policy, estimator and KV cache run unchanged; the `simulated` executor
prices each step with a roofline profile and advances the virtual clock by that time instead
of sleeping. Jobs arrive at given times; each turn's prompt extends the previous one with its
generated tokens and freshly drawn appended tokens; a finished turn's next turn arrives after
its tool duration. Everything is seeded, so a run is deterministic.
"""

from __future__ import annotations

import heapq
import random
import zlib
from dataclasses import dataclass, field

from engine.config import (
    CacheConfig,
    EngineConfig,
    EstimatorConfig,
    ModelConfig,
    SchedulerConfig,
    TraceConfig,
)
from engine.core.engine_core import EngineCore
from engine.core.wire import EngineCoreRequest
from engine.executor.simulated import SimulatedExecutor
from engine.request import JobInfo, RequestStatus
from engine.sampling_params import SamplingParams
from eval.metrics import JobRecord, RunMetrics, TurnRecord, summarize_run
from eval.workload import AgentJobSpec

# How far the virtual clock moves when a step can schedule nothing (as an idle engine polls).
IDLE_STEP_S = 0.001


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
    """One simulated run: the engine's policy and limits, the cost profile, and the seed of
    the prompts' token ids. `num_kv_blocks=None` sizes the pool from the profile's memory.
    `check_invariants` checks the scheduler after every step (slow; for tests)."""

    policy: str
    profile: str = "h100-llama3.1-8b"
    estimator: str = "eq2-empirical"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    seed: int = 0
    trace_path: str | None = None
    check_invariants: bool = False
    max_steps: int = 5_000_000

    def engine_config(self, max_model_len: int) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model="tiny", max_model_len=max_model_len),
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks),
            scheduler=SchedulerConfig(
                max_model_len=max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs, policy=self.policy,
            ),
            estimator=EstimatorConfig(name=self.estimator),
            trace=TraceConfig(path=self.trace_path),
            executor="simulated",
            sim_profile=self.profile,
        )


@dataclass(order=True)
class _TurnArrival:
    time_s: float
    order: int
    job_index: int = field(compare=False)
    turn_index: int = field(compare=False)


@dataclass
class _LiveTurn:
    job_index: int
    turn_index: int
    prompt: list[int]
    arrival_s: float
    output: list[int] = field(default_factory=list)
    started_s: float | None = None
    first_token_s: float | None = None
    num_cached_tokens: int = 0


class Simulation:
    """Runs `jobs` arriving at `arrivals_s` (parallel lists) through one engine core."""

    def __init__(
        self, jobs: list[AgentJobSpec], arrivals_s: list[float], settings: SimSettings
    ) -> None:
        if len(jobs) != len(arrivals_s) or not jobs:
            raise ValueError("need one arrival time per job, and at least one job")
        self.jobs = jobs
        self.arrivals_s = arrivals_s
        self.settings = settings
        self.clock = VirtualClock()
        config = settings.engine_config(_round_up(max(j.max_seq_len for j in jobs), 16))
        self.executor = SimulatedExecutor(config, sleep=self.clock.advance)
        self.core = EngineCore(config, executor=self.executor, clock=self.clock)
        self._events = [_TurnArrival(t, i, i, 0) for i, t in enumerate(arrivals_s)]
        heapq.heapify(self._events)
        self._num_events = len(self._events)
        self._live: dict[str, _LiveTurn] = {}
        self._unstarted: set[str] = set()
        self._contexts: dict[int, list[int]] = {}
        self._records = [JobRecord(job.job_id, arrival_s) for job, arrival_s
                         in zip(jobs, arrivals_s, strict=True)]

    def run(self) -> RunMetrics:
        """Runs every job to its end; the figures of the run."""
        core = self.core
        num_steps = 0
        try:
            while self._events or core.has_unfinished_requests():
                self._submit_due_turns()
                if not core.has_unfinished_requests():
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
        return summarize_run(self._records, stats, busy_s=self.executor.busy_s,
                             leaked_blocks=leaked_blocks)

    def _submit_due_turns(self) -> None:
        while self._events and self._events[0].time_s <= self.clock.now_s:
            event = heapq.heappop(self._events)
            self._submit(event.job_index, event.turn_index)

    def _submit(self, job_index: int, turn_index: int) -> None:
        job = self.jobs[job_index]
        turn = job.turns[turn_index]
        rng = random.Random(zlib.crc32(f"{self.settings.seed}:{job.job_id}:{turn_index}".encode()))
        vocab_size = self.core.vocab_size
        prompt = self._contexts.pop(job_index, []) + [
            rng.randrange(vocab_size) for _ in range(turn.num_appended_tokens)
        ]
        request_id = f"{job.job_id}#{turn_index}"
        is_last = turn_index == len(job.turns) - 1
        self.core.add_request(EngineCoreRequest(
            request_id=request_id, prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=turn.num_output_tokens, ignore_eos=True),
            job=JobInfo(job_id=job.job_id, is_last_step=is_last, tool_name=turn.tool_name),
        ))
        self._live[request_id] = _LiveTurn(job_index, turn_index, prompt, self.clock.now_s)
        self._unstarted.add(request_id)

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
        job = self.jobs[live.job_index]
        turn = job.turns[live.turn_index]
        record = self._records[live.job_index]
        started_s = now_s if live.started_s is None else live.started_s
        record.turns.append(TurnRecord(
            queue_s=started_s - live.arrival_s,
            ttft_s=(now_s if live.first_token_s is None else live.first_token_s) - live.arrival_s,
            num_prompt_tokens=len(live.prompt), num_cached_tokens=live.num_cached_tokens,
            num_output_tokens=len(live.output),
        ))
        if turn.tool_duration_s is None:
            record.finished_s = now_s
            return
        self._contexts[live.job_index] = live.prompt + live.output
        heapq.heappush(self._events, _TurnArrival(now_s + turn.tool_duration_s, self._num_events,
                                                  live.job_index, live.turn_index + 1))
        self._num_events += 1


def simulate(
    jobs: list[AgentJobSpec], arrivals_s: list[float], settings: SimSettings
) -> RunMetrics:
    """Runs one simulation; see `Simulation`."""
    return Simulation(jobs, arrivals_s, settings).run()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
