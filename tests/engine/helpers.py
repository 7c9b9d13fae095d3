"""Fast, exact fixtures for scheduler and KV cache tests: a fake clock and a fake runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import EngineCoreOutput, ModelRunnerOutput
from engine.request import JobInfo, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.policy import PolicyEnvironment, SchedulingPolicy
from engine.scheduler.retention import Retention, RetentionInputs
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tracer import SchedulerTracer


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int | None = 16,
    arrival_time_s: float = 0.0,
    eos_token_id: int | None = None,
    priority: int = 0,
    job_id: str | None = None,
    is_last_step: bool = False,
    tool_name: str | None = None,
    tenant: str | None = None,
    **sampling: object,
) -> Request:
    job = None if job_id is None else JobInfo(
        job_id=job_id, is_last_step=is_last_step, tool_name=tool_name
    )
    return Request(
        request_id,
        prompt_token_ids,
        SamplingParams(max_tokens=max_tokens, **sampling),
        arrival_time_s=arrival_time_s,
        eos_token_id=eos_token_id,
        priority=priority,
        job=job,
        tenant=tenant,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    long_prefill_token_threshold: int | None = None,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    policy: SchedulingPolicy | None = None,
    clock: FakeClock | None = None,
    environment: PolicyEnvironment | None = None,
    tracer: SchedulerTracer | None = None,
    job_inference: bool = SchedulerConfig.job_inference,
    job_inference_max_turns: int = SchedulerConfig.job_inference_max_turns,
    job_inference_max_age_s: float = SchedulerConfig.job_inference_max_age_s,
    num_host_blocks: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=enable_chunked_prefill,
            job_inference=job_inference,
            job_inference_max_turns=job_inference_max_turns,
            job_inference_max_age_s=job_inference_max_age_s,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        policy if policy is not None else FCFSPolicy(),
        num_kv_blocks=num_blocks,
        num_host_kv_blocks=num_host_blocks,
        clock=clock if clock is not None else FakeClock(),
        environment=environment,
        tracer=tracer,
    )


@dataclass
class _RunnerState:
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int] = field(default_factory=list)


class FakeRunner:
    """Plays the model runner's side of the protocol, without a model.

    Keeps per-request state only from what `SchedulerOutput` sends (new requests in full,
    continuing ones as deltas) and asserts it agrees with the scheduler, so tests also check
    that the output carries everything a real runner needs. It also keeps a fake KV cache (the
    token written to each slot) and asserts that every prefix hit reads back exactly the
    tokens of the request: a hit on a block whose KV was never computed fails loudly. It
    carries out the host-tier copies (`kv_transfers`) on a fake host cache in the order the
    runner contract gives (urgent stores, loads, the forward, then the lazy stores, which
    therefore see any write the step made to their source: a wrong order or a lazy store of a
    block the step rewrites shows up as a stale hit later).
    Samples `sample(req_id, position)` (default: token 1) for every request whose known tokens
    are all computed after the step.
    """

    def __init__(
        self, block_size: int, sample: Callable[[str, int], int] | None = None
    ) -> None:
        self.block_size = block_size
        self.sample = sample or (lambda req_id, position: 1)
        self.states: dict[str, _RunnerState] = {}
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id
        self.host_kv: dict[tuple[int, int], int | None] = {}  # (host block id, slot) -> token
        self.num_copied_blocks = 0

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids | output.preempted_req_ids:
            self.states.pop(req_id, None)
        new_states = {}
        for new in output.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent in full twice"
            new_states[new.req_id] = _RunnerState(
                new.prompt_token_ids + new.output_token_ids,
                new.num_computed_tokens,
                list(new.block_ids),
            )
        self.states.update(new_states)
        cached = output.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.states[req_id]
            assert state.num_computed_tokens == num_computed, f"{req_id} computed count drifted"
            state.block_ids.extend(block_ids)
        transfers = output.kv_transfers
        self._store(transfers.urgent_stores)
        self._load(transfers.loads)
        # Like a real forward pass, each layer writes the whole step's new KV before attention
        # reads it, so a hit may rely on KV that another request computes in this same step.
        self._write_kv(output.num_scheduled_tokens)
        for req_id, state in new_states.items():
            self._check_prefix_hit(req_id, state)
        self._store(transfers.stores)
        return self._sample(output.num_scheduled_tokens)

    def _store(self, pairs: list[tuple[int, int]]) -> None:
        for block_id, host_block_id in pairs:
            for slot in range(self.block_size):
                self.host_kv[host_block_id, slot] = self.kv.get((block_id, slot))
        self.num_copied_blocks += len(pairs)

    def _load(self, pairs: list[tuple[int, int]]) -> None:
        for host_block_id, block_id in pairs:
            for slot in range(self.block_size):
                token_id = self.host_kv.get((host_block_id, slot))
                assert token_id is not None, f"host block {host_block_id} holds unwritten KV"
                self.kv[block_id, slot] = token_id
        self.num_copied_blocks += len(pairs)

    def _slot(self, state: _RunnerState, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size

    def _write_kv(self, num_scheduled_tokens: dict[str, int]) -> None:
        for req_id, num_tokens in num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed_tokens + num_tokens
            assert end <= len(state.token_ids), f"{req_id} overran its tokens"
            assert len(state.block_ids) * self.block_size >= end, f"{req_id} overran its blocks"
            for position in range(state.num_computed_tokens, end):
                self.kv[self._slot(state, position)] = state.token_ids[position]

    def _check_prefix_hit(self, req_id: str, state: _RunnerState) -> None:
        for position in range(state.num_computed_tokens):
            cached = self.kv.get(self._slot(state, position))
            assert cached == state.token_ids[position], (
                f"{req_id} hit stale KV at position {position}: {cached} != "
                f"{state.token_ids[position]}"
            )

    def _sample(self, num_scheduled_tokens: dict[str, int]) -> ModelRunnerOutput:
        req_ids, sampled = [], []
        for req_id, num_tokens in num_scheduled_tokens.items():
            state = self.states[req_id]
            state.num_computed_tokens += num_tokens
            tokens: list[int] = []
            if state.num_computed_tokens == len(state.token_ids):
                token_id = self.sample(req_id, len(state.token_ids))
                state.token_ids.append(token_id)
                tokens.append(token_id)
            req_ids.append(req_id)
            sampled.append(tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run_step(
    scheduler: Scheduler, runner: FakeRunner, *,
    after_schedule: Callable[[Scheduler, SchedulerOutput], None] | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step against the fake runner, with the invariants checked afterwards;
    `after_schedule` sees the scheduler and the plan before the runner executes it."""
    output = scheduler.schedule()
    if after_schedule is not None:
        after_schedule(scheduler, output)
    outputs = scheduler.update_from_output(output, runner.execute(output))
    scheduler.check_invariants()
    return output, outputs


