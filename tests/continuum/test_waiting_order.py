"""Bounded waiting under the program-level policies: no request waits unboundedly behind
other jobs, with a fake clock: a plain request by its own bound, a younger job's turn by
service aging (docs/decisions/0004-waiting-bounds.md)."""

from __future__ import annotations

import math

import pytest

from continuum.policy_options import ContinuumOptions, ProgramOrderOptions
from continuum.presets import CONTINUUM, JOB_FCFS
from engine.kv_cache.pins import PinReleaseReason
from engine.scheduler.policy import PolicyEnvironment, SchedulingPolicy
from estimator.ttl_estimator import ConstantTTLEstimator
from eval.policy_variants import CONTINUUM_AF226D3, Af226d3Options
from tests.continuum.harness import Harness, tokens

UNBOUNDED = {"max_plain_wait_s": math.inf}
STEP_S = 0.05
# Prefills cost 1 ms a token, so that each of the flood's 25-token turns is 25 ms of service.
MS_A_TOKEN = PolicyEnvironment(profile_prefill=lambda: [(100, 0.1), (200, 0.2)])
TURN_SERVICE_S = 0.025


def flood_until_admitted(policy: SchedulingPolicy, *, duration_s: float,
                         young_job: str | None = None, harness: Harness | None = None,
                         ) -> float | None:
    """An old job keeps four non-final turns in flight (each a fresh 24-token prompt, one
    output token); 1 s in, a 40-token request arrives: a plain one, or the first turn of
    `young_job`. Returns how long it waited before admission, or None if the flood
    outlasted `duration_s` first."""
    h = Harness(policy, num_blocks=32, max_num_batched_tokens=64) if harness is None else harness
    serial = 0
    late = None
    while h.clock() < duration_s:
        unfinished = [r for r in h.requests.values() if r.job_id == "old" and not r.is_finished]
        for _ in range(4 - len(unfinished)):
            h.add(f"old#{serial}", tokens(1000 + 100 * serial, 24), job="old", max_tokens=1)
            serial += 1
        if late is None and h.clock() >= 1.0:
            late = h.add("late", tokens(50, 40), job=young_job, max_tokens=2)
        h.step(dt_s=STEP_S)
        if late is not None and "late" in h.admitted():
            return h.clock() - STEP_S - late.arrival_time_s
    return None


def af226d3(options: dict) -> SchedulingPolicy:
    return CONTINUUM_AF226D3.build(Af226d3Options(**options),
                                   estimator=ConstantTTLEstimator(5.0))


def test_af226d3_starved_a_plain_request_without_its_bounds() -> None:
    # Without the bounds, the old job's turns always sorted first: the plain request starved.
    unbounded = {"max_job_age_s": math.inf, "max_wait_s": math.inf, "max_plain_wait_s": math.inf}
    assert flood_until_admitted(af226d3(unbounded), duration_s=20.0) is None
    # With them, it headed the queue once it waited max_wait_s, and pins gave way to it.
    bounded = {"max_job_age_s": 60.0, "max_wait_s": 2.0}
    waited_s = flood_until_admitted(af226d3(bounded), duration_s=20.0)
    assert waited_s is not None and waited_s <= 2.0 + 4 * STEP_S


@pytest.mark.parametrize("make_policy", [
    lambda options: CONTINUUM.build(ContinuumOptions(**options),
                                    estimator=ConstantTTLEstimator(5.0)),
    lambda options: JOB_FCFS.build(ProgramOrderOptions(**options)),
], ids=["continuum", "job-fcfs"])
def test_a_plain_request_goes_ahead_of_the_turns_that_arrive_after_it(make_policy) -> None:
    # Even with every bound off, the old job's later turns cannot pass it.
    waited_s = flood_until_admitted(make_policy(UNBOUNDED), duration_s=20.0)
    assert waited_s is not None and waited_s <= 4 * STEP_S


