"""The idle job table is swept on a timer: with no step and no request, pins past their TTL
are released and jobs idle past `job_idle_timeout_s` leave the policy's books."""

from __future__ import annotations

import pytest

from continuum.policy_options import ContinuumOptions
from continuum.presets import CONTINUUM
from engine.kv_cache.pins import PinReleaseReason
from engine.scheduler.policy_registry import make_policy
from estimator.ttl_estimator import ConstantTTLEstimator
from tests.continuum.harness import Harness, tokens

JOB_AWARE_POLICIES = ["job-fcfs", "continuum", "continuum-fixed", "infercept", "autellix"]
IDLE_TIMEOUT_S = 5.0


@pytest.mark.parametrize("policy_name", JOB_AWARE_POLICIES)
def test_a_finished_job_leaves_the_table_through_the_sweep_with_no_step(policy_name) -> None:
    policy = make_policy(policy_name, {"job_idle_timeout_s": str(IDLE_TIMEOUT_S)})
    h = Harness(policy)
    h.add("t1", tokens(1, 10), job="J")  # not the last turn: the job lives on
    h.run_until_finished("t1")
    assert h.policy.num_jobs == 1
    pin = h.pin("J")  # some policies pin the turn; its TTL must run out first
    forget_at_s = max(IDLE_TIMEOUT_S, 0.0 if pin is None else pin.deadline_s) + 1.0
    step_id = h.scheduler.step_id

    h.clock.advance(1.0)
    assert not h.scheduler.sweep()  # nothing due yet: nothing changes
    assert h.policy.num_jobs == 1 and h.pin("J") is pin

    h.clock.now_s = forget_at_s
    sweep = h.scheduler.sweep()
    assert sweep.forgotten_job_ids == ("J",)
    assert [(p.job_id, p.release_reason) for p in sweep.released_pins] == (
        [] if pin is None else [("J", PinReleaseReason.EXPIRED)])
    assert h.policy.num_jobs == 0 and h.policy.job_state("J") is None
    assert len(h.scheduler.pins) == 0
    assert h.scheduler.step_id == step_id  # no step ran: no request came either
    h.scheduler.check_invariants()
    assert not h.scheduler.sweep()  # and nothing is left to sweep


def test_the_scheduler_expires_pins_and_then_the_policy_forgets_idle_jobs() -> None:
    h = Harness(CONTINUUM.build(ContinuumOptions(job_idle_timeout_s=IDLE_TIMEOUT_S),
                                estimator=ConstantTTLEstimator(2.0)))
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    pin = h.pin("J")
    assert pin is not None
    now_s = max(IDLE_TIMEOUT_S, pin.deadline_s) + 1.0
    assert h.policy.sweep(now_s).forgotten_job_ids == ()  # its live pin keeps the job
    h.clock.now_s = now_s
    sweep = h.scheduler.sweep()
    assert sweep.released_pins == (pin,) and h.pin("J") is None
    assert sweep.forgotten_job_ids == ("J",) and h.policy.job_state("J") is None
    h.scheduler.check_invariants()


def test_the_sweep_keeps_a_job_with_a_waiting_turn_and_the_pin_that_turn_will_reuse() -> None:
    policy = make_policy("infercept", {"job_idle_timeout_s": str(IDLE_TIMEOUT_S)})
    h = Harness(policy)
    h.add("t1", tokens(1, 10), job="J")
    h.run_until_finished("t1")
    h.clock.advance(IDLE_TIMEOUT_S + 1.0)
    h.next_turn("t2", "t1", tokens(50, 2), last=True)  # arrived, not yet stepped
    assert not h.scheduler.sweep()
    assert h.pin("J") is not None and h.policy.num_jobs == 1
    h.run_until_finished("t2")
    assert h.requests["t2"].num_cached_tokens > 0  # the pin was reused
    assert h.policy.num_jobs == 0 and len(h.scheduler.pins) == 0
    h.scheduler.check_invariants()
