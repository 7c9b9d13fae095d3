"""Each tenant's share of the batch and the KV pool: a tenant within its share gets a slot
and blocks from a tenant over its own, is never preempted for it, and one tenant alone (or a
server without tenants) keeps everything as before."""

from __future__ import annotations

import pytest

from engine.request import Request, RequestStatus
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tenant_shares import TenantShares
from tests.engine.helpers import FakeRunner, make_request, make_scheduler


def _run(scheduler: Scheduler, runner: FakeRunner, num_steps: int) -> list[str]:
    """Runs `num_steps` steps (checking the invariants after each); the ids admitted, in
    order."""
    admitted: list[str] = []
    for _ in range(num_steps):
        output = scheduler.schedule()
        admitted += [request.req_id for request in output.scheduled_new_reqs]
        scheduler.update_from_output(output, runner.execute(output))
        scheduler.check_invariants()
    return admitted


def _flood(scheduler: Scheduler, tenant: str | None, count: int, *, prompt_len: int = 8,
           max_tokens: int = 40) -> list[Request]:
    """`count` requests of `tenant`, with prompts that share no block."""
    requests = [make_request(f"{tenant}{index}",
                             [100 * index + position for position in range(prompt_len)],
                             max_tokens=max_tokens, tenant=tenant) for index in range(count)]
    for request in requests:
        scheduler.add_request(request)
    return requests


def test_a_tenant_within_its_share_takes_a_batch_slot_from_one_over_its_share():
    scheduler = make_scheduler(max_num_seqs=4, num_blocks=256, max_model_len=128)
    runner = FakeRunner(scheduler.block_size)
    flood = _flood(scheduler, "a", 8)
    _run(scheduler, runner, 2)
    assert [request.status for request in flood[:4]] == [RequestStatus.RUNNING] * 4
    scheduler.add_request(make_request("b0", [99] * 8, max_tokens=40, tenant="b"))
    assert _run(scheduler, runner, 1) == ["b0"]
    # The latest admitted of the tenant over its share (2 of 4 slots) gave its place.
    assert flood[3].status is RequestStatus.PREEMPTED and flood[3].num_preemptions == 1
    assert {request.request_id for request in scheduler.running} == {"a0", "a1", "a2", "b0"}


@pytest.mark.parametrize(("late_tenant", "admitted"), [("b", True), ("a", False)])
def test_a_tenant_within_its_share_takes_blocks_from_one_over_its_share(late_tenant, admitted):
    # 24 blocks of 4 tokens: six requests of 12 + 4 tokens fit, with no room for a seventh.
    scheduler = make_scheduler(num_blocks=24, max_model_len=64)
    runner = FakeRunner(scheduler.block_size)
    flood = _flood(scheduler, "a", 6, prompt_len=12, max_tokens=4)
    _run(scheduler, runner, 2)
    assert len(scheduler.running) == 6
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks < 3  # the late prompt needs 3
    scheduler.add_request(make_request("late", [999] * 12, max_tokens=4, tenant=late_tenant))
    assert ("late" in _run(scheduler, runner, 1)) is admitted
    assert scheduler.num_preemptions == (1 if admitted else 0)
    if admitted:
        assert flood[-1].status is RequestStatus.PREEMPTED


def test_a_tenant_within_its_share_is_admitted_in_steps_that_preempt_for_memory():
    """A's requests fill the pool and preempt one another to grow, step after step: no
    step admits for memory, but B's request, within its share, still gets its turn."""
    scheduler = make_scheduler(num_blocks=24, max_model_len=64)
    runner = FakeRunner(scheduler.block_size)
    _flood(scheduler, "a", 8, prompt_len=15)
    _run(scheduler, runner, 2)  # the third step preempts one of A's for another's block
    num_preemptions = scheduler.num_preemptions
    scheduler.add_request(make_request("b0", [999] * 8, max_tokens=4, tenant="b"))
    output = scheduler.schedule()
    assert scheduler.num_preemptions > num_preemptions
    assert "b0" in [request.req_id for request in output.scheduled_new_reqs]
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.check_invariants()


def test_each_request_of_a_tenant_within_its_share_takes_a_slot_in_one_step():
    """B sends two requests while A's flood fills the batch: both get a slot at once, the
    second not held behind A's next request (which could take no share back)."""
    scheduler = make_scheduler(max_num_seqs=4, num_blocks=256, max_model_len=128)
    runner = FakeRunner(scheduler.block_size)
    _flood(scheduler, "a", 10)
    _run(scheduler, runner, 2)
    for index in range(2):
        scheduler.add_request(make_request(f"b{index}", [900 + index] * 8, max_tokens=30,
                                           tenant="b"))
    assert sorted(_run(scheduler, runner, 1)) == ["b0", "b1"]