def test_with_the_default_bounds_a_plain_request_waits_at_most_its_own_bound() -> None:
    # The old job always holds a pin, so its turns are in the pinned tier and its pins would
    # keep memory from a later plain request: both give way once it waited max_plain_wait_s.
    policy = CONTINUUM.build(estimator=ConstantTTLEstimator(5.0))
    waited_s = flood_until_admitted(policy, duration_s=40.0)
    assert waited_s is not None and waited_s <= 10.0 + 4 * STEP_S


@pytest.mark.parametrize("make_policy", [
    lambda options: CONTINUUM.build(ContinuumOptions(**options),
                                    estimator=ConstantTTLEstimator(5.0)),
    lambda options: JOB_FCFS.build(ProgramOrderOptions(**options)),
], ids=["continuum", "job-fcfs"])
@pytest.mark.parametrize("service_weight", [0.25, 0.5])
def test_a_never_ending_job_yields_to_a_younger_job_after_the_stated_service(
    make_policy, service_weight: float
) -> None:
    # The old job (first arrival at 0 s) never ends; the young job's turn arrives at 1 s.
    # Whatever the load, the old job's turns pass it only while the old job's service is
    # below 1 s / service_weight, or (1 s + the pin lead) / service_weight while it holds a
    # pin: past that, the young turn waits only for the old turns already queued (four in
    # flight) and one step's admissions.
    pin_lead_s = 2.0
    policy = make_policy({"service_weight": service_weight, "pin_lead_s": pin_lead_s})
    h = Harness(policy, num_blocks=32, max_num_batched_tokens=64, environment=MS_A_TOKEN)
    h.add("old#0", tokens(1000, 24), job="old", max_tokens=1)
    h.run_until_finished("old#0")
    old = policy.ledger.jobs.get("old")
    assert old is not None
    waited_s = flood_until_admitted(policy, duration_s=60.0, young_job="young", harness=h)
    assert waited_s is not None and waited_s > 10 * STEP_S  # it did wait behind the old job
    lead_s = pin_lead_s if policy.name == "continuum" else 0.0
    bound_s = (1.0 + lead_s) / service_weight + 5 * TURN_SERVICE_S
    assert 1.0 / service_weight <= old.attained_service_s <= bound_s


def test_without_aging_a_young_job_starves() -> None:
    # Pure program order (weight 0): the old job's turns always sort first and the young
    # job's turn waits for as long as the flood lasts.
    policy = CONTINUUM.build(ContinuumOptions(service_weight=0.0),
                             estimator=ConstantTTLEstimator(5.0))
    h = Harness(policy, num_blocks=32, max_num_batched_tokens=64, environment=MS_A_TOKEN)
    assert flood_until_admitted(policy, duration_s=20.0, young_job="young", harness=h) is None


def test_pins_hold_at_most_their_share_of_the_pool_later_jobs_first() -> None:
    # 32 blocks, pins capped at half: each job's turn pins 3 blocks.
    policy = CONTINUUM.build(ContinuumOptions(max_pinned_fraction=0.5),
                             estimator=ConstantTTLEstimator(100.0))
    h = Harness(policy, num_blocks=32)
    for index in range(6):
        h.add(f"j{index}#0", tokens(100 * (index + 1), 10), job=f"j{index}", max_tokens=3)
        h.run_until_finished(f"j{index}#0")
    assert [f"j{i}" in h.scheduler.pins for i in range(6)] == [True] * 5 + [False]
    assert h.scheduler.pins.num_pinned_blocks == 15 <= 16
    # An older job's new pin pushes out the latest job's.
    h.next_turn("j0#1", "j0#0", tokens(900, 8), max_tokens=3)  # pins 5 blocks
    h.run_until_finished("j0#1")
    assert "j0" in h.scheduler.pins and "j4" not in h.scheduler.pins
    assert h.scheduler.pins.num_released[PinReleaseReason.PRESSURE] == 1
    assert h.scheduler.pins.num_pinned_blocks <= 16
