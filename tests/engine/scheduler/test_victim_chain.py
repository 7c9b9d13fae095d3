"""The victim chain's order and reasons, over a stub of tenants' shares and a stub policy;
the scheduler carrying them out is covered by the client pin, tenant and policy tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache.pins import Pin, PinReleaseReason
from engine.request import Request, RequestStatus
from engine.scheduler.step_plan import StepPlan
from engine.scheduler.victim_chain import Preempt, ReleasePin, Shortage, VictimChain
from tests.engine.helpers import make_request


def _pin(job_id: str, source: str = "policy") -> Pin:
    return Pin(job_id, f"{job_id}-prev", [], pinned_at_s=0.0, ttl_s=10.0,
               source=source)  # type: ignore[arg-type]


@dataclass
class StubShares:
    """What `Admission` would answer: each field the answer of its method."""

    over_share: Pin | None = None
    client: Pin | None = None
    share: Request | None = None
    instead: Request | None = None  # None: the policy's victim stands

    def over_share_pin(self, requester: Request, plan: StepPlan) -> Pin | None:
        return self.over_share

    def client_pin_for(self, requester: Request, num_new_tokens: int,
                       plan: StepPlan) -> Pin | None:
        return self.client

    def share_victim(self, request: Request, plan: StepPlan) -> Request | None:
        return self.share

    def victim_instead_of(self, victim: Request, requester: Request, num_new_tokens: int,
                          plan: StepPlan) -> Request:
        return victim if self.instead is None else self.instead


@dataclass
class StubPolicy:
    victim: Request | Pin | None = None

    def select_victim(self, request: Request, now_s: float) -> Request | Pin | None:
        return self.victim


def _running(request_id: str) -> Request:
    request = make_request(request_id, [1, 2, 3])
    request.status = RequestStatus.RUNNING
    return request


def _next(shares: StubShares, policy: StubPolicy, requester: Request,
          shortage: Shortage = "blocks") -> ReleasePin | Preempt | None:
    chain = VictimChain(shares, policy)  # type: ignore[arg-type]
    return chain.next(requester, 4, StepPlan(SchedulerConfig(max_model_len=64)), 0.0, shortage)


OVER, CLIENT, OWN = _pin("over"), _pin("client", "client"), _pin("own")
R, OTHER, LATEST = _running("R"), _running("other"), _running("latest")


@pytest.mark.parametrize(("shares", "policy", "expected"), [
    # A tenant over its share gives its pin first, then a client's pin, then the policy.
    (StubShares(OVER, CLIENT), StubPolicy(OWN), ReleasePin(OVER, PinReleaseReason.TENANT_SHARE)),
    (StubShares(None, CLIENT), StubPolicy(OWN),
     ReleasePin(CLIENT, PinReleaseReason.CLIENT_PRESSURE)),
    (StubShares(), StubPolicy(OWN), ReleasePin(OWN, PinReleaseReason.PRESSURE)),
    (StubShares(), StubPolicy(OTHER), Preempt(OTHER, "out_of_blocks")),
    # Tenants' shares replace the policy's victim, and say so.
    (StubShares(instead=LATEST), StubPolicy(OTHER), Preempt(LATEST, "tenant_share")),
    (StubShares(), StubPolicy(R), Preempt(R, "out_of_blocks")),
    (StubShares(), StubPolicy(None), None),
])
def test_a_running_request_short_of_blocks_takes_the_chain_in_order(
        shares: StubShares, policy: StubPolicy, expected: object) -> None:
    assert _next(shares, policy, R) == expected


def test_a_waiting_head_takes_pins_only_and_its_reserved_room_only_the_policys() -> None:
    head = make_request("head", [1, 2, 3])
    assert _next(StubShares(OVER), StubPolicy(OWN), head) == ReleasePin(
        OVER, PinReleaseReason.TENANT_SHARE)
    assert _next(StubShares(OVER, CLIENT), StubPolicy(OWN), head, "reserved_room") == (
        ReleasePin(OWN, PinReleaseReason.PRESSURE))
    assert _next(StubShares(OVER, CLIENT), StubPolicy(None), head, "reserved_room") is None
    with pytest.raises(RuntimeError, match="only pins give way to a waiting one"):
        _next(StubShares(), StubPolicy(OTHER), head)


def test_a_waiting_head_within_its_share_preempts_for_it_only_when_short_of_its_share() -> None:
    head = make_request("head", [1, 2, 3])
    assert _next(StubShares(OVER, share=LATEST), StubPolicy(OWN), head, "share") == (
        Preempt(LATEST, "tenant_share"))
    assert _next(StubShares(OVER), StubPolicy(OWN), head, "share") is None


def test_a_policy_victim_that_is_not_running_fails_loudly() -> None:
    with pytest.raises(RuntimeError, match="not running"):
        _next(StubShares(), StubPolicy(make_request("waiting", [1])), R)


def test_the_scheduler_asks_for_victims_in_one_place() -> None:
    import inspect

    from engine.scheduler import scheduler

    source = inspect.getsource(scheduler)
    assert source.count("_victim_chain.next(") == 1  # in Scheduler._give_way
    for bypass in ("select_victim", "over_share_pin", "client_pin_for", "share_victim(",
                   "victim_instead_of"):
        assert bypass not in source, f"the scheduler asks {bypass} outside the chain"
