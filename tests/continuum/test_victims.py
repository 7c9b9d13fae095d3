"""Victim and pin-release choices of the agent policies, table-driven over a stub scheduler."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from continuum.af226d3 import ContinuumAf226d3Policy
from continuum.baselines import AutellixPolicy, InferCeptPolicy
from continuum.job_aware import JobAwarePolicy
from continuum.options import ContinuumAf226d3Options, ContinuumOptions, ProgramOrderOptions
from continuum.policy import ContinuumPolicy
from continuum.program_order import JobFCFSPolicy
from engine.kv_cache.pins import Pin
from engine.request import Request
from engine.scheduler.policy import PolicyEnvironment
from engine.scheduler.request_queue import FCFSRequestQueue, RequestQueue
from estimator.base import ConstantTTLEstimator
from estimator.solver import DurationCDF, PinValue
from tests.continuum.harness import Harness, tokens
from tests.engine.helpers import make_request

JOBS = ("J0", "J1", "J2", "J3")  # first arrivals in this order


@dataclass
class StubPins:
    pins: dict[str, Pin] = field(default_factory=dict)

    def get(self, job_id: str) -> Pin | None:
        return self.pins.get(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.pins

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self.pins.values()))

    def __len__(self) -> int:
        return len(self.pins)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(pin.num_blocks for pin in self.pins.values())


@dataclass
class StubView:
    running: list[Request]
    pins: StubPins
    waiting: RequestQueue = field(default_factory=FCFSRequestQueue)
    environment: PolicyEnvironment = field(default_factory=PolicyEnvironment)
    num_kv_blocks: int = 64
    block_size: int = 4


def bind(
    policy: JobAwarePolicy,
    running: str,
    pins: str,
    pin_blocks: dict[str, int] | None = None,
    waiting_jobs: str = "",
) -> dict[str, Request]:
    """`running`: space-separated `id` or `id@job`, in admission order, each decoding unless
    its id ends in `~` (prefilling) or `!` (preempted `max_preemptions` = 3 times); `pins`:
    pinned jobs, in pin order; `waiting_jobs`: jobs with a turn waiting. Every job of JOBS
    arrived, in order, before any of these requests."""
    for order, job_id in enumerate(JOBS):
        policy.on_request_arrived(make_request(f"{job_id}-first", [1], job_id=job_id), order)
    requests = {}
    for spec in running.split():
        request_id, _, job_id = spec.partition("@")
        request = make_request(request_id.rstrip("~!"), [1, 2, 3], job_id=job_id or None)
        request.num_computed_tokens = 0 if request_id.endswith("~") else 2
        request.num_preemptions = 3 if request_id.endswith("!") else 0
        policy.on_request_arrived(request, now_s=10.0)
        requests[request.request_id] = request
    pin_blocks = pin_blocks or {}
    stub_pins = StubPins({
        job_id: Pin(job_id, f"{job_id}-prev", [None] * pin_blocks.get(job_id, 1),  # type: ignore[list-item]
                    pinned_at_s=float(index), ttl_s=10.0)
        for index, job_id in enumerate(pins.split())
    })
    queue = policy.new_waiting_queue()
    policy.bind(StubView(list(requests.values()), stub_pins, queue))  # type: ignore[arg-type]
    for job_id in waiting_jobs.split():
        turn = make_request(f"{job_id}-next", [1, 2, 3], job_id=job_id)
        policy.on_request_arrived(turn, now_s=11.0)
        queue.add_request(turn)
    return requests


def describe(victim: Request | Pin | None) -> str | None:
    if victim is None:
        return None
    return f"pin:{victim.job_id}" if isinstance(victim, Pin) else victim.request_id


@pytest.mark.parametrize(("running", "pins", "waiting", "expected"), [
    # victim_order=latest-job. No pins: the running request of the job that arrived latest
    # (a request without a job: its own arrival), possibly the one that needs blocks.
    ("a b R", "", "", "R"),
    ("a R c", "", "", "c"),
    ("a@J0 R@J1 c@J2", "", "", "c"),
    ("c@J2 R@J1 a@J0", "", "", "c"),
    ("b R@J1 a@J0", "", "", "b"),  # b has no job: its own arrival is after J0..J3's
    # Pins go first, whoever runs: the latest job's first, its own job's last, and pins
    # whose job's turn waits to reuse them after the others.
    ("b R@J1 a@J2", "J2", "", "pin:J2"),
    ("a R c@J2", "J2", "", "pin:J2"),
    ("R", "J0 J3 J1", "", "pin:J3"),
    ("R", "J0 J3 J1", "J3", "pin:J1"),
    ("R@J1", "J1 J0", "", "pin:J0"),
    ("R@J1", "J1", "", "pin:J1"),
    ("R", "", "", "R"),
    # A prefilling request never preempts another: it waits while another decodes...
    ("a R~", "", "", None),
    ("a@J0 R~@J3", "", "", None),
    # ...else yields its own blocks; pins still go first.
    ("a~ R~", "", "", "R"),
    ("a R~", "J0", "", "pin:J0"),
    # A request preempted max_preemptions times is spared while another can go.
    ("R@J0 c!@J2 a@J1", "", "", "a"),
    ("R!@J0 c!@J2", "", "", "c"),
])
def test_continuum_victims(running: str, pins: str, waiting: str,
                           expected: str | None) -> None:
    policy = ContinuumPolicy(ContinuumOptions(victim_order="latest-job"))
    requests = bind(policy, running, pins, waiting_jobs=waiting)
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected


@pytest.mark.parametrize(("now_s", "expected"), [
    # J1 called a tool that takes 1 s or 30 s, J2 one that always takes 1 s; both pinned at
    # time 1 (one block each). At 1.5 s J1's pin is expected to be held far longer for the
    # same saving: it goes first, though J2 arrived later.
    (1.5, "pin:J1"),
    # At 2.5 s J1's call is known to be the 30 s kind, and J2's pin has outlived every
    # duration its tool has shown: it is worth nothing more and goes first.
    (2.5, "pin:J2"),
])
def test_lowest_value_releases_the_pin_expected_to_save_least_per_block_second(
        now_s: float, expected: str) -> None:
    policy = ContinuumPolicy(ContinuumOptions(pin_release_order="lowest-value"))
    requests = bind(policy, "R@J0", "J1 J2")
    values = {"J1": PinValue(4.0, 30.0, DurationCDF((1.0, 30.0), (0.5, 1.0))),
              "J2": PinValue(4.0, 30.0, DurationCDF((1.0,), (1.0,)))}
    for pin in policy.scheduler.pins:
        pin.pinned_at_s = 1.0
        job = policy.jobs.get(pin.job_id)
        assert job is not None
        job.pin_value = values[pin.job_id]
    assert describe(policy.select_victim(requests["R"], now_s)) == expected
    latest_job = ContinuumPolicy(ContinuumOptions())
    assert describe(latest_job.select_victim(bind(latest_job, "R@J0", "J1 J2")["R"],
                                             now_s)) == "pin:J2"


@pytest.mark.parametrize(("running", "pins", "head_job", "waited_s", "expected"), [
    ("", "", None, 0.0, None),
    ("", "J0 J2 J1", None, 0.0, "pin:J2"),  # nothing runs: latest job first
    ("", "J0 J2 J1", "J2", 0.0, "pin:J1"),  # the head's own job's pin last
    ("", "J2", "J2", 0.0, "pin:J2"),
    # With pin_yield=later-jobs, while others run, pins of jobs that arrived after the
    # head's job yield at once...
    ("a", "J1 J2", "J0", 0.0, "pin:J2"),
    ("a", "J0 J2", "J1", 0.0, "pin:J2"),
    # ...those of earlier jobs once the head has waited pin_yield_wait_s (here 5 s), latest
    # job first; the head's own job's pin is kept.
    ("a", "J0 J1", "J1", 0.0, None),
    ("a", "J0 J1", None, 4.9, None),  # a request without a job arrived after J0..J3
    ("a", "J0 J1", None, 5.0, "pin:J1"),
    ("a", "J0 J1", "J1", 5.0, "pin:J0"),
    ("a", "J1", "J1", 60.0, None),
])
def test_continuum_pins_for_admission(
    running: str, pins: str, head_job: str | None, waited_s: float, expected: str | None
) -> None:
    policy = ContinuumPolicy(ContinuumOptions(pin_yield_wait_s=5.0, pin_yield="later-jobs"))
    bind(policy, running, pins)
    head = make_request("head", [1, 2, 3], job_id=head_job)
    policy.on_request_arrived(head, now_s=20.0)
    assert describe(policy.select_pin_to_release(head, 20.0 + waited_s)) == expected


@pytest.mark.parametrize(("running", "pins", "request_id", "expected"), [
    # Requests without a job: the latest arrival, possibly the one that needs blocks.
    ("a b R", "", "R", "R"),
    ("a R c", "", "R", "c"),
    # The job that arrived latest, whatever the admission order.
    ("a@J0 R@J1 c@J2", "", "R", "c"),
    ("c@J2 R@J1 a@J0", "", "R", "c"),
    ("b R@J1 a@J0", "", "R", "b"),  # b has no job: its own arrival is after J0..J3's
    # Requests of jobs holding a pin are passed over while others remain.
    ("b R@J1 a@J2", "J2", "R", "b"),
    ("a@J2 b R@J1", "J2", "R", "b"),
    ("R@J1 b a@J2", "J2", "R", "b"),
    # The needy request would preempt itself: pins go first, the latest job's first.
    ("a R c@J2", "J2", "R", "pin:J2"),
    ("b a@J2 R", "J2", "R", "pin:J2"),
    ("a@J0 R", "J0", "R", "pin:J0"),
    ("R", "J0 J3 J1", "R", "pin:J3"),
    ("R@J1", "J1 J0", "R", "pin:J0"),  # its own job's pin last
    ("R@J1", "J1", "R", "pin:J1"),
    ("R", "", "R", "R"),
    # Every running request's job holds a pin: the latest job's request, after pins.
    ("a@J0 R@J1", "J0 J1", "R", "pin:J0"),
    ("R@J0 a@J1", "J0 J1", "R", "a"),
])
def test_continuum_af226d3_victims(running: str, pins: str, request_id: str,
                                   expected: str) -> None:
    policy = ContinuumAf226d3Policy()
    requests = bind(policy, running, pins)
    assert describe(policy.select_victim(requests[request_id], 0.0)) == expected


@pytest.mark.parametrize(("running", "pins", "head_job", "waited_s", "expected"), [
    ("", "", None, 0.0, None),
    ("", "J0 J2 J1", None, 0.0, "pin:J2"),  # latest job first
    ("", "J0 J2 J1", "J2", 0.0, "pin:J1"),  # the head's own job's pin last
    ("", "J2", "J2", 0.0, "pin:J2"),
    # While others run, pins yield once the head has waited pin_yield_wait_s (here 5 s),
    # latest job first; the head's own job's pin is kept.
    ("a", "J0 J1", None, 4.9, None),
    ("a", "J0 J1", None, 5.0, "pin:J1"),
    ("a", "J0 J1", "J1", 5.0, "pin:J0"),
    ("a", "J1", "J1", 60.0, None),
])
def test_continuum_af226d3_pins_for_admission(
    running: str, pins: str, head_job: str | None, waited_s: float, expected: str | None
) -> None:
    policy = ContinuumAf226d3Policy(ContinuumAf226d3Options(pin_yield_wait_s=5.0))
    bind(policy, running, pins)
    head = make_request("head", [1, 2, 3], job_id=head_job)
    policy.on_request_arrived(head, now_s=20.0)
    assert describe(policy.select_pin_to_release(head, 20.0 + waited_s)) == expected


@pytest.mark.parametrize(("running", "pins", "blocks", "head_job", "expected"), [
    ("a R", "", {}, None, "R"),  # no pins: FCFS
    ("a R", "J0 J1", {"J0": 3, "J1": 2}, None, "pin:J1"),  # least recompute first
    ("a R", "J0 J1", {"J0": 2, "J1": 2}, None, "pin:J0"),  # then the oldest
])
def test_infercept_victims(
    running: str, pins: str, blocks: dict[str, int], head_job: str | None, expected: str
) -> None:
    policy = InferCeptPolicy()
    requests = bind(policy, running, pins, blocks)
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected


@pytest.mark.parametrize(("pins", "blocks", "head_job", "expected"), [
    ("J0 J1", {"J0": 3, "J1": 2}, None, "pin:J1"),
    ("J0 J1", {"J0": 3, "J1": 2}, "J1", "pin:J0"),  # the head's own job last
    ("", {}, None, None),
])
def test_infercept_releases_pins_for_admission_even_while_others_run(
    pins: str, blocks: dict[str, int], head_job: str | None, expected: str | None
) -> None:
    policy = InferCeptPolicy()
    bind(policy, "a b", pins, blocks)
    head = make_request("head", [1, 2, 3], job_id=head_job)
    assert describe(policy.select_pin_to_release(head, 10.0)) == expected


@pytest.mark.parametrize(("service", "running", "expected"), [
    ({}, "a b R", "R"),  # equal service: the youngest
    ({"J0": 50}, "a@J0 b R", "a"),
    ({"J0": 50, "J1": 80}, "a@J0 R@J1 c", "R"),
    ({"J0": 50, "J1": 80}, "R a@J0 c", "a"),
])
def test_autellix_preempts_the_most_served_job(
    service: dict[str, int], running: str, expected: str
) -> None:
    policy = AutellixPolicy()
    requests = bind(policy, running, "")
    for job_id, num_tokens in service.items():
        policy.jobs.get(job_id).attained_service_tokens = num_tokens
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected


@pytest.mark.parametrize(("options", "running", "pins", "expected"), [
    # pin_victims=last: running requests of later jobs go before pins...
    ({"pin_victims": "last"}, "R@J0 a@J2", "J1", "a"),
    # ...and pins only before the request would preempt itself or wait.
    ({"pin_victims": "last"}, "a@J0 R@J2", "J1", "pin:J1"),
    ({"pin_victims": "last"}, "a@J0 R~@J2", "J1", "pin:J1"),
    # prefill_victims=later-jobs: a prefilling request preempts like a decoding one.
    ({"prefill_victims": "later-jobs"}, "R~@J0 a@J2", "", "a"),
    ({}, "R~@J0 a@J2", "", None),
])
def test_continuum_victim_options(options: dict, running: str, pins: str,
                                  expected: str | None) -> None:
    policy = ContinuumPolicy(ContinuumOptions(**options))
    requests = bind(policy, running, pins)
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected


@pytest.mark.parametrize(("pin_yield", "expected"), [("later-jobs", "pin:J2"), ("overdue", None)])
def test_continuum_pin_yield_option(pin_yield: str, expected: str | None) -> None:
    policy = ContinuumPolicy(ContinuumOptions(pin_yield=pin_yield, pin_yield_wait_s=5.0))
    bind(policy, "a", "J2")
    head = make_request("head", [1, 2, 3], job_id="J0")
    policy.on_request_arrived(head, now_s=20.0)
    assert describe(policy.select_pin_to_release(head, 20.0)) == expected


@pytest.mark.parametrize(("running", "expected"), [
    # By default the most recently admitted request goes, whatever its job...
    ("c@J2 R@J1 a@J0", "a"),
    ("a@J0 R@J1", "R"),
    # ...unless it was preempted max_preemptions times and another can go.
    ("c@J2 R@J1 a!@J0", "R"),
    ("c@J2 R!@J1 a!@J0", "c"),
])
def test_continuum_victims_latest_admitted_first(running: str, expected: str) -> None:
    policy = ContinuumPolicy()
    requests = bind(policy, running, "")
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected


@pytest.mark.parametrize(("options", "prompt_len", "num_preemptions"), [
    # "b" (10 blocks) cannot fit whole: started at once, it stalls halfway and "a"'s growth
    # preempts it (its computed tokens recomputed); held back until its blocks are there,
    # it never stalls.
    ({"prefill_admission": "first-chunk"}, 40, 1),
    ({"prefill_admission": "whole-prompt"}, 40, 0),
    # "b" (9 blocks) fits whole exactly: it starts, and "a"'s next block preempts it; with a
    # block of headroom per running request, it waits for "a" to finish instead.
    ({"admission_headroom_blocks": 0}, 36, 1),
    ({"admission_headroom_blocks": 1}, 36, 0),
])
def test_a_prompt_starts_only_when_it_will_not_be_preempted_halfway(
        options: dict, prompt_len: int, num_preemptions: int) -> None:
    # 16 blocks of 4 tokens, 8 tokens a step. "a" decodes to 48 tokens (12 blocks); "b"
    # arrives while "a" holds 7 and 9 are free.
    policy = JobFCFSPolicy(ProgramOrderOptions(**options))
    h = Harness(policy, num_blocks=16, max_num_batched_tokens=8)
    h.add("a", tokens(0, 24), max_tokens=24)
    h.step(4)
    assert len(h.scheduler.kv_cache_manager.get_block_ids("a")) == 7
    h.add("b", tokens(100, prompt_len), max_tokens=2)
    h.run_until_finished("a", "b")
    assert h.scheduler.num_preemptions == num_preemptions
    assert (h.scheduler.recomputed_tokens > 0) == (num_preemptions > 0)
    assert h.admission_order()[1:] == ["b"] * (1 + num_preemptions)


@pytest.mark.parametrize(("reservable_pins", "job", "starts_at_once"), [
    # A later job's long prompt does not start on an earlier job's pinned memory...
    ("later-jobs", "C", False),
    ("other-jobs", "C", True),
    # ...an earlier job's does: pressure would take the later job's pin for its chunks.
    ("later-jobs", "X", True),
])
def test_a_waiting_prompt_counts_only_the_pins_it_may_take(
        reservable_pins: str, job: str, starts_at_once: bool) -> None:
    # Jobs arrive X, A, B; 24 blocks of 4 tokens. A's turn ends pinned (7 blocks) while B
    # decodes; then a 60-token prompt (15 blocks) of job `job` needs A's pinned blocks.
    policy = ContinuumPolicy(ContinuumOptions(reservable_pins=reservable_pins),
                             estimator=ConstantTTLEstimator(100.0))
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


@pytest.mark.parametrize(("reservable_pins", "holds", "waiting", "expected"), [
    # The head R (job J1) may count the pins of the jobs that arrived after J1...
    ("later-jobs", "", "", ["J2", "J3"]),
    # ...another job's hold of a waiting turn's prefix, never its own job's...
    ("later-jobs", "J0", "", ["J0", "J2", "J3"]),
    ("later-jobs", "J1", "", ["J2", "J3"]),
    # ...and the pin of a job whose turn waits behind it...
    ("later-jobs", "", "J0", ["J0", "J2", "J3"]),
    # ...or, as before, every other job's pin.
    ("other-jobs", "", "", ["J0", "J2", "J3"]),
])
def test_the_pins_a_waiting_prompt_may_count(reservable_pins: str, holds: str, waiting: str,
                                             expected: list[str]) -> None:
    policy = ContinuumPolicy(ContinuumOptions(reservable_pins=reservable_pins))
    bind(policy, "", "J0 J1 J2 J3", waiting_jobs=waiting)
    for job_id in holds.split():
        policy.scheduler.pins.pins[job_id].holds_waiting_turn = True
    request = make_request("R", [1, 2, 3], job_id="J1")
    policy.on_request_arrived(request, now_s=10.0)
    assert sorted(pin.job_id for pin in policy.reservable_pins(request, 10.0)) == expected
