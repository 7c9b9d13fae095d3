"""`EngineCore` in process, on the tiny model."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from engine.config import EngineConfig
from engine.core.client import EngineDeadError, InprocClient
from engine.core.engine_core import EngineCore
from engine.core.wire import EngineStats
from engine.executor.base import make_executor
from engine.kv_cache.pins import PinReleaseReason
from engine.outputs import ModelRunnerOutput, PendingStep
from engine.request import FinishReason, JobInfo, RequestStatus
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.retention import Retention, RetentionInputs
from estimator.eq2 import Eq2Estimator
from tests.continuum.priced import PRICED_CONTINUUM_PATH
from tests.engine.core.conftest import SMALL_CONFIG, core_request
from tests.engine.helpers import FakeClock


def estimator_of(core: EngineCore):
    """The guarded estimator of the core's Continuum policy."""
    return core.scheduler.policy.strategies.retention.estimator  # type: ignore[attr-defined]


def run_to_completion(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.scheduler.has_unfinished_requests():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        core.check_invariants()
    return tokens


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(SMALL_CONFIG)


def test_steps_generate_until_every_request_finishes(core: EngineCore) -> None:
    core.add_request(core_request("a", max_tokens=5))
    core.add_request(core_request("b", [9, 8, 7], max_tokens=3, logprobs=2))
    outputs = []
    while core.has_work():
        outputs += core.step()
    assert [o.request_id for o in outputs].count("a") == 5
    last_b = [o for o in outputs if o.request_id == "b"][-1]
    assert last_b.finish_reason is FinishReason.LENGTH
    assert len(last_b.logprobs) == 1 and len(last_b.logprobs[0].top_token_ids) == 2
    stats = core.stats()
    assert isinstance(stats, EngineStats)
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert 0 < stats.submit_time_s < stats.execute_time_s <= stats.step_time_s


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ([1, 272], {}, "prompt token ids"),
    ([1] * 300, {}, "max_model_len"),
    ([1], {"n": 2}, "one sequence"),
])
def test_invalid_requests_raise_and_change_nothing(core: EngineCore, prompt, params,
                                                   message: str) -> None:
    request = core_request("bad", prompt, **params)
    with pytest.raises(ValueError, match=message):
        core.add_request(request)
    assert not core.has_work()
    core.check_invariants()


def test_abort_frees_blocks(core: EngineCore) -> None:
    core.add_request(core_request("long", list(range(100)), max_tokens=100))
    core.step()
    assert core.stats().num_free_blocks < core.stats().num_kv_blocks
    core.abort_requests(["long", "unknown"])
    core.check_invariants()
    assert core.stats().num_free_blocks == core.stats().num_kv_blocks
    assert not core.has_work()


def test_utilities(core: EngineCore) -> None:
    assert core.reset_prefix_cache() is True
    assert core.release_job("no-such-job") is False
    with pytest.raises(ValueError, match="job_id"):
        core.release_job("")


class RetainEveryTurn(FCFSPolicy):
    def retention(self, request, now_s):
        if request.job is None or request.status is RequestStatus.FINISHED_ABORTED:
            return None
        return Retention(10.0, RetentionInputs(ttl_s=10.0, source="test"))


def test_release_job_frees_a_pin_and_a_pin_alone_is_no_work_for_a_step() -> None:
    clock = FakeClock()
    core = EngineCore(SMALL_CONFIG, policy=RetainEveryTurn(), clock=clock)
    request = core_request("turn", list(range(40)), max_tokens=4)
    core.add_request(msgspec.structs.replace(request, job=JobInfo(job_id="job")))
    run_to_completion(core)
    assert core.stats().num_pins == 1
    assert not core.has_work()  # a live pin expires through `sweep`, not an empty step
    assert core.release_job("job") is True
    assert core.stats().num_pins == 0 and not core.has_work()
    core.add_request(msgspec.structs.replace(request, request_id="again",
                                             job=JobInfo(job_id="job")))
    run_to_completion(core)
    clock.advance(60.0)  # past the pin's 10 s, whatever the policy
    assert [pin.release_reason for pin in core.sweep().released_pins] == [
        PinReleaseReason.EXPIRED]
    assert core.stats().num_pins == 0


