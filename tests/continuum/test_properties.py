"""Random agent workloads: every job finishes, invariants hold after every step, nothing
leaks; and requests without a job are scheduled exactly as by FCFS."""

from __future__ import annotations

import math
import random

from hypothesis import event, given, settings
from hypothesis import strategies as st

from continuum.agent_policy import AgentPolicy
from continuum.policy_options import ContinuumOptions
from continuum.presets import AUTELLIX, CONTINUUM, CONTINUUM_FIXED, INFERCEPT, JOB_FCFS
from engine.scheduler.policies import FCFSPolicy
from estimator.ttl_estimator import ConstantTTLEstimator
from eval.policy_variants import CONTINUUM_AF226D3, CONTINUUM_ORACLE
from tests.continuum.workload import AgentJob, Turn, replay, step_decisions
from tests.engine.helpers import FakeClock, FakeRunner, make_request, make_scheduler, run_step

TIGHT_BOUNDS = ContinuumOptions(service_weight=50.0, pin_lead_s=0.1, max_plain_wait_s=0.3,
                                max_pinned_fraction=0.4)


def oracle(jobs: list[AgentJob]) -> AgentPolicy:
    """The oracle, told each turn's true tool time (request ids are `job#turn`)."""
    tool_s = {f"{job.job_id}#{k}": turn.tool_s for job in jobs for k, turn in enumerate(job.turns)}
    return CONTINUUM_ORACLE.build(tool_duration_s=tool_s.get)


AGENT_POLICIES = {
    "continuum": lambda jobs: CONTINUUM.build(estimator=ConstantTTLEstimator(1.5)),
    "continuum-long-ttl": lambda jobs: CONTINUUM.build(
        ContinuumOptions(max_plain_wait_s=math.inf), estimator=ConstantTTLEstimator(1e5)),
    "continuum-tight-bounds": lambda jobs: CONTINUUM.build(
        TIGHT_BOUNDS, estimator=ConstantTTLEstimator(2.0)),
    "continuum-fixed": lambda jobs: CONTINUUM_FIXED.build(),
    "continuum-af226d3": lambda jobs: CONTINUUM_AF226D3.build(
        estimator=ConstantTTLEstimator(1.5)),
    "continuum-oracle": oracle,
    "job-fcfs": lambda jobs: JOB_FCFS.build(),
    "infercept": lambda jobs: INFERCEPT.build(),
    "autellix": lambda jobs: AUTELLIX.build(),
}

turn = st.builds(
    Turn,
    appended_tokens=st.integers(1, 12),
    output_tokens=st.integers(1, 6),
    tool_s=st.sampled_from([0.0, 0.05, 0.3, 1.0, 4.0]),
    tool_name=st.sampled_from([None, "bash", "grep"]),
)
job_shape = st.tuples(st.floats(0.0, 2.0), st.lists(turn, min_size=1, max_size=4))


@settings(max_examples=150, deadline=None)
@given(
    policy_name=st.sampled_from(sorted(AGENT_POLICIES)),
    shapes=st.lists(job_shape, min_size=1, max_size=8),
    num_blocks=st.integers(8, 28),
    max_num_batched_tokens=st.integers(8, 64),
    max_num_seqs=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_random_jobs_all_finish_with_invariants_and_empty_tables(
    policy_name, shapes, num_blocks, max_num_batched_tokens, max_num_seqs, seed
) -> None:
    jobs = []
    for index, (arrival_s, turns) in enumerate(shapes):
        last = Turn(turns[-1].appended_tokens, turns[-1].output_tokens, tool_s=None,
                    tool_name=None)
        jobs.append(AgentJob(f"job{index}", arrival_s, (*turns[:-1], last)))
    jobs = [job for job in jobs if job.num_tokens <= num_blocks * 4]
    if not jobs:
        return
    policy = AGENT_POLICIES[policy_name](jobs)
    # replay() checks the invariants after every step, that every job finishes within the
    # step bound (pins never wedge admission), and that no block or pin is left behind.
    result = replay(jobs, policy, num_blocks=num_blocks,
                    max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                    seed=seed, max_steps=20_000)
    assert sorted(result.job_completion_s) == sorted(job.job_id for job in jobs)
    for reason in result.pins_released:
        event(f"pin released: {reason}")
    event(f"preempted: {result.num_preemptions > 0}")
    assert policy.num_jobs == 0 and not policy.ledger._arrivals


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(1, 12)),
        min_size=1, max_size=12,
    ),
    num_blocks=st.integers(8, 16),
    max_num_batched_tokens=st.integers(4, 40),
    max_num_seqs=st.integers(1, 6),
    threshold=st.one_of(st.none(), st.integers(1, 16)),
    seed=st.integers(0, 1000),
)
def test_requests_without_a_job_are_scheduled_as_by_fcfs(
    arrivals, num_blocks, max_num_batched_tokens, max_num_seqs, threshold, seed
) -> None:
    """`arrivals`: (steps to run before it, prompt length, max_tokens) per request. With
    chunked prefill (the default). Job inference is off: a prompt that happens to continue
    an earlier one would join its job.

    `continuum-af226d3` schedules them exactly as FCFS does; `continuum` admits them in
    the same order, but chooses victims by its own rules (a prefilling request waits rather
    than preempt; repeated victims are spared)."""
    traces = []
    for policy in (FCFSPolicy(), CONTINUUM_AF226D3.build(), CONTINUUM.build()):
        rng = random.Random(seed)
        scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=4, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, max_model_len=32, long_prefill_token_threshold=threshold,
            policy=policy, clock=FakeClock(), job_inference=False,
        )
        runner = FakeRunner(4, sample=lambda req_id, position, rng=rng: rng.randrange(1, 9))
        trace = []
        for index, (steps_before, prompt_len, max_tokens) in enumerate(arrivals):
            for _ in range(steps_before):
                trace.append(step_decisions(*run_step(scheduler, runner)))
            prompt = [rng.randrange(1, 6) for _ in range(prompt_len)]
            scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=max_tokens))
        while scheduler.has_unfinished_requests():
            trace.append(step_decisions(*run_step(scheduler, runner)))
        assert len(scheduler.pins) == 0
        traces.append(trace)
    assert traces[0] == traces[1]
    assert first_admissions(traces[2]) == first_admissions(traces[0])


def first_admissions(trace: list) -> list[str]:
    """The request ids in the order they were first admitted (the first item of each step's
    decisions lists the admitted ids)."""
    seen: list[str] = []
    for admitted, *_ in trace:
        seen += [request_id for request_id in admitted if request_id not in seen]
    return seen