@pytest.mark.parametrize(("num_flood", "flood_prompt_len", "warm_steps", "late_prompt_len"), [
    (6, 8, 4, 8),    # B's request admitted into a pool that A's requests keep growing into
    (4, 7, 2, 8),    # B's only request is the latest admitted, and needs blocks itself
])
def test_a_running_request_within_its_share_takes_blocks_from_a_tenant_over_its_own(
        num_flood, flood_prompt_len, warm_steps, late_prompt_len):
    """In a full pool, FCFS would preempt B's request (the latest admitted) or have it
    preempt itself; A, over its share, gives up its latest instead, every time."""
    scheduler = make_scheduler(num_blocks=24, max_model_len=64)
    runner = FakeRunner(scheduler.block_size)
    flood = _flood(scheduler, "a", num_flood, prompt_len=flood_prompt_len, max_tokens=50)
    _run(scheduler, runner, warm_steps)
    late = make_request("b0", [999] * late_prompt_len, max_tokens=30, tenant="b")
    scheduler.add_request(late)
    for _ in range(60):
        _run(scheduler, runner, 1)
        if late.status.is_finished:
            break
    assert late.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert late.num_preemptions == 0
    assert sum(request.num_preemptions for request in flood) >= 1


def test_one_tenant_alone_or_no_tenants_keeps_the_policys_victims_and_waits():
    for tenant in ("a", None):
        scheduler = make_scheduler(max_num_seqs=4, num_blocks=256, max_model_len=128)
        runner = FakeRunner(scheduler.block_size)
        _flood(scheduler, tenant, 4)
        _run(scheduler, runner, 2)
        scheduler.add_request(make_request("late", [99] * 8, max_tokens=4, tenant=tenant))
        assert _run(scheduler, runner, 3) == []
        assert scheduler.num_preemptions == 0


def test_a_tenant_that_would_pass_its_share_waits():
    scheduler = make_scheduler(max_num_seqs=4, num_blocks=256, max_model_len=128)
    runner = FakeRunner(scheduler.block_size)
    _flood(scheduler, "a", 2)
    _flood(scheduler, "b", 2)
    _run(scheduler, runner, 2)
    scheduler.add_request(make_request("b-late", [99] * 8, max_tokens=4, tenant="b"))
    assert _run(scheduler, runner, 3) == []
    assert scheduler.num_preemptions == 0


def _shares(running: list[Request], waiting: list[str | None], num_blocks: dict[str, int],
            *, max_num_seqs: int = 4, num_kv_blocks: int = 100,
            admitted_now: frozenset[str] | set[str] = frozenset()) -> TenantShares:
    return TenantShares.measure(running, waiting, lambda r: num_blocks[r.request_id],
                                max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
                                admitted_now=admitted_now)


def test_shares_count_sequences_and_blocks_of_running_and_waiting_tenants():
    a0, a1, b0 = (make_request(rid, [1], tenant=rid[0]) for rid in ("a0", "a1", "b0"))
    waiting_c = make_request("c0", [1] * 8, tenant="c")
    shares = _shares([a0, a1, b0], ["c"], {"a0": 40, "a1": 30, "b0": 5}, max_num_seqs=6)
    assert (shares.num_tenants, shares.share_seqs) == (3, 2.0)
    assert shares.excess("a") == 70 / (100 / 3) - 1
    assert shares.excess("b") < 0 and shares.excess("c") == -1
    assert shares.most_over(excluding="c") == "a"
    assert shares.victim_for_waiting(waiting_c, 2) is a1
    # Over its block share with one more request: it waits.
    assert shares.victim_for_waiting(waiting_c, 34) is None
    # Over its share, but under it without its latest request: that request stays.
    tipping = _shares([a0, a1, b0], ["c"], {"a0": 10, "a1": 60, "b0": 5}, max_num_seqs=6)
    assert tipping.excess("a") > 0 and tipping.victim_for_waiting(waiting_c, 2) is None
    # The policy's victim of a tenant within its share is replaced; one over it stands.
    assert shares.victim_instead_of(b0, waiting_c, 1) is a1
    assert shares.victim_instead_of(a0, b0, 1) is a0
    assert shares.victim_instead_of(a0, a1, 1) is a0  # within a tenant, the policy's
    assert shares.victim_instead_of(b0, b0, 1) is a1  # not b0's own: a is over its share
    # No tenant over its share: a requester whose tenant would pass its own gives way.
    even = _shares([a0, b0], [], {"a0": 50, "b0": 40}, max_num_seqs=6)
    assert even.victim_instead_of(b0, a0, 1) is a0
    assert even.victim_instead_of(a0, b0, 10) is a0
    assert even.victim_instead_of(a0, b0, 11) is b0


def test_a_request_admitted_in_the_step_being_planned_is_not_a_victim():
    a0, a1 = (make_request(rid, [1], tenant="a") for rid in ("a0", "a1"))
    waiting_b = make_request("b0", [1], tenant="b")
    shares = _shares([a0, a1], ["b"], {"a0": 1, "a1": 1}, max_num_seqs=2,
                     admitted_now={"a1"})
    assert shares.victim_for_waiting(waiting_b, 1) is a0
    assert _shares([a0, a1], ["b"], {"a0": 1, "a1": 1}, max_num_seqs=2,
                   admitted_now={"a0", "a1"}).victim_for_waiting(waiting_b, 1) is None
