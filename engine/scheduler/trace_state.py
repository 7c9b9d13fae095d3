"""What the scheduler's tracer records of the scheduler's own state: the trace header and
the state entering each step.

The `SchedulerTracer` never reads the scheduler; these functions read it (through its public
attributes) and hand the tracer explicit values. Called by the `Scheduler` only while it has
a tracer: `start_trace` from its constructor, `trace_step_start` at the start of every
`schedule()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.scheduler.tracer import PoolState, SchedulerTracer

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler


def start_trace(tracer: SchedulerTracer, scheduler: Scheduler) -> None:
    """Writes the trace header: the policy, the clock origin, the pool and the step limits."""
    policy = scheduler.policy
    config = scheduler.config
    tracer.start(
        policy_name=f"{type(policy).__module__}.{type(policy).__qualname__}",
        clock_origin_s=scheduler.clock(), num_kv_blocks=scheduler.num_kv_blocks,
        block_size=scheduler.block_size, first_step=scheduler.step_id,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
    )


def trace_step_start(tracer: SchedulerTracer, scheduler: Scheduler, now_s: float) -> None:
    """Records the requests, the block pool and the pins entering the next step."""
    pool = scheduler.kv_cache_manager.block_pool
    pins = scheduler.pins
    tracer.start_step(
        scheduler.step_id, now_s, scheduler.running, scheduler.waiting,
        PoolState(
            num_total_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_pinned_blocks=pins.num_pinned_blocks,
            pinned_job_ids=[pin.job_id for pin in pins],
        ),
        token_budget=scheduler.config.max_num_batched_tokens,
        max_num_seqs=scheduler.config.max_num_seqs,
    )
