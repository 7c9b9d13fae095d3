"""The waiting queue shared among tenants: each tenant's requests in its policy's order, the
tenants taking turns.

With one queue for all, a tenant that sends many requests puts every other tenant's behind
them: a paced flood of 1,000 completions from one tenant kept another's next request waiting
40 s for its first token (0.02 s alone). Here each tenant with waiting requests has a queue of
its own, built by the policy (`SchedulingPolicy.new_waiting_queue`), and the next request to
admit is the head of the tenant admitted least often while it waited: a tenant that starts
waiting starts level with the least admitted of those already waiting (so none banks turns
while it sends nothing), and ties go to the tenant waiting longest. A tenant's requests keep
its policy's order among themselves, and a server without tenants (every request's `tenant`
None) has one queue, whose order is its policy's exactly.

Turns count admissions, not tokens: a tenant of long prompts gets as many admissions as one of
short ones.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from engine.request import Request
from engine.scheduler.request_queue import RequestQueue


class TenantFairQueue:
    """The scheduler's waiting queue: one policy-ordered queue per tenant with waiting
    requests, and the tenants' turns (see the module docstring). Owned by the scheduler,
    which alone changes it, and tells it of each admission with `remove_admitted`; policies
    read it as `WaitingRequests`. A tenant's queue and count are dropped once it has no
    request waiting, so its state is bounded by the tenants waiting."""

    def __init__(self, new_queue: Callable[[], RequestQueue]) -> None:
        self._new_queue = new_queue
        # By tenant, in the order they began waiting (the turns' tie-break).
        self._queues: dict[str | None, RequestQueue] = {}
        self._num_admitted: dict[str | None, int] = {}
        self._num_requests = 0
        self._now_s: float | None = None

    def add_request(self, request: Request) -> None:
        self._queue_of(request.tenant).add_request(request)
        self._num_requests += 1

    def prepend_request(self, request: Request) -> None:
        """Puts a preempted or passed-over request back at the head of its tenant's queue."""
        self._queue_of(request.tenant).prepend_request(request)
        self._num_requests += 1

    def peek_request(self) -> Request:
        if not self._queues:
            raise IndexError("peek from an empty queue")
        return self._queues[self._next_tenant()].peek_request()

    def remove_request(self, request: Request) -> None:
        """Takes out a request that leaves the queue without being admitted (aborted,
        finished, passed over)."""
        self._remove(request)

    def remove_admitted(self, request: Request) -> None:
        """Takes out a request the scheduler admitted: one turn of its tenant."""
        tenant = request.tenant
        self._num_admitted[tenant] = self._num_admitted.get(tenant, 0) + 1
        self._remove(request)

    def remove_requests(self, requests: Collection[Request]) -> None:
        by_tenant: dict[str | None, list[Request]] = {}
        for request in requests:
            by_tenant.setdefault(request.tenant, []).append(request)
        for tenant, removed in by_tenant.items():
            queue = self._queues[tenant]
            queue.remove_requests(removed)
            self._num_requests -= len(removed)
            self._drop_if_empty(tenant, queue)

    def advance_to(self, now_s: float) -> None:
        self._now_s = now_s
        for queue in self._queues.values():
            queue.advance_to(now_s)

    def num_waiting(self, job_id: str) -> int:
        # A job's requests are all of one tenant (job ids are namespaced by tenant).
        return sum(queue.num_waiting(job_id) for queue in self._queues.values())

    def __len__(self) -> int:
        return self._num_requests

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in the order they would be admitted if each were admitted in
        turn."""
        heads = {tenant: iter(queue) for tenant, queue in self._queues.items()}
        num_admitted = dict(self._num_admitted)
        while heads:
            tenant = min(heads, key=lambda t: num_admitted[t])
            request = next(heads[tenant], None)
            if request is None:
                del heads[tenant]
                continue
            num_admitted[tenant] += 1
            yield request

    def _queue_of(self, tenant: str | None) -> RequestQueue:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = self._new_queue()
            if self._now_s is not None:
                queue.advance_to(self._now_s)
            self._num_admitted[tenant] = min(self._num_admitted.values(), default=0)
        return queue

    def _next_tenant(self) -> str | None:
        """The tenant whose turn it is (some tenant waits)."""
        if len(self._queues) == 1:
            return next(iter(self._queues))
        return min(self._queues, key=self._num_admitted.__getitem__)

    def _remove(self, request: Request) -> None:
        queue = self._queues[request.tenant]
        queue.remove_request(request)
        self._num_requests -= 1
        self._drop_if_empty(request.tenant, queue)

    def _drop_if_empty(self, tenant: str | None, queue: RequestQueue) -> None:
        if not len(queue):
            del self._queues[tenant]
            del self._num_admitted[tenant]

