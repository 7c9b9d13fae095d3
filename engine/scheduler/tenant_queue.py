"""The waiting queue shared among tenants: each tenant's requests in its policy's order, the
tenants taking turns.

With one queue for all, a tenant that sends many requests puts every other tenant's behind
them: in `python -m lab flood`, another tenant's next request waited up to 16.8 s for its
first token in a 30 s flood of 1,000 completions, and 40.2 s in a 60 s flood of 2,000 (0.02 s
alone). Here each tenant with waiting requests has a queue of its own, built by the policy
(`SchedulingPolicy.new_waiting_queue`), and the next request to admit is the head of the
tenant admitted least often since it began waiting; ties go to the tenant admitted least
recently (one that has just begun waiting first). A tenant that begins waiting starts level
with the least admitted of those already waiting, so none banks turns while it sends
nothing. A preempted request goes back to the head of its tenant's queue, but its tenant
gets no turn back, or a flooding tenant whose requests are preempted for memory would win
the turns back with each preemption. A server without tenants (every request's `tenant`
None) has one queue, whose order is its policy's exactly.

What this changes for a policy with several tenants: its order, and anything it ranks first
(a pinned job's turn, an overdue request), holds among one tenant's requests; across
tenants the turns decide. Turns count admissions, not tokens: a tenant of long prompts gets
as many admissions as one of short ones.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from engine.request import Request
from engine.scheduler.request_queue import RequestQueue


class TenantFairQueue:
    """The scheduler's waiting queue: one policy-ordered queue per tenant with waiting
    requests, and the tenants' turns (see the module docstring). Owned by the scheduler,
    which alone changes it and says how each request leaves (`remove_admitted`,
    `remove_request`, `remove_requests`); policies read it as
    `WaitingRequests`. A tenant whose queue empties keeps its place until the next
    `advance_to` (a request passed over within a step comes back to it), and is then dropped,
    so the state is bounded by the tenants waiting."""

    def __init__(self, new_queue: Callable[[], RequestQueue]) -> None:
        self._new_queue = new_queue
        self._queues: dict[str | None, RequestQueue] = {}
        # Per tenant in `_queues`: admissions since it began waiting, and the number of the
        # admission it last had (-1: none since it began waiting).
        self._num_admitted: dict[str | None, int] = {}
        self._last_admission: dict[str | None, int] = {}
        self._num_admissions = 0
        self._now_s: float | None = None

    def add_request(self, request: Request) -> None:
        self._queue_of(request.tenant).add_request(request)

    def prepend_request(self, request: Request) -> None:
        """Puts a preempted request, or one passed over this step, back at the head of its
        tenant's queue (its tenant's turns unchanged)."""
        self._queue_of(request.tenant).prepend_request(request)

    def peek_request(self) -> Request:
        if not len(self):
            raise IndexError("peek from an empty queue")
        return self._queues[self._next_tenant()].peek_request()

    def peek_request_excluding(self, tenants: Collection[str | None]) -> Request | None:
        """The next request to admit among the tenants not in `tenants` (those the scheduler
        passes over for the rest of a step); None if none of the others has one waiting."""
        waiting = [tenant for tenant, queue in self._queues.items()
                   if len(queue) and tenant not in tenants]
        if not waiting:
            return None
        return self._queues[min(waiting, key=self._turn)].peek_request()

    def remove_request(self, request: Request) -> None:
        """Takes out a request that leaves without being admitted (aborted, finished,
        passed over)."""
        self._queues[request.tenant].remove_request(request)

    def remove_admitted(self, request: Request) -> None:
        """Takes out a request the scheduler admitted: one turn of its tenant."""
        tenant = request.tenant
        self._queues[tenant].remove_request(request)
        self._num_admitted[tenant] += 1
        self._last_admission[tenant] = self._num_admissions
        self._num_admissions += 1

    def remove_requests(self, requests: Collection[Request]) -> None:
        """Takes out requests that leave without being admitted."""
        by_tenant: dict[str | None, list[Request]] = {}
        for request in requests:
            by_tenant.setdefault(request.tenant, []).append(request)
        for tenant, removed in by_tenant.items():
            self._queues[tenant].remove_requests(removed)

    def advance_to(self, now_s: float) -> None:
        """The scheduler's clock at a step's start: passed to each tenant's queue; the
        tenants with no request left waiting are dropped."""
        self._now_s = now_s
        for tenant in [tenant for tenant, queue in self._queues.items() if not len(queue)]:
            del self._queues[tenant], self._num_admitted[tenant], self._last_admission[tenant]
        for queue in self._queues.values():
            queue.advance_to(now_s)

    def tenants(self) -> list[str | None]:
        """The tenants with requests waiting."""
        return [tenant for tenant, queue in self._queues.items() if len(queue)]

    def num_waiting(self, job_id: str) -> int:
        """Waiting requests of the job (all of one tenant: job ids are namespaced by it)."""
        return sum(queue.num_waiting(job_id) for queue in self._queues.values())

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in the order they would be admitted if each were admitted in
        turn."""
        heads = {tenant: iter(queue) for tenant, queue in self._queues.items() if len(queue)}
        num_admitted, last_admission = dict(self._num_admitted), dict(self._last_admission)
        num_admissions = self._num_admissions
        while heads:
            tenant = min(heads, key=lambda t: (num_admitted[t], last_admission[t]))
            request = next(heads[tenant], None)
            if request is None:
                del heads[tenant]
                continue
            num_admitted[tenant] += 1
            last_admission[tenant] = num_admissions
            num_admissions += 1
            yield request

    def _queue_of(self, tenant: str | None) -> RequestQueue:
        queue = self._queues.get(tenant)
        if queue is None:
            waiting = [self._num_admitted[t] for t, q in self._queues.items() if len(q)]
            queue = self._queues[tenant] = self._new_queue()
            if self._now_s is not None:
                queue.advance_to(self._now_s)
            self._num_admitted[tenant] = min(waiting, default=0)
            self._last_admission[tenant] = -1
        return queue

    def _next_tenant(self) -> str | None:
        """The tenant whose turn it is (some request waits)."""
        if len(self._queues) == 1:
            return next(iter(self._queues))
        return min((tenant for tenant, queue in self._queues.items() if len(queue)),
                   key=self._turn)

    def _turn(self, tenant: str | None) -> tuple[int, int]:
        """What orders the tenants' turns, the least first: admissions since `tenant` began
        waiting, then the number of its last admission."""
        return self._num_admitted[tenant], self._last_admission[tenant]