def test_an_idle_core_sweeps_pins_and_idle_jobs_without_a_step(tmp_path) -> None:
    # A profile pricing any rebuild at 4 s: the cold-start TTL is ln 4 = 1.39 s.
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"points": [[0, 4.0], [1000, 4.0]]}))
    config = dataclasses.replace(
        _with_options(prefill_profile=str(profile), job_idle_timeout_s="5"),
        debug_check_invariants=True)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, policy=PRICED_CONTINUUM_PATH))
    clock = FakeClock()
    client = InprocClient(config, clock=clock)
    core = client.core
    request = core_request("turn", list(range(40)), max_tokens=4)
    core.add_request(msgspec.structs.replace(request, job=JobInfo(job_id="job", tool_name="ls")))
    run_to_completion(core)
    num_steps, num_checks = core.num_steps, core.num_invariant_checks
    assert core.job_state("job").pin is not None and core.stats().num_jobs == 1

    clock.advance(1.0)
    assert not core.sweep()  # nothing due: nothing changes, nothing checked
    assert core.num_invariant_checks == num_checks
    clock.advance(1.0)
    sweep = core.sweep()
    assert [pin.job_id for pin in sweep.released_pins] == ["job"] and not sweep.forgotten_job_ids
    assert core.stats().pins_released == {"expired": 1} and core.stats().num_jobs == 1
    clock.advance(4.0)
    assert client.get_output() == []  # the in-process client sweeps when there is no work
    assert core.job_state("job") is None and core.stats().num_jobs == 0
    assert core.num_steps == num_steps  # no step ran
    assert core.num_invariant_checks == num_checks + 2  # after each sweep that did something
    client.shutdown()


def test_inproc_client_runs_steps_on_get_output() -> None:
    client = InprocClient(SMALL_CONFIG)
    client.add_request(core_request("a", max_tokens=2))
    first, second = client.get_output(), client.get_output()
    assert [o.request_id for o in first + second] == ["a", "a"]
    assert client.get_output() == []
    with pytest.raises(ValueError, match="unknown utility"):
        client.call_utility("shutdown")
    client.shutdown()


class _FailingStepExecutor:
    """The tiny model's executor, whose step number `failing_step` (counting from 1) raises
    when its result is taken, as a device error would."""

    def __init__(self, config: EngineConfig, failing_step: int) -> None:
        self.inner = make_executor(config)
        self.failing_step = failing_step
        self.num_submitted = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        self.num_submitted += 1
        pending = self.inner.submit(scheduler_output)
        if self.num_submitted != self.failing_step:
            return pending
        pending.result()
        return _FailedStep()


class _FailedStep:
    def result(self) -> ModelRunnerOutput:
        raise RuntimeError("device lost")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-order", "async"])
def test_a_failed_step_leaves_the_inproc_client_dead(async_scheduling: bool) -> None:
    """A step whose result raises leaves the books half-updated: the in-process client
    raises the error once, then EngineDeadError for every call that would use the core."""
    config = dataclasses.replace(SMALL_CONFIG, scheduler=dataclasses.replace(
        SMALL_CONFIG.scheduler, async_scheduling=async_scheduling))
    client = InprocClient(config, executor=_FailingStepExecutor(config, failing_step=2))
    client.add_request(core_request("a", max_tokens=8))
    client.get_output()
    with pytest.raises(RuntimeError, match="device lost"):
        while True:
            client.get_output()
    for call in (client.get_output, lambda: client.add_request(core_request("b")),
                 lambda: client.call_utility("stats")):
        with pytest.raises(EngineDeadError, match="device lost"):
            call()
    client.abort_requests(["a"])  # nothing to stop: the core no longer runs
    client.shutdown()


def _with_options(**options: str) -> EngineConfig:
    """SMALL_CONFIG with the continuum policy's options."""
    scheduler = dataclasses.replace(SMALL_CONFIG.scheduler, policy="continuum",
                                    policy_options=options)
    return dataclasses.replace(SMALL_CONFIG, scheduler=scheduler)


def test_job_state_includes_the_policys_books_until_the_job_ends() -> None:
    # The release's rule: a tool with no observed duration is pinned for 2 s.
    core = EngineCore(_with_options(estimator="fixed-2s"), clock=FakeClock())
    request = core_request("turn", list(range(40)), max_tokens=4)
    core.add_request(msgspec.structs.replace(request, job=JobInfo(job_id="job", tool_name="ls")))
    run_to_completion(core)
    state = core.job_state("job")
    assert state.pin is not None and state.pin.ttl_s == 2.0
    assert (state.policy["num_turns_finished"], state.policy["num_pins_created"]) == (1, 1)
    assert state.policy["last_tool_name"] == "ls"
    assert core.stats().num_jobs == 1
    assert core.release_job("job") is True
    assert core.job_state("job") is None and core.stats().num_jobs == 0


