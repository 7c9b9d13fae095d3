"""Async scheduling in the engine core, on the tiny model: step N+1 is launched before step
N's tokens are read, and every request gets exactly the tokens it gets with steps in order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import (
    CacheConfig,
    Device,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    TraceConfig,
)
from engine.core.engine_core import EngineCore
from engine.core.wire import EngineCoreRequest
from engine.executor.base import make_executor
from engine.outputs import EngineCoreOutput, ModelRunnerOutput, PendingStep
from engine.sampling_params import SamplingParams
from engine.scheduler.output import SchedulerOutput
from engine.structured_output import grammars
from engine.structured_output.spec import StructuredOutputSpec
from tracing.reader import read_trace
from tracing.records import RequestFinished, StepDecision

EOS = 258  # the tiny model's <|im_end|>


def _config(async_scheduling: bool | None, num_kv_blocks: int, policy: str = "continuum",
            device: Device = "cpu") -> EngineConfig:
    return EngineConfig(
        # float32 on CUDA too: bf16 rounds differently in batches of other shapes, and
        # async scheduling changes which requests share a step.
        model=ModelConfig(max_model_len=128, device=device, dtype="float32"),
        cache=CacheConfig(num_kv_blocks=num_kv_blocks, block_size=8),
        scheduler=SchedulerConfig(max_model_len=128, max_num_seqs=8,
                                  max_num_batched_tokens=48, policy=policy,
                                  async_scheduling=async_scheduling),
        debug_check_invariants=True,
    )


def _requests(stop_token_id: int | None) -> list[EngineCoreRequest]:
    """Requests with most of what sampling can ask for; shared prefixes hit the cache."""
    system = [(7 * k) % 250 + 1 for k in range(20)]
    regex = StructuredOutputSpec(kind="regex", grammar=grammars.regex_grammar(r"[a-f]{3}-[0-9]{2}"))
    variants: list[dict[str, object]] = [
        {"max_tokens": 24, "ignore_eos": True},
        {"max_tokens": 5, "ignore_eos": True},
        {"max_tokens": 30, "temperature": 0.9, "seed": 11, "top_k": 20, "top_p": 0.8},
        {"max_tokens": 16, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"max_tokens": 12, "logprobs": 3, "ignore_eos": True},
        {"max_tokens": 10, "prompt_logprobs": 2},
        {"max_tokens": 40, "temperature": 1.0, "seed": 5, "top_p": 0.9, "ignore_eos": True,
         "stop_token_ids": [] if stop_token_id is None else [stop_token_id]},
        {"max_tokens": 20, "temperature": 0.7, "seed": 3, "structured_output": regex},
        {"max_tokens": 1, "ignore_eos": True},
        {"max_tokens": 18, "min_tokens": 6},
    ]
    requests = []
    for index, params in enumerate(variants * 2):
        params = {"temperature": 0.0, **params}
        prompt = [*system[: 4 + 8 * (index % 3)], *[(index * 13 + k) % 250 + 1 for k in range(6)]]
        requests.append(EngineCoreRequest(
            request_id=f"r{index}", prompt_token_ids=prompt, eos_token_id=EOS,
            sampling_params=SamplingParams(**params)))
    return requests


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, tuple]:
    """Adds the requests a few at a time and steps until idle; each request's tokens,
    logprobs, prompt logprobs and finish reason."""
    outputs: list[EngineCoreOutput] = []
    pending = list(requests)
    for _ in range(2000):
        for request in pending[:8]:
            core.add_request(request)
        pending = pending[8:]
        if not pending and not core.has_work():
            break
        outputs += core.step()
    else:
        raise AssertionError("the core did not go idle")
    results: dict[str, tuple] = {}
    for request in requests:
        own = [output for output in outputs if output.request_id == request.request_id]
        results[request.request_id] = (
            [token for output in own for token in output.new_token_ids],
            [entry.token_id for output in own for entry in output.logprobs or []],
            [entry.token_id for output in own if output.prompt_logprobs
             for entry in output.prompt_logprobs.entries],
            [output.finish_reason for output in own if output.finish_reason is not None],
        )
    stats = core.stats()
    assert stats.num_free_blocks + stats.num_pinned_blocks == stats.num_kv_blocks
    return results


@pytest.mark.parametrize("device", [
    "cpu",
    # The CUDA-only paths: pinned, non-blocking copies of the sampled ids behind an event,
    # decode inputs patched on the device from the step before, CUDA graph replays.
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")),
])
@pytest.mark.parametrize(("num_kv_blocks", "policy"), [(96, "continuum"), (16, "fcfs")],
                         ids=["roomy", "preempting"])
def test_async_scheduling_gives_every_request_the_tokens_of_steps_in_order(
    num_kv_blocks: int, policy: str, device: Device,
) -> None:
    """Greedy, seeded, penalised, logprob, prompt-logprob, stop-token, min-tokens and
    constrained requests, arriving over several steps, with prefix hits; in a pool small
    enough to preempt too. Invariants are checked after every step."""
    sync_core = EngineCore(_config(False, num_kv_blocks, policy, device))
    unstopped = _run(sync_core, _requests(None))["r6"][0]
    stop_index = next(index for index, token in enumerate(unstopped)
                      if index and token not in unstopped[:index])
    in_order = _run(sync_core, _requests(unstopped[stop_index]))  # r6 and r16 stop there
    sync_core.shutdown()
    async_core = EngineCore(_config(True, num_kv_blocks, policy, device))
    pipelined = _run(async_core, _requests(unstopped[stop_index]))
    if num_kv_blocks == 16:
        assert async_core.scheduler.num_preemptions > 0
    async_core.shutdown()
    assert pipelined == in_order
    assert in_order["r6"][0] == unstopped[: stop_index + 1]


def test_a_step_stays_in_flight_between_calls() -> None:
    """With async scheduling the step a call launches is still out when the call returns: the
    first call returns no token (the prefill's is on its way), each later call returns the
    token of the step before, and the last call only takes the step still out."""
    core = EngineCore(_config(True, 32))
    core.add_request(EngineCoreRequest(
        request_id="a", prompt_token_ids=[5, 6, 7], eos_token_id=EOS,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    assert core.step() == []
    assert core.has_work() and core.has_unfinished_requests()
    per_call = []
    while core.has_work():
        per_call.append([token for output in core.step() for token in output.new_token_ids])
    assert [len(tokens) for tokens in per_call] == [1, 1, 1, 0]
    # Every call checked the invariants, the last one (which only took the step out) too.
    assert core.num_invariant_checks == 1 + len(per_call)
    core.shutdown()


@dataclasses.dataclass
class RecordedStep:
    pending: PendingStep
    calls: list[str]

    def result(self) -> ModelRunnerOutput:
        self.calls.append("result")
        return self.pending.result()


class RecordingExecutor:
    """The tiny model's executor, recording when a step's result is taken and when it shuts
    down."""

    def __init__(self, config: EngineConfig) -> None:
        self.inner = make_executor(config)
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        return RecordedStep(self.inner.submit(scheduler_output), self.calls)

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.inner.shutdown()


def test_shutdown_waits_for_the_step_in_flight_before_the_executor_stops() -> None:
    """The device may still be reading the KV caches for the step in flight: its result is
    waited for before the executor frees them."""
    config = _config(True, 32)
    executor = RecordingExecutor(config)
    core = EngineCore(config, executor=executor)
    core.add_request(EngineCoreRequest(
        request_id="a", prompt_token_ids=[5, 6, 7], eos_token_id=EOS,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    core.step()
    assert executor.calls == []
    core.shutdown()
    assert executor.calls == ["result", "shutdown"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-order", "async"])
def test_a_trace_records_each_finish_under_the_step_that_finished_it(
        tmp_path, async_scheduling: bool) -> None:
    """With async scheduling step N+1 is planned before step N's output is applied; a
    request that step N finished is still recorded under step N. Requests capped by
    `max_tokens` are not scheduled past their last token, so the step that finished each is
    the last one that scheduled it."""
    path = tmp_path / "trace.jsonl"
    config = dataclasses.replace(_config(async_scheduling, 96), trace=TraceConfig(path=str(path)))
    core = EngineCore(config)
    requests = [EngineCoreRequest(
        request_id=f"r{index}", prompt_token_ids=[index + 1] * (3 + 5 * index), eos_token_id=EOS,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=2 + 3 * index,
                                       ignore_eos=True)) for index in range(6)]
    _run(core, requests)
    core.shutdown()
    trace = read_trace(path)
    last_scheduled: dict[str, int] = {}
    for decision in trace.of_type(StepDecision):
        for request_id in decision.num_scheduled_tokens:
            last_scheduled[request_id] = decision.step
    finished = {event.request_id: event.step for event in trace.of_type(RequestFinished)}
    assert finished == last_scheduled and len(finished) == len(requests)


def test_async_scheduling_refuses_a_host_tier() -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        dataclasses.replace(_config(True, 32), cache=CacheConfig(kv_offload_gib=0.01))


class AsyncPreferringExecutor(RecordingExecutor):
    """The tiny model's executor, saying (as a CUDA model's does) that async scheduling pays."""

    @property
    def prefers_async_scheduling(self) -> bool:
        return True


@pytest.mark.parametrize(("configured", "prefers", "host_tier", "expected"), [
    (None, False, False, False),  # a model on CPU
    (None, True, False, True),  # a model on CUDA
    (None, True, True, False),  # ... with a host KV tier
    (False, True, False, False),
    (True, False, False, True),
], ids=["default-cpu", "default-cuda", "default-cuda-host-tier", "off", "on"])
def test_the_default_follows_the_executor(configured: bool | None, prefers: bool,
                                          host_tier: bool, expected: bool) -> None:
    """`async_scheduling=None` schedules ahead where the executor prefers it and there is no
    host tier; a given value wins. Ahead, the first call returns no token (it is in flight)."""
    config = _config(configured, 32)
    if host_tier:
        config = dataclasses.replace(config, cache=CacheConfig(
            num_kv_blocks=32, block_size=8, kv_offload_gib=0.01))
    executor = (AsyncPreferringExecutor if prefers else RecordingExecutor)(config)
    core = EngineCore(config, executor=executor)
    core.add_request(EngineCoreRequest(
        request_id="a", prompt_token_ids=[5, 6, 7], eos_token_id=EOS,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    assert core.async_scheduling is expected
    assert (core.step() == []) is expected
    core.shutdown()


def test_the_trace_header_records_the_mode_that_ran(tmp_path) -> None:
    """With the default the header holds the resolved mode, not None."""
    path = tmp_path / "trace.jsonl"
    config = dataclasses.replace(_config(None, 32), trace=TraceConfig(path=str(path)))
    core = EngineCore(config, executor=AsyncPreferringExecutor(config))
    core.shutdown()
    assert read_trace(path).header.config["scheduler"]["async_scheduling"] is True


class ExecutorBeforeTheProperty(RecordingExecutor):
    """A plugin executor written before the protocol had `prefers_async_scheduling`."""

    def __getattr__(self, name: str) -> object:
        if name == "prefers_async_scheduling":
            raise AttributeError(name)
        return super().__getattr__(name)


def test_an_executor_without_the_property_runs_its_steps_in_order() -> None:
    config = _config(None, 32)
    core = EngineCore(config, executor=ExecutorBeforeTheProperty(config))
    assert core.async_scheduling is False
    core.shutdown()
