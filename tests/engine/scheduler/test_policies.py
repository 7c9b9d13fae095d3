import pytest

from engine.scheduler.policies import FCFSPolicy, PriorityPolicy
from engine.scheduler.registry import POLICY_REGISTRY, make_policy, resolve_policy_class
from engine.scheduler.request_queue import FCFSRequestQueue, PriorityRequestQueue
from tests.engine.helpers import FakeRunner, make_request, make_scheduler, run_step


def waiting_ids(scheduler) -> list[str]:
    return [request.request_id for request in scheduler.waiting]


def test_fcfs_queue_orders_by_arrival_and_prepends_preempted() -> None:
    queue = FCFSRequestQueue()
    a, b, c = (make_request(name, [1]) for name in "abc")
    queue.add_request(a)
    queue.add_request(b)
    queue.prepend_request(c)
    assert [r.request_id for r in queue] == ["c", "a", "b"]
    queue.remove_request(a)
    queue.remove_request(c)
    assert queue.peek_request() is b
    queue.remove_requests([b])
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.peek_request()


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    queue = PriorityRequestQueue()
    requests = [
        make_request("late-urgent", [1], priority=0, arrival_time_s=5.0),
        make_request("early-lazy", [1], priority=3, arrival_time_s=0.0),
        make_request("early-urgent", [1], priority=0, arrival_time_s=1.0),
    ]
    for request in requests:
        queue.add_request(request)
    assert [r.request_id for r in queue] == ["early-urgent", "late-urgent", "early-lazy"]
    queue.remove_request(requests[0])  # not the head
    assert [r.request_id for r in queue] == ["early-urgent", "early-lazy"]
    assert queue.peek_request().request_id == "early-urgent"


def test_fcfs_admits_in_arrival_order_and_preempts_the_latest() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=24, max_num_seqs=3)
    runner = FakeRunner(4)
    for name in "abc":
        scheduler.add_request(make_request(name, [ord(name)] * 7, max_tokens=12))
    output, _ = run_step(scheduler, runner)
    assert [n.req_id for n in output.scheduled_new_reqs] == ["a", "b", "c"]
    preempted: list[str] = []
    while not preempted:
        output, _ = run_step(scheduler, runner)
        preempted = sorted(output.preempted_req_ids)
    assert preempted == ["c"]
    assert waiting_ids(scheduler) == ["c"]


def test_priority_policy_admits_urgent_first_and_preempts_the_least_urgent() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=24, max_num_seqs=3,
                               policy=PriorityPolicy())
    runner = FakeRunner(4)
    scheduler.add_request(make_request("lazy", [1] * 7, max_tokens=12, priority=9))
    scheduler.add_request(make_request("urgent", [2] * 7, max_tokens=12, priority=0))
    scheduler.add_request(make_request("middle", [3] * 7, max_tokens=12, priority=5))
    output, _ = run_step(scheduler, runner)
    assert [n.req_id for n in output.scheduled_new_reqs] == ["urgent", "middle", "lazy"]
    preempted: set[str] = set()
    while not preempted:
        output, _ = run_step(scheduler, runner)
        preempted = output.preempted_req_ids
    assert preempted == {"lazy"}


def test_registry_resolves_names_and_dotted_paths() -> None:
    assert resolve_policy_class("fcfs") is FCFSPolicy
    assert resolve_policy_class("engine.scheduler.policies:PriorityPolicy") is PriorityPolicy
    assert isinstance(make_policy("priority"), PriorityPolicy)
    assert set(POLICY_REGISTRY) >= {"fcfs", "priority"}


@pytest.mark.parametrize("name", ["nope", "engine.scheduler.policies:Missing", "no.such:Thing"])
def test_unknown_policies_are_clear_errors(name: str) -> None:
    with pytest.raises(ValueError, match="policy"):
        resolve_policy_class(name)