def test_the_default_estimator_prices_rebuilds_from_a_prefill_profile_measured_at_start() -> None:
    core = EngineCore(SMALL_CONFIG, clock=FakeClock())  # continuum, Eq. 2, profile "auto"
    estimator = estimator_of(core).inner
    assert isinstance(estimator, Eq2Estimator) and estimator.prefill_cost is not None
    assert estimator.rebuild_s(512) > estimator.rebuild_s(16) > 0
    # On this tiny model a rebuild costs milliseconds: the cold-start rule does not pin.
    request = core_request("turn", list(range(40)), max_tokens=4)
    core.add_request(msgspec.structs.replace(request, job=JobInfo(job_id="job",
                                                                  tool_name="ls")))
    run_to_completion(core)
    assert core.job_state("job").pin is None and core.stats().num_pins == 0


def test_estimator_state_is_saved_at_shutdown_and_loaded_at_start(tmp_path) -> None:
    state_path = tmp_path / "estimator.json"
    config = _with_options(estimator_state=str(state_path))
    core = EngineCore(config, clock=FakeClock())
    estimator_of(core).observe_queueing_delay(3.0)
    core.shutdown()
    restarted = EngineCore(config, clock=FakeClock())
    assert estimator_of(restarted).inner.queueing_delay.mean == 3.0
    state_path.write_text('{"format": "continuum-estimator-state", "version": 1, "broken')
    cold = EngineCore(config, clock=FakeClock())  # its own file, corrupt: a cold start
    assert estimator_of(cold).inner.queueing_delay.mean is None
    state_path.write_text("{not json")
    with pytest.raises(ValueError, match="estimator_state"):  # not its file: kept, refused
        EngineCore(config, clock=FakeClock())
    assert state_path.read_text() == "{not json"


def test_a_hostile_estimator_state_starts_cold_and_the_core_serves(tmp_path) -> None:
    path = tmp_path / "estimator.json"
    huge = [1.7e308] * 4  # finite values whose sum overflows
    path.write_text(json.dumps({
        "version": 1, "cold_start_samples": 100, "pooled_s": huge, "tools_s": {"ls": huge},
        "queueing_delays_s": huge, "job_num_turns": [3], "prefill_cost": None, "records": []}))
    core = EngineCore(_with_options(estimator_state=str(path)), clock=FakeClock())
    assert estimator_of(core).inner.queueing_delay.mean is None  # cold
    for index in range(2):
        request = core_request(f"turn{index}", list(range(40)), max_tokens=4)
        core.add_request(msgspec.structs.replace(
            request, job=JobInfo(job_id="job", tool_name="ls", is_last_step=index == 1)))
        outputs = run_to_completion(core)
        assert len(outputs[f"turn{index}"]) == 4
    assert core.stats().num_pins == 0 and core.stats().num_jobs == 0


@pytest.mark.parametrize("options, message", [
    ({"estimator": "psychic"}, "option estimator .*expected one of"),
    ({"max_wait": "3"}, "unknown option 'max_wait'"),
    ({"pin_cost": "ttl"}, "unknown option 'pin_cost'"),
])
def test_a_bad_policy_option_fails_at_start(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineCore(_with_options(**options), clock=FakeClock())


def test_prefills_are_profiled_once_and_never_after_serving_starts() -> None:
    core = EngineCore(SMALL_CONFIG, clock=FakeClock())
    profile = core.scheduler.environment.profile_prefill
    first = profile()
    assert [n for n, _ in first] == [16, 64, 256] and all(s > 0 for _, s in first)
    assert profile() == first  # measured once
    fresh = EngineCore(SMALL_CONFIG, policy=FCFSPolicy(), clock=FakeClock())
    fresh.add_request(core_request("a", max_tokens=1))
    run_to_completion(fresh)
    with pytest.raises(RuntimeError, match="before serving"):
        fresh.scheduler.environment.profile_prefill()


def test_debug_check_invariants_checks_after_every_step() -> None:
    config = dataclasses.replace(SMALL_CONFIG, debug_check_invariants=True)
    core = EngineCore(config)
    core.add_request(core_request("a", max_tokens=4))
    num_steps = 0
    while core.has_work():
        core.step()
        num_steps += 1
    assert core.stats().num_invariant_checks == num_steps == core.num_steps
    core.add_request(core_request("b", max_tokens=4))
    core.scheduler.kv_cache_manager.block_pool.blocks[-1].ref_cnt += 1  # corrupt the books
    with pytest.raises(AssertionError):
        core.step()
