"""The host KV tier's tensors and copies in the model runner (CPU, real tensors), and an engine
whose second turn of a job reloads its prefix from the host tier."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.wire import EngineCoreRequest
from engine.executor.base import KVReloadProfiler
from engine.executor.torch_executor import TorchExecutor
from engine.kv_cache.transfers import KVTransfers
from engine.model.directory import load_arch
from engine.sampling_params import SamplingParams
from engine.scheduler.output import CachedRequestData, SchedulerOutput
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.scheduler import Scheduler
from engine.worker.host_kv_cache import token_rows
from engine.worker.kv_cache_sizing import (
    determine_num_host_kv_blocks,
    determine_num_kv_blocks,
    kv_block_bytes,
)
from engine.worker.model_runner import ModelRunner
from tests.engine.helpers import FakeClock
from tests.engine.worker.test_model_runner import BLOCK_SIZE, prompt, request

CPU = torch.device("cpu")
HOST_GIB = 2**-10  # 1 MiB: 128 host blocks of 4 tokens of the tiny model in float32


def make_runner(num_kv_blocks: int = 32, kv_offload_gib: float = HOST_GIB) -> ModelRunner:
    """A runner on the CPU in float32, whatever the machine has: `HOST_GIB` and the block
    copies below assume both."""
    return ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                          kv_offload_gib=kv_offload_gib),
        scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8),
    ))


def copies_only(step_id: int, transfers: KVTransfers) -> SchedulerOutput:
    """A step that schedules no token and carries only host-tier copies."""
    return SchedulerOutput(
        step_id=step_id, scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, finished_req_ids=set(),
        preempted_req_ids=set(), kv_transfers=transfers,
    )


def blocks_of(caches: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    rows = token_rows(block_ids, BLOCK_SIZE, CPU)
    return [cache[:, rows].clone() for cache in caches]


def assert_blocks_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for actual_layer, expected_layer in zip(actual, expected, strict=True):
        assert torch.equal(actual_layer, expected_layer)


def prefill_blocks(runner: ModelRunner, num_tokens: int) -> list[int]:
    """Runs a real prefill (and one sampled token) of a random prompt; the device blocks that
    hold its KV, in order."""
    scheduler = Scheduler(runner.config.scheduler, runner.config.cache, FCFSPolicy(),
                          num_kv_blocks=runner.num_kv_blocks, clock=FakeClock())
    scheduler.add_request(request("r", prompt(num_tokens, 3), max_tokens=1))
    scheduler_output = scheduler.schedule()
    block_ids = scheduler.kv_cache_manager.get_block_ids("r")
    runner_output = runner.execute_model(scheduler_output)
    assert runner_output.sampled_token_ids == [[runner_output.sampled_token_ids[0][0]]]
    return block_ids


def test_host_tier_is_sized_from_its_own_budget() -> None:
    arch = load_arch("tiny")
    block_bytes = kv_block_bytes(arch, 16, torch.float32)
    config = CacheConfig(cpu_kv_cache_space_gib=0.01, kv_offload_gib=0.25)
    assert determine_num_host_kv_blocks(config, arch, torch.float32) == 2**30 // 4 // block_bytes
    # The tier is memory of its own: the CPU pool keeps its whole budget.
    without_tier = CacheConfig(cpu_kv_cache_space_gib=0.01)
    assert (determine_num_kv_blocks(config, arch, torch.float32, CPU, 256)
            == determine_num_kv_blocks(without_tier, arch, torch.float32, CPU, 256))
    assert determine_num_host_kv_blocks(without_tier, arch, torch.float32) == 0
    with pytest.raises(ValueError, match="kv_offload_gib"):
        determine_num_host_kv_blocks(CacheConfig(kv_offload_gib=1e-9), arch, torch.float32)


def test_runner_allocates_host_caches_laid_out_like_the_pool() -> None:
    runner = make_runner()
    assert runner.num_host_kv_blocks == 128
    host = runner.host_kv_cache
    assert host is not None and len(host.caches) == len(runner.kv_caches)
    for host_cache, device_cache in zip(host.caches, runner.kv_caches, strict=True):
        assert host_cache.shape == (2, 128 * BLOCK_SIZE, *device_cache.shape[2:])
        assert host_cache.dtype == device_cache.dtype and host_cache.device == CPU
        assert host_cache.data_ptr() != device_cache.data_ptr()
    assert make_runner(kv_offload_gib=0).host_kv_cache is None


def test_prefilled_kv_survives_a_store_and_a_load_into_other_blocks() -> None:
    runner = make_runner()
    device_ids = prefill_blocks(runner, 12)
    assert len(device_ids) == 3
    prefilled = blocks_of(runner.kv_caches, device_ids)
    assert all(layer.abs().sum() > 0 for layer in prefilled)
    host_ids = [7, 2, 40]
    stores = list(zip(device_ids, host_ids, strict=True))
    runner.execute_model(copies_only(1, KVTransfers(stores=stores)))
    assert_blocks_equal(blocks_of(runner.host_kv_cache.caches, host_ids), prefilled)

    for cache in runner.kv_caches:
        cache.zero_()
    other_ids = [20, 9, 31]
    assert not set(other_ids) & set(device_ids)
    loads = list(zip(host_ids, other_ids, strict=True))
    runner.execute_model(copies_only(2, KVTransfers(loads=loads)))
    assert_blocks_equal(blocks_of(runner.kv_caches, other_ids), prefilled)
    untouched = [block_id for block_id in range(runner.num_kv_blocks)
                 if block_id not in other_ids]
    assert all(layer.abs().sum() == 0 for layer in blocks_of(runner.kv_caches, untouched))


def test_urgent_stores_run_before_the_loads_that_reuse_their_blocks() -> None:
    runner = make_runner()
    host = runner.host_kv_cache
    generator = torch.Generator().manual_seed(0)
    for cache in [*runner.kv_caches, *host.caches]:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    device_before = blocks_of(runner.kv_caches, [3, 5])
    block_5_before = blocks_of(runner.kv_caches, [5])
    host_before = blocks_of(host.caches, [11])
    transfers = KVTransfers(
        # Device block 3 is stored before a load overwrites it; host block 12 is written
        # before a load reads it.
        urgent_stores=[(3, 10), (5, 12)],
        loads=[(11, 3), (12, 6)],
    )
    runner.execute_model(copies_only(1, transfers))
    assert_blocks_equal(blocks_of(host.caches, [10, 12]), device_before)
    assert_blocks_equal(blocks_of(runner.kv_caches, [3]), host_before)
    assert_blocks_equal(blocks_of(runner.kv_caches, [6]), block_5_before)
    assert_blocks_equal(blocks_of(runner.kv_caches, [5]), block_5_before)


def test_lazy_stores_complete_with_a_step_that_runs_the_model() -> None:
    runner = make_runner()
    rows = token_rows([30], BLOCK_SIZE, CPU)
    generator = torch.Generator().manual_seed(1)
    for cache in runner.kv_caches:
        cache[:, rows] = torch.randn(cache[:, rows].shape, generator=generator)
    stored = blocks_of(runner.kv_caches, [30])
    scheduler = Scheduler(runner.config.scheduler, runner.config.cache, FCFSPolicy(),
                          num_kv_blocks=runner.num_kv_blocks, clock=FakeClock())
    scheduler.add_request(request("s", prompt(5, 4), max_tokens=1))
    step = scheduler.schedule()
    assert 30 not in scheduler.kv_cache_manager.get_block_ids("s")
    step = msgspec.structs.replace(step, kv_transfers=KVTransfers(stores=[(30, 0)]))
    output = runner.execute_model(step)
    assert output.req_ids == ["s"] and len(output.sampled_token_ids[0]) == 1
    assert_blocks_equal(blocks_of(runner.host_kv_cache.caches, [0]), stored)


def test_a_runner_without_a_tier_refuses_copies() -> None:
    runner = make_runner(kv_offload_gib=0)
    with pytest.raises(RuntimeError, match="no host tier"):
        runner.execute_model(copies_only(0, KVTransfers(loads=[(0, 0)])))


def test_executor_reports_the_tier_and_profiles_reloads() -> None:
    executor = TorchExecutor(make_runner(num_kv_blocks=16).config)
    assert executor.num_host_kv_blocks == 128
    assert isinstance(executor, KVReloadProfiler)
    points = executor.profile_kv_reload([4, 64, 65, 1000])
    # 16 device blocks of 4 tokens: 64 tokens fit both pools, 65 do not.
    assert [n for n, _ in points] == [4, 64]
    assert all(seconds > 0 for _, seconds in points)
    assert make_runner(kv_offload_gib=0).profile_kv_reload([4]) == []
    executor.shutdown()


# The engine: a job's second turn after other traffic pushed its first turn out of the pool.
FIRST_PROMPT = prompt(80, 11)  # five blocks of 16


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of the top 5 tokens at each position, position by position


def engine_core(kv_offload_gib: float, num_kv_blocks: int = 12) -> EngineCore:
    return EngineCore(EngineConfig(
        model=ModelConfig(max_model_len=192),
        cache=CacheConfig(num_kv_blocks=num_kv_blocks, kv_offload_gib=kv_offload_gib),
        scheduler=SchedulerConfig(max_model_len=192, max_num_seqs=8, policy="fcfs"),
    ))


def complete(core: EngineCore, request_id: str, prompt_token_ids: list[int],
             max_tokens: int) -> Completion:
    core.add_request(EngineCoreRequest(
        request_id=request_id, prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                                       logprobs=5),
    ))
    completion = Completion([], [])
    while core.has_work():
        for output in core.step():
            assert output.request_id == request_id
            completion.token_ids.extend(output.new_token_ids)
            for entry in output.logprobs or []:
                completion.logprobs.extend(entry.top_logprobs)
        core.check_invariants()
    assert len(completion.token_ids) == max_tokens
    return completion


def second_turn(core: EngineCore, corrupt_host_tier: bool = False) -> Completion:
    """Turn 1, two other requests that each need the whole (small) pool, then turn 2."""
    first = complete(core, "turn-1", FIRST_PROMPT, 16)
    for index in range(2):
        complete(core, f"other-{index}", prompt(170, 20 + index), 8)
    if corrupt_host_tier:
        for cache in core.executor.runner.host_kv_cache.caches:
            cache.normal_()
    return complete(core, "turn-2", FIRST_PROMPT + first.token_ids + prompt(20, 12), 12)


def test_second_turn_reloads_its_prefix_from_the_host_tier() -> None:
    recomputed_core = engine_core(0)
    recomputed = second_turn(recomputed_core)
    assert recomputed_core.stats().prefix_cache_hit_tokens == 0  # the pool lost turn 1
    kept_core = engine_core(0, num_kv_blocks=64)
    kept = second_turn(kept_core)  # the pool kept turn 1: its KV is reused as computed
    assert kept_core.stats().prefix_cache_hit_tokens >= 80

    reloaded_core = engine_core(0.01)
    assert (reloaded_core.executor.num_host_kv_blocks
            == reloaded_core.scheduler.num_host_kv_blocks > 0)
    reloaded = second_turn(reloaded_core)
    stats = reloaded_core.stats()
    assert stats.prefix_cache_host_hit_tokens >= 80
    assert stats.prefix_cache_hit_tokens == stats.prefix_cache_host_hit_tokens
    assert stats.host_kv_loaded_tokens == stats.prefix_cache_host_hit_tokens
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert 0 < stats.kv_copy_time_s < stats.execute_time_s  # copies timed within the steps
    # The reloaded KV is bit for bit the KV turn 1 computed; recomputing it may round apart.
    assert reloaded == kept
    assert reloaded.token_ids == recomputed.token_ids
    assert reloaded.logprobs == pytest.approx(recomputed.logprobs, abs=1e-4)

    # The outputs depend on what was loaded: other host KV gives other logprobs.
    corrupted = second_turn(engine_core(0.01), corrupt_host_tier=True)
    assert corrupted.logprobs != pytest.approx(reloaded.logprobs, abs=1e-2)
