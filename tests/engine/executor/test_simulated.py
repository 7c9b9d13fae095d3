"""The simulated executor: step times from the profile (host-tier copies included), tokens
that never end a turn, and the engine core and server running on it."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.engine_core import EngineCore, prefill_profile_lengths
from engine.core.wire import EngineCoreRequest
from engine.engine_args import EngineArgs
from engine.executor.base import make_executor
from engine.executor.roofline import SIM_PROFILES
from engine.executor.simulated import SimulatedExecutor
from engine.kv_cache.transfers import KVTransfers
from engine.sampling_params import SamplingParams
from engine.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
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


def test_engine_args_and_the_executor_check_the_profile() -> None:
    with pytest.raises(ValueError, match="unknown sim profile"):
        EngineArgs(executor="simulated", sim_profile="tpu").to_engine_config(environ={})
    with pytest.raises(ValueError, match="unknown sim profile"):
        make_executor(sim_config(sim_profile="tpu"))
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


H100 = SIM_PROFILES["h100-llama3.1-8b"]
# One 16-token block of Llama-3.1-8B KV (2 MiB) over PCIe Gen5 at 80% of 64 GB/s.
BLOCK_COPY_S = 16 * 128 * 1024 / (64e9 * 0.8)


def step_output(transfers: KVTransfers, prompt_len: int = 0) -> SchedulerOutput:
    """A step prefilling one `prompt_len`-token request (none for 0), with `transfers`."""
    new = [] if prompt_len == 0 else [NewRequestData(
        req_id="r", prompt_token_ids=[3] * prompt_len, output_token_ids=[],
        sampling_params=SamplingParams(max_tokens=1), block_ids=[0], num_computed_tokens=0)]
    return SchedulerOutput(
        step_id=0, scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"r": prompt_len} if prompt_len else {},
        total_num_scheduled_tokens=prompt_len, finished_req_ids=set(), preempted_req_ids=set(),
        kv_transfers=transfers)


def pairs(count: int) -> list[tuple[int, int]]:
    return [(i, i) for i in range(count)]


def test_host_tier_holds_what_the_offload_size_fits() -> None:
    assert SimulatedExecutor(sim_config()).num_host_kv_blocks == 0
    one_gib = sim_config(cache=CacheConfig(num_kv_blocks=128, kv_offload_gib=1.0))
    executor = SimulatedExecutor(one_gib)
    assert executor.kv_bytes_per_block == 16 * H100.model.kv_bytes_per_token == 2 * 2**20
    assert executor.num_host_kv_blocks == 2**30 // (2 * 2**20) == 512
    big_blocks = CacheConfig(num_kv_blocks=128, kv_offload_gib=1.5, block_size=32)
    assert SimulatedExecutor(sim_config(cache=big_blocks)).num_host_kv_blocks == 384
    # The engine core builds its scheduler's host tier to match, and prices reloads with it.
    core = EngineCore(one_gib, executor=executor, clock=FakeClock())
    assert core.scheduler.num_host_kv_blocks == 512 and core.stats().num_host_kv_blocks == 512
    reload = core.scheduler.environment.profile_kv_reload
    assert reload is not None
    assert reload() == executor.profile_kv_reload(prefill_profile_lengths(one_gib.scheduler))
    core.shutdown()
    too_small = CacheConfig(num_kv_blocks=128, kv_offload_gib=0.001)  # under one 2 MiB block
    with pytest.raises(ValueError, match="holds no KV block"):
        SimulatedExecutor(sim_config(cache=too_small))


def test_reload_profile_is_the_link_time_of_the_blocks_that_fit() -> None:
    executor = SimulatedExecutor(sim_config(cache=CacheConfig(num_kv_blocks=128,
                                                              kv_offload_gib=1.0)))
    # 17 tokens take two blocks; 2,048 tokens fill the pool of 128 blocks, 2,064 do not.
    assert executor.profile_kv_reload([16, 17, 2048, 2064, 0]) == [
        (16, pytest.approx(BLOCK_COPY_S)), (17, pytest.approx(2 * BLOCK_COPY_S)),
        (2048, pytest.approx(128 * BLOCK_COPY_S))]
    assert SimulatedExecutor(sim_config()).profile_kv_reload([16]) == []


def test_a_step_of_copies_alone_costs_their_link_time() -> None:
    slept: list[float] = []
    executor = SimulatedExecutor(sim_config(), sleep=slept.append)
    executor.execute(step_output(KVTransfers(urgent_stores=pairs(2), loads=pairs(3),
                                             stores=pairs(4))))
    # Nothing to overlap the lazy stores with: every copy counts, and no step overhead.
    assert slept == [pytest.approx(9 * BLOCK_COPY_S)]
    assert executor.busy_s == executor.kv_copy_s == pytest.approx(9 * BLOCK_COPY_S)
    executor.execute(step_output(KVTransfers()))
    assert slept[-1] == 0.0


def test_loads_delay_the_forward_and_lazy_stores_overlap_it() -> None:
    forward_s = H100.step_time_s([(0, 300)])
    slept: list[float] = []
    executor = SimulatedExecutor(sim_config(), sleep=slept.append)
    output = executor.execute(step_output(KVTransfers(loads=pairs(3), stores=pairs(4)),
                                          prompt_len=300))
    assert forward_s > 4 * BLOCK_COPY_S  # the stores hide behind the forward
    assert slept[-1] == pytest.approx(3 * BLOCK_COPY_S + forward_s)
    assert output.kv_copy_time_s == pytest.approx(3 * BLOCK_COPY_S)  # what held the step up
    output = executor.execute(step_output(KVTransfers(urgent_stores=pairs(1), loads=pairs(2),
                                                      stores=pairs(1000)), prompt_len=300))
    assert forward_s < 1000 * BLOCK_COPY_S  # now the forward hides behind the stores
    assert slept[-1] == pytest.approx(3 * BLOCK_COPY_S + 1000 * BLOCK_COPY_S)
    assert output.kv_copy_time_s == pytest.approx(1003 * BLOCK_COPY_S - forward_s)
    assert executor.kv_copy_s == pytest.approx(1010 * BLOCK_COPY_S)
