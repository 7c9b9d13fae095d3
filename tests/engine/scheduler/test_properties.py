"""Random add / abort / step / release sequences keep every invariant, and leak nothing."""

from __future__ import annotations

import random

from hypothesis import event, given
from hypothesis import strategies as st

from engine.scheduler.policies import FCFSPolicy, PriorityPolicy
from tests.engine.helpers import (
    FakeClock,
    FakeRunner,
    PinningPolicy,
    assert_everything_released,
    make_request,
    make_scheduler,
    run_control_operation,
    run_until_done,
)

BLOCK_SIZE = 4
EOS = 0
POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "pinning": PinningPolicy}

add = st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 20), st.integers(1, 16),
                st.integers(0, 3), st.booleans())
operation = st.one_of(
    add,
    add,
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("abort_mid_step"), st.integers(0, 30)),
    st.tuples(st.just("release"), st.integers(0, 3)),
)


@given(
    policy_name=st.sampled_from(sorted(POLICIES)),
    num_blocks=st.integers(6, 12),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(1, 8),
    threshold=st.one_of(st.none(), st.integers(1, 16)),
    caching=st.booleans(),
    num_host_blocks=st.sampled_from([0, 0, 3, 8, 32]),
    seed=st.integers(0, 2**16),
    operations=st.lists(operation, min_size=4, max_size=50),
)
def test_random_workloads_keep_invariants_and_free_everything(
    policy_name, num_blocks, budget, max_num_seqs, threshold, caching, num_host_blocks, seed,
    operations,
) -> None:
    """With or without a host tier: `abort_mid_step` aborts a request after its step was
    planned (possibly with loads into its blocks) and before the runner ran it."""
    rng = random.Random(seed)
    clock = FakeClock()
    scheduler = make_scheduler(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs, max_model_len=24, long_prefill_token_threshold=threshold,
        enable_prefix_caching=caching, policy=POLICIES[policy_name](), clock=clock,
        num_host_blocks=num_host_blocks,
    )
    runner = FakeRunner(BLOCK_SIZE, sample=lambda req_id, pos: rng.choice([EOS, *range(1, 12)]))
    # A few shared "system prompts" make prefix hits and shared blocks common.
    prefixes = [[7] * 8, [8] * 12, [9] * 4, []]
    next_id = 0
    for op in operations:
        if op[0] == "add":
            _, prefix, length, max_tokens, job, last = op
            prompt = (prefixes[prefix] + [rng.randrange(1, 50) for _ in range(length)])[:24]
            scheduler.add_request(make_request(
                f"r{next_id}", prompt, max_tokens=max_tokens, eos_token_id=EOS,
                priority=rng.randrange(3), arrival_time_s=clock(), job_id=f"job{job}",
                is_last_step=last,
            ))
            next_id += 1
            scheduler.check_invariants()
        else:
            run_control_operation(scheduler, runner, clock, op, step_s=0.01)

    run_until_done(scheduler, runner, max_steps=2000)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"pinned: {scheduler.pins.num_created > 0}")
    event(f"prefix hits: {scheduler.kv_cache_manager.stats.num_hit_tokens > 0}")
    event(f"host hits: {scheduler.kv_cache_manager.stats.num_host_hit_tokens > 0}")
    assert_everything_released(scheduler, runner, [f"job{job}" for job in range(4)])
