"""Pins count toward their tenant's share of the KV pool: while tenants compete a tenant's
pins hold at most its share, and another tenant's request short of blocks takes the pins of
a tenant over its share before anything the policy would give up."""

from __future__ import annotations

from engine.kv_cache.pins import PinReleaseReason
from engine.scheduler.scheduler import Scheduler
from tests.engine.helpers import FakeRunner, PinningPolicy, make_request, make_scheduler


def _step(scheduler: Scheduler, runner: FakeRunner) -> list[str]:
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.check_invariants()
    return [request.req_id for request in output.scheduled_new_reqs]


def _pinned_blocks(scheduler: Scheduler, tenant: str) -> int:
    return sum(pin.num_blocks for pin in scheduler.pins if pin.tenant == tenant)


def _pin_jobs(scheduler: Scheduler, runner: FakeRunner, tenant: str, count: int) -> None:
    """`count` one-turn jobs of `tenant` (16-token prompts, 4 blocks each), run until pinned."""
    for index in range(count):
        scheduler.add_request(make_request(f"{tenant}-job{index}",
                                           [1000 * (index + 1) + t for t in range(16)],
                                           max_tokens=2, job_id=f"{tenant}-j{index}",
                                           tenant=tenant))
    while any(request.tenant == tenant and request.job_id is not None
              for request in scheduler.requests.values()):
        _step(scheduler, runner)


def _competing() -> tuple[Scheduler, FakeRunner]:
    """A 48-block pool whose tenant "victim" is decoding a long request."""
    scheduler = make_scheduler(num_blocks=48, block_size=4, max_model_len=64,
                               policy=PinningPolicy(ttl_s=1000.0))
    runner = FakeRunner(4)
    scheduler.add_request(make_request("victim", [7] * 8, max_tokens=60, tenant="victim"))
    _step(scheduler, runner)
    return scheduler, runner


def test_a_tenants_pins_hold_at_most_its_share_while_tenants_compete() -> None:
    scheduler, runner = _competing()
    _pin_jobs(scheduler, runner, "attacker", 9)  # 9 x 4 blocks wanted, 24 the share
    assert 0 < _pinned_blocks(scheduler, "attacker") <= 48 / 2
    # The oldest went to make room for the newest, as the trace names it.
    assert set(scheduler.pins.num_released) == {PinReleaseReason.TENANT_SHARE}


def test_pins_that_share_a_prefix_count_its_blocks_once() -> None:
    scheduler, runner = _competing()
    # Nine jobs with one 12-token system prompt: pins of 4 blocks each, 3 of them shared.
    for index in range(9):
        own = 1000 * (index + 1)
        scheduler.add_request(make_request(
            f"agent-job{index}", [*range(500, 512), *range(own, own + 4)],
            max_tokens=2, job_id=f"agent-j{index}", tenant="agents"))
    while any(request.tenant == "agents" for request in scheduler.requests.values()):
        _step(scheduler, runner)
    assert _pinned_blocks(scheduler, "agents") == 9 * 4  # over the share of 24, if summed
    assert scheduler.pins.num_tenant_blocks("agents") == 3 + 9
    assert not scheduler.pins.num_released  # within the share: no pin was released
    assert scheduler.pins.num_pinned_blocks == 3 + 9


def test_one_tenant_alone_pins_as_its_policy_says() -> None:
    scheduler = make_scheduler(num_blocks=48, block_size=4, max_model_len=64,
                               policy=PinningPolicy(ttl_s=1000.0))
    runner = FakeRunner(4)
    _pin_jobs(scheduler, runner, "attacker", 9)
    assert _pinned_blocks(scheduler, "attacker") == 9 * 4
    assert not scheduler.pins.num_released


def test_a_blocked_request_takes_pins_of_a_tenant_over_its_share_first() -> None:
    # Alone, the attacker pinned 24 of 32 blocks and keeps one request decoding; the policy
    # (FCFS) would release pins for a waiting request only once nothing runs.
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_model_len=64,
                               policy=PinningPolicy(ttl_s=1000.0))
    runner = FakeRunner(4)
    _pin_jobs(scheduler, runner, "attacker", 6)
    scheduler.add_request(make_request("busy", [5] * 4, max_tokens=50, tenant="attacker"))
    _step(scheduler, runner)
    assert _pinned_blocks(scheduler, "attacker") == 24
    scheduler.add_request(make_request("victim", [9] * 28, max_tokens=2, tenant="victim"))
    assert _step(scheduler, runner) == ["victim"]
    assert 0 < _pinned_blocks(scheduler, "attacker") < 24
    assert "busy" in {request.request_id for request in scheduler.running}
    assert set(scheduler.pins.num_released) == {PinReleaseReason.TENANT_SHARE}


def test_the_pin_cap_holds_while_the_other_tenant_is_between_requests() -> None:
    scheduler = make_scheduler(num_blocks=48, block_size=4, max_model_len=64,
                               policy=PinningPolicy(ttl_s=1000.0))
    runner = FakeRunner(4)
    scheduler.add_request(make_request("victim", [7] * 8, max_tokens=2, tenant="victim"))
    while scheduler.has_unfinished_requests():
        _step(scheduler, runner)
    _pin_jobs(scheduler, runner, "attacker", 9)  # the victim waits for a tool meanwhile
    assert 0 < _pinned_blocks(scheduler, "attacker") <= 48 / 2
