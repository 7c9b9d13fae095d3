"""Agent jobs replayed through a real scheduler with a fake runner on a fake clock.

A job's turns arrive one after another: turn k+1 arrives `tool_s` after turn k finished,
with the previous prompt, the generated tokens and `appended_tokens` new ones as its prompt.
Outputs have exactly `output_tokens` tokens. A step lasts `step_s(num_scheduled_tokens)`.
"""

from __future__ import annotations

import heapq
import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.outputs import EngineCoreOutput
from engine.request import JobInfo, Request
from engine.sampling_params import SamplingParams
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.policy import PolicyEnvironment, SchedulingPolicy
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tracer import SchedulerTracer
from tests.engine.helpers import FakeClock, FakeRunner, make_scheduler, run_step

TEST_DATA = Path(__file__).resolve().parents[1] / "data"
SYSTEM_PROMPT = list(range(1, 9))  # shared by every job's first turn


@dataclass(frozen=True)
class Turn:
    appended_tokens: int
    output_tokens: int
    tool_s: float | None  # None for the last turn
    tool_name: str | None = None


@dataclass(frozen=True)
class AgentJob:
    job_id: str
    arrival_s: float
    turns: tuple[Turn, ...]

    @property
    def num_tokens(self) -> int:
        return len(SYSTEM_PROMPT) + sum(t.appended_tokens + t.output_tokens for t in self.turns)


def load_trace_jobs(
    path: Path, *, num_jobs: int, max_turns: int, token_scale: float, arrival_gap_s: float
) -> list[AgentJob]:
    """The first `num_jobs` jobs of a trace in the agent-job format, truncated to `max_turns`
    turns, token counts scaled by `token_scale`, arriving `arrival_gap_s` apart."""
    jobs = []
    with open(path) as trace:
        for index, line in zip(range(num_jobs), trace, strict=False):
            record = json.loads(line)
            turns = record["turns"][:max_turns]
            jobs.append(AgentJob(
                job_id=record["job_id"],
                arrival_s=index * arrival_gap_s,
                turns=tuple(
                    Turn(
                        appended_tokens=max(1, round(turn["appended_tokens"] * token_scale)),
                        output_tokens=max(1, round(turn["output_tokens"] * token_scale)),
                        tool_s=None if k == len(turns) - 1 else turn["tool_duration_s"] or 0.0,
                        tool_name=turn.get("tool_name"),
                    )
                    for k, turn in enumerate(turns)
                ),
            ))
    return jobs


@dataclass
class ReplayResult:
    num_steps: int = 0
    prompt_tokens_computed: int = 0
    new_prompt_tokens: int = 0
    num_preemptions: int = 0
    recomputed_tokens: int = 0  # the scheduler's: computed again after preemption
    job_completion_s: dict[str, float] = field(default_factory=dict)
    num_pins_created: int = 0
    pins_released: dict[str, int] = field(default_factory=dict)
    steps: list[tuple] = field(default_factory=list)

    @property
    def recomputed_prompt_tokens(self) -> int:
        """Prompt tokens computed again although an earlier turn (or run) computed them."""
        return self.prompt_tokens_computed - self.new_prompt_tokens


@dataclass
class _Live:
    job_index: int
    turn_index: int
    request: Request


