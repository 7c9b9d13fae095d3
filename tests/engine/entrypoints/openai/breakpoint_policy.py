"""A stand-in policy loaded by name inside the engine-core process of a test server: FCFS that
pins a finished turn of a named job for the TTL of the cache breakpoint its request carries
(`Request.cache_breakpoint`), so that a test sees over HTTP (`GET /v1/jobs/...`, the pin's
`ttl_s`) what reached the scheduler. What the engine itself keeps for a breakpoint is the
scheduler's policy's, not this one's."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.retention import Retention, RetentionInputs


class PinTheBreakpointPolicy(FCFSPolicy):
    """FCFS that pins each finished turn of a named job whose request has a cache breakpoint,
    for the breakpoint's TTL."""

    def retention(self, request: Request, now_s: float) -> Retention | None:
        breakpoint_ = request.cache_breakpoint
        if (request.job is None or request.job.inferred or breakpoint_ is None
                or request.status is RequestStatus.FINISHED_ABORTED):
            return None
        return Retention(breakpoint_.ttl_s,
                         RetentionInputs(ttl_s=breakpoint_.ttl_s, source="cache_control"))
