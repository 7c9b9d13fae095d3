"""What a waiting prompt must find before it starts, and which pins yield to it: the
admission strategies of the agent policies, over a stub scheduler and a real one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from continuum.admission_rules import OtherJobsPins, ThisChunk, WholePrompt
from continuum.agent_policy import AgentPolicy
from continuum.presets import CONTINUUM, INFERCEPT, JOB_FCFS
from estimator.ttl_estimator import ConstantTTLEstimator
from eval.policy_variants import CONTINUUM_AF226D3
from tests.continuum.harness import Harness, tokens
from tests.continuum.test_victims import arrive, bind, describe
from tests.engine.helpers import make_request


@pytest.mark.parametrize(("running", "pins", "head_job", "waited_s", "expected"), [
    ("", "", None, 0.0, None),
    ("", "J0 J2 J1", None, 0.0, "pin:J2"),  # nothing runs: latest job first
    ("", "J0 J2 J1", "J2", 0.0, "pin:J1"),  # the head's own job's pin last
    ("", "J2", "J2", 0.0, "pin:J2"),
    # While others run, pins yield only to a request without a job once it is overdue
    # (max_plain_wait_s 10 s), latest job first; a job's turn is never overdue.
    ("a", "J1 J2", "J0", 0.0, None),
    ("a", "J0 J1", "J1", 29.9, None),
    ("a", "J0 J1", "J1", 300.0, None),
    ("a", "J0 J2", "J1", 300.0, None),
    ("a", "J0 J1", None, 9.9, None),
    ("a", "J0 J1", None, 10.0, "pin:J1"),
    ("a", "J1", "J1", 60.0, None),
])
def test_continuum_pins_for_admission(
    running: str, pins: str, head_job: str | None, waited_s: float, expected: str | None
) -> None:
    assert _pin_for_head(CONTINUUM.build(), running, pins, head_job, waited_s) == expected


@pytest.mark.parametrize(("running", "pins", "head_job", "waited_s", "expected"), [
    ("", "", None, 0.0, None),
    ("", "J0 J2 J1", None, 0.0, "pin:J2"),  # latest job first
    ("", "J0 J2 J1", "J2", 0.0, "pin:J1"),  # the head's own job's pin last
    ("", "J2", "J2", 0.0, "pin:J2"),
    # While others run, pins yield once the head has waited max_wait_s (30 s), requests
    # without a job included, latest job first; the head's own job's pin is kept.
    ("a", "J0 J1", None, 29.9, None),
    ("a", "J0 J1", None, 30.0, "pin:J1"),
    ("a", "J0 J1", "J1", 30.0, "pin:J0"),
    ("a", "J1", "J1", 60.0, None),
])
def test_continuum_af226d3_pins_for_admission(
    running: str, pins: str, head_job: str | None, waited_s: float, expected: str | None
) -> None:
    assert _pin_for_head(CONTINUUM_AF226D3.build(), running, pins, head_job,
                         waited_s) == expected


def _pin_for_head(policy: AgentPolicy, running: str, pins: str, head_job: str | None,
                  waited_s: float) -> str | None:
    """What `policy`, with `running` requests and `pins` (see `bind`), gives way to a head
    of `head_job` that has waited `waited_s`."""
    bind(policy, running, pins)
    head = make_request("head", [1, 2, 3], job_id=head_job)
    arrive(policy, head, now_s=20.0)
    return describe(policy.select_victim(head, 20.0 + waited_s))


@pytest.mark.parametrize(("pins", "blocks", "head_job", "expected"), [
    ("J0 J1", {"J0": 3, "J1": 2}, None, "pin:J1"),
    ("J0 J1", {"J0": 3, "J1": 2}, "J1", "pin:J0"),  # the head's own job last
    ("", {}, None, None),
])
def test_infercept_releases_pins_for_admission_even_while_others_run(
    pins: str, blocks: dict[str, int], head_job: str | None, expected: str | None
) -> None:
    policy = INFERCEPT.build()
    bind(policy, "a b", pins, blocks)
    head = make_request("head", [1, 2, 3], job_id=head_job)
    assert describe(policy.select_victim(head, 10.0)) == expected


@pytest.mark.parametrize(("admission", "prompt_len", "num_preemptions"), [
    # "b" (10 blocks) cannot fit whole: started at once, it stalls halfway and "a"'s growth
    # preempts it (its computed tokens recomputed); held back until its blocks are there,
    # it never stalls.
    (ThisChunk(), 40, 1),
    (WholePrompt(OtherJobsPins()), 40, 0),
    # "b" (9 blocks) fits whole exactly: it starts, and "a"'s next block preempts it; with a
    # block of headroom per running request, it waits for "a" to finish instead.
    (WholePrompt(OtherJobsPins(), headroom_blocks=0), 36, 1),
    (WholePrompt(OtherJobsPins(), headroom_blocks=1), 36, 0),
])
def test_a_prompt_starts_only_when_it_will_not_be_preempted_halfway(
        admission, prompt_len: int, num_preemptions: int) -> None:
    # 16 blocks of 4 tokens, 8 tokens a step. "a" decodes to 48 tokens (12 blocks); "b"
    # arrives while "a" holds 7 and 9 are free.
    job_fcfs = JOB_FCFS.build()
    policy = AgentPolicy("job-fcfs", replace(job_fcfs.strategies, admission=admission),
                         job_idle_timeout_s=600.0)
    h = Harness(policy, num_blocks=16, max_num_batched_tokens=8)
    h.add("a", tokens(0, 24), max_tokens=24)
    h.step(4)
    assert len(h.scheduler.kv_cache_manager.get_block_ids("a")) == 7
    h.add("b", tokens(100, prompt_len), max_tokens=2)
    h.run_until_finished("a", "b")
    assert h.scheduler.num_preemptions == num_preemptions
    assert (h.scheduler.recomputed_tokens > 0) == (num_preemptions > 0)
    assert h.admission_order()[1:] == ["b"] * (1 + num_preemptions)


@pytest.mark.parametrize(("any_other_job", "job", "starts_at_once"), [
    # A later job's long prompt does not start on an earlier job's pinned memory...
    (False, "C", False),
    (True, "C", True),
    # ...an earlier job's does: pressure would take the later job's pin for its chunks.
    (False, "X", True),
])
def test_a_waiting_prompt_counts_only_the_pins_it_may_take(
        any_other_job: bool, job: str, starts_at_once: bool) -> None:
    # Jobs arrive X, A, B; 24 blocks of 4 tokens. A's turn ends pinned (7 blocks) while B
    # decodes; then a 60-token prompt (15 blocks) of job `job` needs A's pinned blocks.
    policy = CONTINUUM.build(estimator=ConstantTTLEstimator(100.0))
    if any_other_job:
        policy = AgentPolicy("continuum", replace(
            policy.strategies, admission=WholePrompt(OtherJobsPins())), job_idle_timeout_s=600)
    h = Harness(policy, num_blocks=24)
    h.add("X#0", tokens(0, 4), job="X", tool=None, max_tokens=1)
    h.add("A#0", tokens(100, 28), job="A", max_tokens=1)
    h.add("B#0", tokens(200, 4), job="B", max_tokens=40)
    h.run_until_finished("X#0", "A#0")
    assert h.pin("A") is not None and h.pin("A").num_blocks == 7
    prompt = h.add(f"{job}#1", tokens(300, 60), job=job, max_tokens=1)
    h.step()
    assert (prompt.request_id in h.admitted()) == starts_at_once
    if starts_at_once:
        return
    # A's next turn takes its pin back; the later prompt starts once the blocks are there.
    h.next_turn("A#1", "A#0", tokens(400, 4), max_tokens=1)
    h.run_until_finished("A#1", prompt.request_id)
    order = h.admission_order()
    assert order.index("A#1") < order.index(prompt.request_id)
    assert h.scheduler.num_preemptions == 0


@pytest.mark.parametrize(("waiting", "waited_s", "expected"), [
    # The head R (job J1) may count the pins of the jobs that arrived after J1...
    ("", 0.0, ["J2", "J3"]),
    # ...and the pin of a job whose turn waits behind it...
    ("J0", 0.0, ["J0", "J2", "J3"]),
    # ...never its own job's, and a job's turn is never overdue: however long it waits,
    # an earlier job's pin is not counted.
    ("", 300.0, ["J2", "J3"]),
])
def test_the_pins_a_waiting_prompt_may_count(waiting: str, waited_s: float,
                                             expected: list[str]) -> None:
    policy = CONTINUUM.build()
    bind(policy, "a", "J0 J1 J2 J3", waiting_jobs=waiting)
    request = make_request("R", list(range(100)), job_id="J1", max_tokens=1)
    arrive(policy, request, now_s=10.0)
    reservation = policy.reservation(request, 0, 4, 10.0 + waited_s)
    assert sorted(pin.job_id for pin in reservation.pins) == expected
