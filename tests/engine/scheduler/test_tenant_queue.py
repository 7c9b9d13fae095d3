"""The waiting queue shared among tenants: one tenant's flood never keeps another's request
behind it, each tenant keeps its policy's order, and a server without tenants keeps its
policy's order exactly."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.scheduler.policies import PriorityPolicy
from engine.scheduler.request_queue import FCFSRequestQueue, KeyedRequestQueue, priority_order
from engine.scheduler.tenant_queue import TenantFairQueue
from tests.engine.helpers import FakeClock, FakeRunner, make_request, make_scheduler


def _request(request_id: str, tenant: str | None = None, **fields: object) -> Request:
    return make_request(request_id, [1, 2, 3], tenant=tenant, **fields)


def _admit_all(queue: TenantFairQueue) -> list[str]:
    """The ids in the order the scheduler would admit them, one at a time."""
    order = []
    while queue:
        request = queue.peek_request()
        queue.remove_admitted(request)
        order.append(request.request_id)
    return order


def test_the_iteration_order_is_the_admission_order():
    queue = TenantFairQueue(FCFSRequestQueue)
    for index in range(4):
        queue.add_request(_request(f"a{index}", "a"))
    queue.add_request(_request("b0", "b"))
    queue.add_request(_request("c0", "c"))
    queue.add_request(_request("b1", "b"))
    listed = [request.request_id for request in queue]
    assert listed == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert _admit_all(queue) == listed


def test_a_flooding_tenant_takes_turns_with_one_that_arrives_later():
    queue = TenantFairQueue(FCFSRequestQueue)
    for index in range(10):
        queue.add_request(_request(f"a{index}", "a"))
    for _ in range(3):
        queue.remove_admitted(queue.peek_request())
    # B starts level with A (three admissions each) and, admitted less recently, first.
    queue.add_request(_request("b0", "b"))
    assert _admit_all(queue)[:3] == ["b0", "a3", "a4"]


def test_a_tenant_banks_no_turns_while_it_sends_nothing():
    queue = TenantFairQueue(FCFSRequestQueue)
    queue.add_request(_request("b0", "b"))
    queue.remove_admitted(queue.peek_request())
    queue.advance_to(1.0)  # a step starts: B waits no more
    for index in range(6):
        queue.add_request(_request(f"a{index}", "a"))
    for _ in range(5):
        queue.remove_admitted(queue.peek_request())
    queue.advance_to(2.0)
    for index in range(1, 4):
        queue.add_request(_request(f"b{index}", "b"))
    # B's earlier admission does not count, nor do A's five: they take turns from here.
    assert _admit_all(queue) == ["b1", "a5", "b2", "b3"]


def test_a_preempted_request_goes_back_to_its_tenants_head_without_a_turn_back():
    queue = TenantFairQueue(FCFSRequestQueue)
    x = _request("x", "a")
    queue.add_request(x)
    for index in range(3):
        queue.add_request(_request(f"b{index}", "b"))
    queue.remove_admitted(queue.peek_request())   # x
    queue.remove_admitted(queue.peek_request())   # b0
    queue.advance_to(1.0)
    x.status = RequestStatus.PREEMPTED
    queue.prepend_request(x)
    # A is dropped once it had none waiting: it comes back level with B, and less recently
    # admitted.
    assert [request.request_id for request in queue] == ["x", "b1", "b2"]
    queue.add_request(_request("x2", "a"))
    assert [request.request_id for request in queue] == ["x", "b1", "x2", "b2"]


def test_leaving_without_admission_is_not_a_turn_and_empty_tenants_are_dropped():
    queue = TenantFairQueue(FCFSRequestQueue)
    a0, a1, b0 = _request("a0", "a"), _request("a1", "a"), _request("b0", "b")
    for request in (a0, a1, b0):
        queue.add_request(request)
    queue.remove_request(a0)     # aborted
    assert queue.peek_request() is a1
    queue.remove_requests([a1, b0, _request("never-queued", "b")])
    assert len(queue) == 0 and list(queue) == []
    queue.advance_to(1.0)
    assert queue._queues == {} and queue._num_admitted == {}


def test_without_tenants_the_policys_order_is_kept_exactly():
    fair = TenantFairQueue(lambda: KeyedRequestQueue(priority_order))
    plain = KeyedRequestQueue(priority_order)
    requests = [_request(f"r{index}", priority=index % 3, arrival_time_s=index)
                for index in range(9)]
    for request in requests:
        fair.add_request(request)
        plain.add_request(request)
    assert list(fair) == list(plain)
    preempted = fair.peek_request()
    fair.remove_admitted(preempted)
    plain.remove_request(preempted)
    fair.prepend_request(preempted)
    plain.prepend_request(preempted)
    assert list(fair) == list(plain)
    assert fair.num_waiting("none") == 0


def test_each_tenant_keeps_its_policys_order_and_its_jobs_are_counted():
    queue = TenantFairQueue(lambda: KeyedRequestQueue(priority_order))
    for request_id, tenant, priority in (("a-low", "a", 5), ("a-high", "a", 0),
                                         ("b-low", "b", 9), ("b-high", "b", 1)):
        queue.add_request(_request(request_id, tenant, priority=priority, job_id=tenant))
    assert _admit_all(queue) == ["a-high", "b-high", "a-low", "b-low"]
    queue.add_request(_request("a2", "a", job_id="a/job"))
    assert queue.num_waiting("a/job") == 1 and queue.num_waiting("b/job") == 0


def test_a_prompt_passed_over_keeps_its_tenants_turn():
    """Without chunked prefill a prompt that does not fit what is left of the step's budget
    is passed over; its tenant keeps its turn, so the next step admits it first."""
    scheduler = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64,
                               policy=PriorityPolicy())
    runner = FakeRunner(scheduler.block_size)
    for index in range(20):
        scheduler.add_request(make_request(f"b{index}", [index + 1] * 30, max_tokens=1,
                                           tenant="b"))
    scheduler.add_request(make_request("a0", [99] * 40, max_tokens=1, tenant="a"))
    for _ in range(3):
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
        scheduler.check_invariants()
        if "a0" in [request.req_id for request in output.scheduled_new_reqs]:
            return
    raise AssertionError("a0 was passed over three steps running")


def test_the_scheduler_admits_a_later_tenant_between_a_flooding_tenants_requests():
    """One request runs at a time: tenant B's request, queued after 20 of tenant A's, runs
    second, not twenty-first."""
    scheduler = make_scheduler(max_num_seqs=1, policy=PriorityPolicy(), clock=FakeClock())
    runner = FakeRunner(scheduler.block_size)
    for index in range(20):
        scheduler.add_request(make_request(f"a{index}", [1, 2, 3], max_tokens=1, tenant="a"))
    scheduler.add_request(make_request("b0", [4, 5, 6], max_tokens=1, tenant="b"))
    admitted: list[str] = []
    while len(admitted) < 4:
        output = scheduler.schedule()
        admitted += [request.req_id for request in output.scheduled_new_reqs]
        scheduler.update_from_output(output, runner.execute(output))
        scheduler.check_invariants()
    assert admitted[:3] == ["a0", "b0", "a1"]
