"""The rule that bounds what pins hold, checked after every step of random agent workloads:
pins hold only memory that no running request needs, and keep it from a waiting request
only until their deadline or until it is overdue.

- A step that preempts a running request, or leaves one waiting for memory, ends with no pin
  (pins are only created when turns finish, after planning, so a pin alive at the end of the
  plan was alive when the request was short of blocks).
- When the waiting head was tried and found no memory (budget, sequence slots and running
  requests all left room for it), no pin but its own job's is left if it is overdue, and
  with `pin_yield=later-jobs` no pin of a job that arrived after the head's job.
- No pin lives past its deadline at the end of a step's planning.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from continuum.agent_policy import AgentPolicy
from continuum.policy_options import ContinuumOptions
from continuum.presets import CONTINUUM, waiting_bounds
from continuum.waiting_order import WaitingBounds
from engine.scheduler.output import SchedulerOutput
from engine.scheduler.scheduler import Scheduler
from estimator.ttl_estimator import ConstantTTLEstimator
from tests.continuum.workload import AgentJob, Turn, replay


class PinShareCheck:
    """`after_schedule` for `replay`: asserts the rule on each step's plan."""

    def __init__(self, policy: AgentPolicy, bounds: WaitingBounds) -> None:
        self.policy = policy
        self.bounds = bounds
        self.num_blocked_heads = 0

    def __call__(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        now_s = scheduler.clock()
        assert all(now_s <= pin.deadline_s for pin in scheduler.pins), "a pin outlived its TTL"
        budget_left = (scheduler.config.max_num_batched_tokens
                       > output.total_num_scheduled_tokens)
        stalled = budget_left and any(r.request_id not in output.num_scheduled_tokens
                                      for r in scheduler.running)
        if output.preempted_req_ids or stalled:
            assert len(scheduler.pins) == 0, "a request lost blocks while a pin held some"
            return
        if not (scheduler.waiting and budget_left
                and len(scheduler.running) < scheduler.config.max_num_seqs):
            return
        head = scheduler.waiting.peek_request()
        self.num_blocked_heads += 1
        others = [pin.job_id for pin in scheduler.pins if pin.job_id != head.job_id]
        if self.bounds.is_overdue(head, now_s, self.policy.ledger):
            assert not others, f"pins {others} kept memory from the overdue head {head}"


turn = st.builds(
    Turn,
    appended_tokens=st.integers(1, 24),
    output_tokens=st.integers(1, 8),
    tool_s=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    tool_name=st.just("bash"),
)


@settings(max_examples=80, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.floats(0.0, 2.0), st.lists(turn, min_size=2, max_size=5)),
                    min_size=2, max_size=7),
    plain=st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(4, 40)), max_size=3),
    ttl_s=st.sampled_from([0.2, 1.0, 100.0]),
    num_blocks=st.integers(12, 40),
    max_num_batched_tokens=st.integers(8, 48),
)
def test_pins_hold_only_memory_nobody_needs_first(
    shapes, plain, ttl_s, num_blocks, max_num_batched_tokens
) -> None:
    jobs = [AgentJob(f"job{index}", arrival_s, (*turns[:-1], Turn(
        turns[-1].appended_tokens, turns[-1].output_tokens, tool_s=None)))
        for index, (arrival_s, turns) in enumerate(shapes)]
    # One-turn jobs stand in for requests without a job: they are never pinned.
    jobs += [AgentJob(f"plain{index}", arrival_s, (Turn(length, 4, tool_s=None),))
             for index, (arrival_s, length) in enumerate(plain)]
    jobs = [job for job in jobs if job.num_tokens <= num_blocks * 4]
    if not jobs:
        return
    # A short bound, so that plain heads become overdue within the runs.
    options = ContinuumOptions(max_plain_wait_s=0.5)
    policy = CONTINUUM.build(options, estimator=ConstantTTLEstimator(ttl_s))
    check = PinShareCheck(policy, waiting_bounds(options))
    result = replay(jobs, policy, num_blocks=num_blocks,
                    max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=6,
                    max_steps=20_000, after_schedule=check)
    assert sorted(result.job_completion_s) == sorted(job.job_id for job in jobs)