class PipelinedSteps:
    """Steps a scheduler as the engine core does with async scheduling: step N+1 is
    scheduled and run before the scheduler is updated from step N. The fake runner runs a
    step at once (as a device would, in launch order); its output waits in `in_flight`."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def step(self) -> list[EngineCoreOutput]:
        """Schedules and runs the next step, then updates from the one before it (if any);
        the invariants are checked afterwards."""
        output = self.scheduler.schedule()
        runner_output = self.runner.execute(output)
        outputs = self.finish()
        self.in_flight = (output, runner_output)
        self.scheduler.check_invariants()
        return outputs

    def finish(self) -> list[EngineCoreOutput]:
        """Updates the scheduler from the step in flight, if any."""
        if self.in_flight is None:
            return []
        output, runner_output = self.in_flight
        self.in_flight = None
        return self.scheduler.update_from_output(output, runner_output)

    def run_until_done(self, max_steps: int = 1000) -> list[EngineCoreOutput]:
        """Steps until no request is left and no step is in flight; returns every output."""
        outputs = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                outputs += self.finish()
                self.scheduler.check_invariants()
                return outputs
            outputs += self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> int:
    """Steps until no request is left; returns the number of steps taken."""
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return step
        run_step(scheduler, runner)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def run_control_operation(scheduler: Scheduler, runner: FakeRunner, clock: FakeClock,
                          op: tuple, *, step_s: float) -> None:
    """One operation of the random-workload property tests that adds no request:
    `("abort", n)` aborts request `rn`; `("abort_mid_step", n)` aborts it after a step was
    planned and before it ran (invariants checked with the step's copies in flight);
    `("release", j)` ends job `jobj`; `("step", k)` runs k steps of `step_s` seconds."""
    kind, value = op
    if kind == "abort":
        scheduler.finish_requests([f"r{value}"])
    elif kind == "abort_mid_step":
        output = scheduler.schedule()
        scheduler.check_invariants()
        scheduler.finish_requests([f"r{value}"])
        scheduler.check_invariants()
        scheduler.update_from_output(output, runner.execute(output))
    elif kind == "release":
        scheduler.end_job(f"job{value}")
    else:
        for _ in range(value):
            run_step(scheduler, runner)
            clock.advance(step_s)
    scheduler.check_invariants()


def assert_everything_released(scheduler: Scheduler, runner: FakeRunner,
                               job_ids: list[str]) -> None:
    """Ends the jobs, runs one step (it carries the stores their ends queued) and asserts
    that no device block, host block or pin is held any more."""
    for job_id in job_ids:
        scheduler.end_job(job_id)
    run_step(scheduler, runner)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert len(scheduler.pins) == 0
    host_tier = scheduler.kv_cache_manager.host_tier
    if host_tier is not None:
        assert all(host_block.ref_cnt == 0 for host_block in host_tier.blocks)


class PinningPolicy(FCFSPolicy):
    """Test policy: retains every finished turn of a job for `ttl_s`; under pressure it
    releases the oldest pin before preempting anyone."""

    def __init__(self, ttl_s: float = 10.0) -> None:
        self.ttl_s = ttl_s

    def retention(self, request: Request, now_s: float) -> Retention | None:
        if request.job is None or request.status is RequestStatus.FINISHED_ABORTED:
            return None
        return Retention(self.ttl_s, RetentionInputs(ttl_s=self.ttl_s, source="test"))

    def select_victim(self, request: Request, now_s: float):
        pins = list(self.scheduler.pins)
        if pins and request.status is RequestStatus.RUNNING:
            return pins[0]
        return super().select_victim(request, now_s)
