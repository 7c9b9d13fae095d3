import pytest

from engine.scheduler.policies import FCFSPolicy, PriorityPolicy
from engine.scheduler.policy import Reservation
from engine.scheduler.policy_registry import POLICIES, make_policy, resolve_policy
from engine.scheduler.request_queue import FCFSRequestQueue, KeyedRequestQueue, priority_order
from tests.engine.helpers import FakeRunner, make_request, make_scheduler, run_step, run_until_done


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
    queue = KeyedRequestQueue(priority_order)
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
    assert resolve_policy("fcfs") is FCFSPolicy
    assert resolve_policy("engine.scheduler.policies:PriorityPolicy") is PriorityPolicy
    assert isinstance(make_policy("priority"), PriorityPolicy)
    assert set(POLICIES) >= {"fcfs", "priority"}


@pytest.mark.parametrize("name", ["nope", "engine.scheduler.policies:Missing", "no.such:Thing"])
def test_unknown_policies_are_clear_errors(name: str) -> None:
    with pytest.raises(ValueError, match="policy"):
        resolve_policy(name)


def test_priority_ties_cannot_preempt_each_other_forever() -> None:
    # Equal priority and arrival: the victim is the most recently admitted request, so the
    # other one keeps its progress and both finish (ties used to make them thrash).
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=4,
                               max_num_seqs=2, max_model_len=24, long_prefill_token_threshold=1,
                               enable_prefix_caching=False, policy=PriorityPolicy())
    runner = FakeRunner(4)
    for name in ("first", "second"):
        scheduler.add_request(make_request(name, [7] * 9, max_tokens=9, priority=1))
    assert run_until_done(scheduler, runner, max_steps=200) < 100
    assert scheduler.num_preemptions <= 2


class _BrokenPolicy(FCFSPolicy):
    def __init__(self, victim) -> None:
        self.victim = victim

    def select_victim(self, request, now_s):
        return self.victim


def test_a_policy_returning_an_invalid_victim_fails_loudly_instead_of_looping() -> None:
    from engine.kv_cache.pins import Pin

    stale_pin = Pin("ghost", "r", [], pinned_at_s=0.0, ttl_s=1.0)
    waiting_request = make_request("never-admitted", [1])
    for victim, message in [(stale_pin, "not live"), (waiting_request, "not running")]:
        scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16,
                                   policy=_BrokenPolicy(victim))
        runner = FakeRunner(4)
        scheduler.add_request(make_request("a", list(range(7)), max_tokens=9))
        scheduler.add_request(make_request("b", list(range(20, 27)), max_tokens=9))
        with pytest.raises(RuntimeError, match=message):
            for _ in range(10):
                run_step(scheduler, runner)


class _ReservingPolicy(FCFSPolicy):
    """Reserves a prompt's every chunk and counts `counted` as room for them."""

    def __init__(self, counted) -> None:
        self.counted = counted

    def reservation(self, request, num_hit_tokens, num_new_tokens, now_s):
        return Reservation(request.num_tokens - num_hit_tokens, (self.counted,))


def test_a_policy_counting_a_pin_that_is_not_live_fails_loudly() -> None:
    from engine.kv_cache.pins import Pin

    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32,
                               max_num_batched_tokens=8,
                               policy=_ReservingPolicy(Pin("ghost", "r", [], 0.0, 1.0)))
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(4)), max_tokens=9))
    run_step(scheduler, runner)
    scheduler.add_request(make_request("b", list(range(20, 40)), max_tokens=2))
    with pytest.raises(RuntimeError, match="not live"):
        run_step(scheduler, runner)
