"""Victim and pin-release choices of the agent policies' strategies, table-driven over a stub
scheduler."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from continuum.agent_policy import AgentPolicy
from continuum.presets import AUTELLIX, CONTINUUM, INFERCEPT
from engine.kv_cache.pins import Pin
from engine.request import Request, RequestStatus
from engine.scheduler import events
from engine.scheduler.policy import PolicyEnvironment
from engine.scheduler.request_queue import FCFSRequestQueue, RequestQueue
from eval.policy_variants import CONTINUUM_AF226D3
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
    num_host_kv_blocks: int = 0


def arrive(policy: AgentPolicy, request: Request, now_s: float) -> None:
    """Tells the bound policy that `request` arrived (its `RequestArrived` event)."""
    policy.learner.receive(events.RequestArrived(request, now_s))


def bind(
    policy: AgentPolicy,
    running: str,
    pins: str,
    pin_blocks: dict[str, int] | None = None,
    waiting_jobs: str = "",
) -> dict[str, Request]:
    """`running`: space-separated `id` or `id@job`, in admission order, each decoding unless
    its id ends in `~` (prefilling) or `!` (preempted `max_preemptions` = 3 times); `pins`:
    pinned jobs, in pin order; `waiting_jobs`: jobs with a turn waiting. Every job of JOBS
    arrived, in order, before any of these requests."""
    pin_blocks = pin_blocks or {}
    stub_pins = StubPins({
        job_id: Pin(job_id, f"{job_id}-prev", [None] * pin_blocks.get(job_id, 1),  # type: ignore[list-item]
                    pinned_at_s=float(index), ttl_s=10.0)
        for index, job_id in enumerate(pins.split())
    })
    queue = policy.new_waiting_queue()
    view = StubView([], stub_pins, queue)
    policy.learner = policy.bind(view)  # type: ignore[arg-type, attr-defined]
    for order, job_id in enumerate(JOBS):
        arrive(policy, make_request(f"{job_id}-first", [1], job_id=job_id), float(order))
    requests = {}
    for spec in running.split():
        request_id, _, job_id = spec.partition("@")
        request = make_request(request_id.rstrip("~!"), [1, 2, 3], job_id=job_id or None)
        request.num_computed_tokens = 0 if request_id.endswith("~") else 2
        request.num_preemptions = 3 if request_id.endswith("!") else 0
        request.status = RequestStatus.RUNNING
        arrive(policy, request, now_s=10.0)
        view.running.append(request)
        requests[request.request_id] = request
    for job_id in waiting_jobs.split():
        turn = make_request(f"{job_id}-next", [1, 2, 3], job_id=job_id)
        arrive(policy, turn, now_s=11.0)
        queue.add_request(turn)
    return requests


def describe(victim: Request | Pin | None) -> str | None:
    if victim is None:
        return None
    return f"pin:{victim.job_id}" if isinstance(victim, Pin) else victim.request_id


@pytest.mark.parametrize(("running", "pins", "waiting", "expected"), [
    # Pins go first, whoever runs: the latest job's first, its own job's last, and pins
    # whose job's turn waits to reuse them after the others.
    ("b R@J1 a@J2", "J2", "", "pin:J2"),
    ("a R c@J2", "J2", "", "pin:J2"),
    ("R", "J0 J3 J1", "", "pin:J3"),
    ("R", "J0 J3 J1", "J3", "pin:J1"),
    ("R@J1", "J1 J0", "", "pin:J0"),
    ("R@J1", "J1", "", "pin:J1"),
    # No pins: the most recently admitted request goes, whatever its job...
    ("R", "", "", "R"),
    ("a b R", "", "", "R"),
    ("a R c", "", "", "c"),
    ("c@J2 R@J1 a@J0", "", "", "a"),
    ("a@J0 R@J1", "", "", "R"),
    # ...unless it was preempted max_preemptions times and another can go.
    ("c@J2 R@J1 a!@J0", "", "", "R"),
    ("c@J2 R!@J1 a!@J0", "", "", "c"),
    # A prefilling request never preempts another: it waits while another decodes...
    ("a R~", "", "", None),
    ("a@J0 R~@J3", "", "", None),
    ("R~@J0 a@J2", "", "", None),
    # ...else yields its own blocks; pins still go first.
    ("a~ R~", "", "", "R"),
    ("a R~", "J0", "", "pin:J0"),
])
def test_continuum_victims(running: str, pins: str, waiting: str,
                           expected: str | None) -> None:
    policy = CONTINUUM.build()
    requests = bind(policy, running, pins, waiting_jobs=waiting)
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected


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
    policy = CONTINUUM_AF226D3.build()
    requests = bind(policy, running, pins)
    assert describe(policy.select_victim(requests[request_id], 0.0)) == expected


@pytest.mark.parametrize(("running", "pins", "blocks", "expected"), [
    ("a R", "", {}, "R"),  # no pins: FCFS
    ("a R", "J0 J1", {"J0": 3, "J1": 2}, "pin:J1"),  # least recompute first
    ("a R", "J0 J1", {"J0": 2, "J1": 2}, "pin:J0"),  # then the oldest
    ("a R@J1", "J0 J1", {"J0": 2, "J1": 2}, "pin:J0"),
    ("a R@J0", "J0 J1", {"J0": 2, "J1": 2}, "pin:J0"),  # its own job's not spared
])
def test_infercept_victims(running: str, pins: str, blocks: dict[str, int],
                           expected: str) -> None:
    policy = INFERCEPT.build()
    requests = bind(policy, running, pins, blocks)
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected


@pytest.mark.parametrize(("service", "running", "expected"), [
    ({}, "a b R", "R"),  # equal service: the youngest
    ({"J0": 50}, "a@J0 b R", "a"),
    ({"J0": 50, "J1": 80}, "a@J0 R@J1 c", "R"),
    ({"J0": 50, "J1": 80}, "R a@J0 c", "a"),
])
def test_autellix_preempts_the_most_served_job(
    service: dict[str, int], running: str, expected: str
) -> None:
    policy = AUTELLIX.build()
    requests = bind(policy, running, "")
    for job_id, num_tokens in service.items():
        policy.ledger.jobs.get(job_id).attained_service_tokens = num_tokens
    assert describe(policy.select_victim(requests["R"], 0.0)) == expected
