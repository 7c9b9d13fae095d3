"""The host KV tier seen from the scheduler: evictable KV is stored, prefixes come back as
loads, every copy reads and writes the right blocks (the fake runner checks each hit's
tokens), and nothing leaks, whatever the order of turns, evictions and aborts."""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from engine.config import CacheConfig
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.pins import PinReleaseReason
from engine.request import Request
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.retention import Retention, RetentionInputs
from tests.engine.helpers import (
    FakeClock,
    FakeRunner,
    PinningPolicy,
    assert_everything_released,
    make_request,
    make_scheduler,
    run_control_operation,
    run_step,
    run_until_done,
)

BLOCK_SIZE = 4


def _evict_with_filler(scheduler, runner, num_blocks: int, tag: int) -> None:
    """Runs unrelated requests that take every device block, evicting whatever is cached."""
    for index in range(2):
        prompt = [100 + tag * 10 + index] * (num_blocks * BLOCK_SIZE // 2 - 1)
        scheduler.add_request(make_request(f"filler{tag}-{index}", prompt, max_tokens=1))
    run_until_done(scheduler, runner)


def test_an_evicted_turn_comes_back_from_the_host_tier_as_loads():
    scheduler = make_scheduler(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=32,
                               num_host_blocks=32)
    runner = FakeRunner(BLOCK_SIZE)
    first = make_request("t1", list(range(1, 13)), max_tokens=2, job_id="job")
    scheduler.add_request(first)
    run_until_done(scheduler, runner)
    _evict_with_filler(scheduler, runner, num_blocks=8, tag=1)
    assert scheduler.kv_cache_manager.get_computed_blocks(first).blocks == []

    second = make_request("t2", [*first.all_token_ids, 50, 51, 52], max_tokens=2,
                          job_id="job")
    scheduler.add_request(second)
    output, core_outputs = run_step(scheduler, runner)
    [new] = output.scheduled_new_reqs
    assert new.num_computed_tokens == 12  # 3 full blocks of the first turn's 14 tokens
    assert len(output.kv_transfers.loads) == 3
    assert [pair[1] for pair in output.kv_transfers.loads] == new.block_ids[:3]
    assert scheduler.kv_cache_manager.stats.num_host_hit_tokens == 12
    assert core_outputs == [] or core_outputs[0].num_cached_tokens == 12
    run_until_done(scheduler, runner)
    assert second.num_cached_tokens == 12


def test_without_a_tier_the_same_turn_recomputes_and_no_copy_is_sent():
    scheduler = make_scheduler(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=32)
    runner = FakeRunner(BLOCK_SIZE)
    first = make_request("t1", list(range(1, 13)), max_tokens=2, job_id="job")
    scheduler.add_request(first)
    run_until_done(scheduler, runner)
    _evict_with_filler(scheduler, runner, num_blocks=8, tag=1)
    second = make_request("t2", [*first.all_token_ids, 50], max_tokens=2, job_id="job")
    scheduler.add_request(second)
    output, _ = run_step(scheduler, runner)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0
    assert output.kv_transfers.is_empty
    assert runner.num_copied_blocks == 0


def test_a_block_is_stored_once_when_it_becomes_evictable_and_only_then():
    scheduler = make_scheduler(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=32,
                               num_host_blocks=32, policy=PinningPolicy(ttl_s=5.0))
    runner = FakeRunner(BLOCK_SIZE)
    turn = make_request("t1", list(range(1, 10)), max_tokens=1, job_id="job")
    scheduler.add_request(turn)
    run_until_done(scheduler, runner)
    host_tier = scheduler.kv_cache_manager.host_tier
    assert host_tier is not None and host_tier.num_used_blocks == 0  # pinned: still held
    scheduler.pins.release("job", PinReleaseReason.PRESSURE, now_s=0.0)
    assert host_tier.num_used_blocks == 2  # the pin's 2 full blocks, queued for the host
    output, _ = run_step(scheduler, runner)  # an empty step still carries the copies
    assert output.is_empty and output.kv_transfers.num_stored_blocks == 2
    # A second owner of the same content does not store it again.
    scheduler.add_request(make_request("again", list(range(1, 10)), max_tokens=1))
    run_until_done(scheduler, runner)
    output, _ = run_step(scheduler, runner)
    assert output.kv_transfers.is_empty
    assert host_tier.stats.num_stored_blocks == 2


class _Discard(FCFSPolicy):
    def retention(self, request, now_s):
        return Retention(0.0, RetentionInputs(ttl_s=0.0, source="discard"), offload=False)


def test_a_discarding_retention_frees_without_storing():
    scheduler = make_scheduler(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=32,
                               num_host_blocks=8, policy=_Discard())
    runner = FakeRunner(BLOCK_SIZE)
    scheduler.add_request(make_request("t1", list(range(1, 10)), max_tokens=1, job_id="job"))
    run_until_done(scheduler, runner)
    assert scheduler.kv_cache_manager.host_tier.num_used_blocks == 0


def test_a_full_host_tier_evicts_its_least_recently_used_blocks():
    scheduler = make_scheduler(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=32,
                               num_host_blocks=2)
    runner = FakeRunner(BLOCK_SIZE)
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", [index + 1] * 9, max_tokens=1))
        run_until_done(scheduler, runner)
    host_tier = scheduler.kv_cache_manager.host_tier
    assert host_tier.num_used_blocks == 2
    assert host_tier.stats.num_evicted_blocks == 4
    run_step(scheduler, runner)
    scheduler.check_invariants()
    last = make_request("again", [3] * 9, max_tokens=1)
    hit = scheduler.kv_cache_manager.get_computed_blocks(last)
    assert len(hit.blocks) + len(hit.host_blocks) == 2  # the latest request's blocks survived


def test_reset_works_on_an_idle_engine_with_stores_queued():
    scheduler = make_scheduler(num_blocks=8, block_size=BLOCK_SIZE, max_model_len=32,
                               num_host_blocks=8)
    runner = FakeRunner(BLOCK_SIZE)
    scheduler.add_request(make_request("r", list(range(1, 10)), max_tokens=1))
    run_until_done(scheduler, runner)
    assert scheduler.has_pending_kv_transfers()
    assert scheduler.reset_prefix_cache()
    assert not scheduler.has_pending_kv_transfers()
    assert scheduler.kv_cache_manager.host_tier.num_used_blocks == 0
    scheduler.check_invariants()


def test_the_tier_needs_prefix_caching_and_a_valid_size():
    with pytest.raises(ValueError, match="kv_offload_gib"):
        CacheConfig(kv_offload_gib=-1.0)
    with pytest.raises(ValueError, match="prefix caching"):
        CacheConfig(kv_offload_gib=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="num_host_blocks"):
        KVCacheManager(8, 4, num_host_blocks=-1)


def _flood(scheduler, runner, rng: random.Random, next_id: int, num_blocks: int) -> int:
    """Runs unrelated traffic the size of the device pool (evicting it); the next id."""
    for _ in range(num_blocks // 4):
        prompt = [rng.randrange(60, 90) for _ in range(4 * BLOCK_SIZE - 1)]
        scheduler.add_request(make_request(f"r{next_id}", prompt, max_tokens=1))
        next_id += 1
    run_until_done(scheduler, runner, max_steps=4000)
    return next_id


# Property test: conversations whose turns extend each other, fillers that evict them, and
# aborts at any point (including between a step's planning and its execution, while its
# loads are in flight).
turn = st.tuples(st.just("turn"), st.integers(0, 1), st.integers(3, 10), st.booleans())
filler = st.tuples(st.just("filler"), st.integers(6, 20))
operation = st.one_of(
    turn, turn, turn, filler, filler,
    st.tuples(st.just("step"), st.integers(1, 8)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("abort_mid_step"), st.integers(0, 40)),
    st.tuples(st.just("release"), st.integers(0, 3)),
)


@given(
    pinning=st.booleans(),
    num_blocks=st.integers(16, 24),
    num_host_blocks=st.sampled_from([2, 16, 64, 256]),
    budget=st.integers(4, 32),
    seed=st.integers(0, 2**16),
    operations=st.lists(operation, min_size=8, max_size=60),
)
def test_random_conversations_with_a_host_tier_keep_both_tiers_consistent(
    pinning, num_blocks, num_host_blocks, budget, seed, operations,
):
    rng = random.Random(seed)
    clock = FakeClock()
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=budget,
        max_model_len=64, clock=clock, num_host_blocks=num_host_blocks, job_inference=False,
        policy=PinningPolicy(ttl_s=0.05) if pinning else FCFSPolicy(),
    )
    runner = FakeRunner(BLOCK_SIZE, sample=lambda req_id, pos: rng.randrange(1, 60))
    last_turn: dict[int, Request] = {}
    next_id = 0
    for op in operations:
        if op[0] == "turn":
            _, job, num_new, flood_first = op
            previous = last_turn.get(job)
            for _ in range(100):  # the next turn extends the previous one once it finished
                if previous is None or previous.is_finished:
                    break
                run_step(scheduler, runner)
                clock.advance(0.02)
            if flood_first:
                next_id = _flood(scheduler, runner, rng, next_id, num_blocks)
            context = [] if previous is None or not previous.is_finished else (
                previous.all_token_ids)
            prompt = context + [rng.randrange(1, 60) for _ in range(num_new)]
            if len(prompt) > 56:  # too long for max_model_len: a new conversation
                prompt = prompt[len(context):]
            request = make_request(f"r{next_id}", prompt, max_tokens=rng.randrange(1, 4),
                                   job_id=f"job{job}", arrival_time_s=clock())
            scheduler.add_request(request)
            last_turn[job] = request
            next_id += 1
        elif op[0] == "filler":
            prompt = [rng.randrange(60, 90) for _ in range(op[1])]
            scheduler.add_request(make_request(f"r{next_id}", prompt, max_tokens=1))
            next_id += 1
            scheduler.check_invariants()
        else:
            run_control_operation(scheduler, runner, clock, op, step_s=0.02)

    run_until_done(scheduler, runner, max_steps=4000)
    stats = scheduler.kv_cache_manager.stats
    event(f"host hits: {stats.num_host_hit_tokens > 0}")
    assert_everything_released(scheduler, runner, [f"job{job}" for job in range(4)])