def replay(
    jobs: list[AgentJob],
    policy: SchedulingPolicy,
    *,
    num_blocks: int,
    block_size: int = 4,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 64,
    step_s: Callable[[int], float] = lambda num_tokens: 0.01 + 2e-5 * num_tokens,
    seed: int = 0,
    max_steps: int = 100_000,
    tracer: SchedulerTracer | None = None,
    num_host_kv_blocks: int = 0,
    environment: PolicyEnvironment | None = None,
    after_schedule: Callable[[Scheduler, SchedulerOutput], None] | None = None,
) -> ReplayResult:
    """Runs every job to completion, checking the scheduler's invariants after each step;
    fails if that takes more than `max_steps` steps. Every step's decisions and outputs are
    kept in `ReplayResult.steps`. `num_host_kv_blocks` > 0 gives the scheduler a host KV
    tier; `environment` is what the policy is offered; `after_schedule` is called with the
    scheduler and each step's plan before the step runs."""
    max_model_len = max(job.num_tokens for job in jobs)
    clock = FakeClock()
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        policy=policy, clock=clock, tracer=tracer, environment=environment,
        num_host_blocks=num_host_kv_blocks,
    )
    runner = FakeRunner(block_size, sample=_sample)
    rng = random.Random(seed)
    result = ReplayResult()
    arrivals: list[tuple[float, int, int, list[int]]] = [
        (job.arrival_s, index, 0, []) for index, job in enumerate(jobs)
    ]
    heapq.heapify(arrivals)
    live: dict[str, _Live] = {}
    while arrivals or scheduler.has_unfinished_requests():
        if result.num_steps >= max_steps:
            raise AssertionError(f"jobs unfinished after {max_steps} steps")
        while arrivals and arrivals[0][0] <= clock():
            _, index, turn_index, context = heapq.heappop(arrivals)
            request = _turn_request(jobs[index], turn_index, context, rng, result)
            live[request.request_id] = _Live(index, turn_index, request)
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests():
            clock.now_s = arrivals[0][0]
            continue
        output, outputs = run_step(scheduler, runner, after_schedule=after_schedule)
        result.steps.append(step_decisions(output, outputs))
        result.num_steps += 1
        result.prompt_tokens_computed += _prompt_tokens_scheduled(output, live)
        clock.advance(step_s(output.total_num_scheduled_tokens))
        for finished in (o for o in outputs if o.finish_reason is not None):
            state = live.pop(finished.request_id)
            job = jobs[state.job_index]
            tool_s = job.turns[state.turn_index].tool_s
            if tool_s is None:
                result.job_completion_s[job.job_id] = clock() - job.arrival_s
            else:
                heapq.heappush(arrivals, (clock() + tool_s, state.job_index,
                                          state.turn_index + 1, state.request.all_token_ids))
    scheduler.close_subscribers()
    result.num_preemptions = scheduler.num_preemptions
    result.recomputed_tokens = scheduler.recomputed_tokens
    result.num_pins_created = scheduler.pins.num_created
    result.pins_released = {r.value: n for r, n in scheduler.pins.num_released.items()}
    assert len(scheduler.pins) == 0, "pins outlived their jobs"
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    return result


def _sample(request_id: str, position: int) -> int:
    return 100 + zlib.crc32(f"{request_id}:{position}".encode()) % 30_000


def _turn_request(
    job: AgentJob, turn_index: int, context: list[int], rng: random.Random,
    result: ReplayResult,
) -> Request:
    turn = job.turns[turn_index]
    appended = [rng.randrange(100, 30_100) for _ in range(turn.appended_tokens)]
    prompt = (context or SYSTEM_PROMPT) + appended
    # The previous turn's last token was sampled but its KV never computed.
    result.new_prompt_tokens += turn.appended_tokens + (1 if context else len(SYSTEM_PROMPT))
    return Request(
        f"{job.job_id}#{turn_index}", prompt,
        SamplingParams(max_tokens=turn.output_tokens, ignore_eos=True),
        arrival_time_s=0.0,
        job=JobInfo(job_id=job.job_id, is_last_step=turn.tool_s is None,
                    tool_name=turn.tool_name),
    )


def _prompt_tokens_scheduled(output: SchedulerOutput, live: dict[str, _Live]) -> int:
    computed_before = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    computed_before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    total = 0
    for req_id, num_tokens in output.num_scheduled_tokens.items():
        start = computed_before[req_id]
        num_prompt_tokens = live[req_id].request.num_prompt_tokens
        total += max(0, min(start + num_tokens, num_prompt_tokens) - start)
    return total


def step_decisions(output: SchedulerOutput, outputs: list[EngineCoreOutput]) -> tuple:
    """What a step decided and produced, comparable across runs."""
    return (
        [new.req_id for new in output.scheduled_new_reqs],
        dict(output.num_scheduled_tokens),
        sorted(output.preempted_req_ids),
        [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs],
    )
