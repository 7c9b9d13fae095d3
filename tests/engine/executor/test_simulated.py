"""The simulated executor: step times from the profile, tokens that never end a turn, and
the engine core and server running on it."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.wire import EngineCoreRequest
from engine.engine_args import EngineArgs
from engine.executor.base import make_executor
from engine.executor.roofline import SIM_PROFILES
from engine.executor.simulated import SimulatedExecutor
from engine.sampling_params import SamplingParams
from tests.engine.helpers import FakeClock


def sim_config(**overrides: object) -> EngineConfig:
    settings = {"executor": "simulated", "sim_profile": "h100-llama3.1-8b",
                "scheduler": SchedulerConfig(max_model_len=1024, max_num_batched_tokens=512),
                "cache": CacheConfig(num_kv_blocks=128), **overrides}
    return EngineConfig(**settings)


def test_registry_builds_it_and_the_pool_comes_from_the_profile() -> None:
    executor = make_executor(sim_config(cache=CacheConfig()))
    assert isinstance(executor, SimulatedExecutor)
    assert executor.num_kv_blocks == SIM_PROFILES["h100-llama3.1-8b"].num_kv_tokens // 16
    assert executor.vocab_size == 272  # the tiny model's tokenizer serves text
    assert make_executor(sim_config()).num_kv_blocks == 128


def test_config_checks_the_profile() -> None:
    with pytest.raises(ValueError, match="unknown sim profile"):
        sim_config(sim_profile="tpu")
    with pytest.raises(ValueError, match="only to the simulated executor"):
        EngineConfig(sim_profile="h100-llama3.1-8b")
    config = EngineArgs(executor="simulated", sim_profile="a100-llama3.1-8b",
                        max_model_len=512).to_engine_config(environ={})
    assert config.sim_profile == "a100-llama3.1-8b"


def test_core_runs_in_virtual_time_with_the_profile_step_times() -> None:
    clock = FakeClock()
    config = sim_config()
    executor = SimulatedExecutor(config, sleep=clock.advance)
    core = EngineCore(config, executor=executor, clock=clock)
    core.add_request(EngineCoreRequest(
        request_id="r", prompt_token_ids=[7] * 300, eos_token_id=300 % 272,
        sampling_params=SamplingParams(max_tokens=5),
    ))
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
        core.check_invariants()
    profile = SIM_PROFILES["h100-llama3.1-8b"]
    # One prefill step, then four decode steps over a growing context.
    expected_s = profile.step_time_s([(0, 300)]) + sum(
        profile.step_time_s([(300 + i, 1)]) for i in range(4)
    )
    assert clock() == pytest.approx(expected_s)
    assert executor.busy_s == pytest.approx(expected_s)
    tokens = [t for output in outputs for t in output.new_token_ids]
    assert len(tokens) == 5 and 300 % 272 not in tokens
    assert outputs[-1].finish_reason is not None
    core.shutdown()


def test_partial_prefill_samples_nothing_and_eos_is_skipped() -> None:
    clock = FakeClock()
    config = sim_config()
    executor = SimulatedExecutor(config, sleep=clock.advance)
    core = EngineCore(config, executor=executor, clock=clock)
    # 700 prompt tokens take two steps at a 512-token budget; token 700 % 272 is skipped as EOS.
    core.add_request(EngineCoreRequest(
        request_id="r", prompt_token_ids=[5] * 700, eos_token_id=700 % 272,
        sampling_params=SamplingParams(max_tokens=2),
    ))
    assert core.step() == []
    first = core.step()
    assert first[0].new_token_ids == [700 % 272 + 1]
    core.shutdown()


def test_prefill_profile_matches_the_cost_model() -> None:
    executor = SimulatedExecutor(sim_config())
    profile = SIM_PROFILES["h100-llama3.1-8b"]
    assert executor.profile_prefill([16, 4096]) == [
        (16, profile.prefill_time_s(16)), (4096, profile.prefill_time_s(4096))
    ]
