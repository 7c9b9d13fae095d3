"""The scheduler's hands on pins and jobs: it pins what a policy retains, releases what a
policy gives up or expires, infers jobs and ends them.

Owned by `Scheduler`, which decides when; every pin change reaches the event stream
(`RetentionDecided`, `PinReleased`, `JobEnded`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.pins import Pin, PinReleaseReason, PinTable
from engine.request import Request, RequestStatus
from engine.scheduler import events
from engine.scheduler.job_inference import InferredJob, JobInference
from engine.scheduler.retention import Retention, RetentionInputs


class PinKeeper:
    """Owns the pin table (over the KV cache manager's block pool) and the job inference
    table (None: inference is off); counts the jobs it inferred (`num_jobs_inferred`) and
    ended (`num_jobs_ended`, by reason). Times are seconds on the scheduler's clock."""

    def __init__(self, kv_cache_manager: KVCacheManager, stream: events.SchedulerEvents,
                 job_inference: JobInference | None) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._events = stream
        self.job_inference = job_inference
        self.pins = PinTable(kv_cache_manager.block_pool,
                             on_released=lambda pin: stream.emit(events.PinReleased(pin)))
        self.num_jobs_inferred = 0
        self.num_jobs_ended: Counter[str] = Counter()

    def retain(self, request: Request, retention: Retention | None, now_s: float, *,
               max_tenant_pinned_blocks: float | None = None) -> bool:
        """Carries out a policy's retention decision on a finished turn: releases the pins it
        makes room with, then pins the turn's cached blocks if it says so; True if the
        request's blocks went to a pin (or were detached, none being cached).

        A client's cache breakpoint (`Request.cache_breakpoint`) on a job's turn that
        finished normally is kept as the job's pin instead when its deadline is later than
        the policy's pin's (or the policy pins nothing): the blocks of its prefix, for its
        TTL (`source` "client", explained as such). Then the request's tenant's pins, oldest
        first, the new one last, are released (TENANT_SHARE) until they hold at most
        `max_tenant_pinned_blocks` (None: no cap)."""
        if request.job is None:
            return False
        if retention is not None and request.status is RequestStatus.FINISHED_ABORTED:
            raise RuntimeError(f"policy retained {request}, which was aborted")
        client_ttl_s = self._client_ttl_s(request, retention)
        if client_ttl_s is not None:
            retention = Retention(client_ttl_s, RetentionInputs(
                ttl_s=client_ttl_s, source="client",
                tool=None if retention is None else retention.inputs.tool),
                release_job_ids=() if retention is None else retention.release_job_ids)
        if retention is None:
            return False
        for job_id in retention.release_job_ids:
            self.release(job_id, PinReleaseReason.PRESSURE, now_s)
        pin = None
        if retention.pins:
            blocks = self._kv_cache_manager.detach_cached_blocks(request)
            if client_ttl_s is not None:
                blocks = self._prefix_blocks(request, blocks)
            if blocks:
                pin = self.pins.add(request.job.job_id, request.request_id, blocks,
                                    now_s=now_s, ttl_s=self._ttl_s(request, retention),
                                    tenant=request.tenant,
                                    source="policy" if client_ttl_s is None else "client")
        self._events.emit(events.RetentionDecided(request, pin, retention.inputs, now_s))
        if pin is not None and max_tenant_pinned_blocks is not None:
            self._cap_tenant_pins(request.tenant, max_tenant_pinned_blocks, pin, now_s)
        return retention.pins

    @staticmethod
    def _client_ttl_s(request: Request, retention: Retention | None) -> float | None:
        """The TTL of the client's pin of a finished turn, if it wins over the policy's."""
        breakpoint_ = request.cache_breakpoint
        if breakpoint_ is None or request.status is RequestStatus.FINISHED_ABORTED:
            return None
        if retention is not None and retention.ttl_s >= breakpoint_.ttl_s:
            return None
        return breakpoint_.ttl_s

    def _prefix_blocks(self, request: Request, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """The detached `blocks` of the client's cache breakpoint's prefix; frees the rest."""
        assert request.cache_breakpoint is not None
        num_kept = request.cache_breakpoint.num_prompt_tokens // self._kv_cache_manager.block_size
        self._kv_cache_manager.block_pool.free_blocks(reversed(blocks[num_kept:]))
        return blocks[:num_kept]

    def _cap_tenant_pins(self, tenant: str | None, max_pinned_blocks: float, newest: Pin,
                         now_s: float) -> None:
        """Releases the tenant's oldest pins (the newest last) until the blocks they hold
        (each once) are within `max_pinned_blocks`; a pin whose blocks its tenant's other
        pins all hold too is kept, as releasing it would free none."""
        pins = [pin for pin in self.pins if pin.tenant == tenant and pin is not newest]
        for pin in (*pins, newest):  # the table keeps pins oldest first
            if self.pins.num_tenant_blocks(tenant) <= max_pinned_blocks:
                return
            if self.pins.num_sole_blocks(pin):
                self.release(pin.job_id, PinReleaseReason.TENANT_SHARE, now_s)

    def _ttl_s(self, request: Request, retention: Retention) -> float:
        """The policy's TTL, capped for an inferred job by how long its turn can be continued;
        a client's, as it asked (the turn is then remembered as long: `turn_finished`)."""
        if (self.job_inference is None or request.job is None or not request.job.inferred
                or retention.inputs.source == "client"):
            return retention.ttl_s
        return self.job_inference.pin_ttl_s(retention.ttl_s)

    def release(self, job_id: str, reason: PinReleaseReason, now_s: float) -> Pin | None:
        """Releases the job's pin, if any; returns it."""
        return self.pins.release(job_id, reason, now_s=now_s)

    def release_chosen(self, pins: Iterable[Pin], reason: PinReleaseReason,
                       now_s: float) -> None:
        """Releases pins a policy chose, in order; RuntimeError for one that is not live."""
        for pin in pins:
            if self.pins.get(pin.job_id) is not pin:
                raise RuntimeError(f"policy chose the pin of job {pin.job_id!r} "
                                   f"({reason.value}), which is not live")
            self.release(pin.job_id, reason, now_s)

    def release_expired(self, now_s: float,
                        spare: Callable[[str], object] | None = None) -> None:
        """Releases (EXPIRED) the pins past their deadline at `now_s`, oldest first, but those
        of the jobs `spare` is true for (None: none)."""
        expired = [pin for pin in self.pins if now_s > pin.deadline_s
                   and (spare is None or not spare(pin.job_id))]
        for pin in expired:
            self.release(pin.job_id, PinReleaseReason.EXPIRED, now_s)

    def end_job(self, job_id: str, reason: PinReleaseReason, now_s: float) -> Pin | None:
        """Ends a job: releases its pin (if any), forgets it in the job inference table and
        emits `JobEnded` (the policy learns it there); returns the pin."""
        pin = self.release(job_id, reason, now_s)
        if self.job_inference is not None:
            self.job_inference.forget(job_id)
        self.num_jobs_ended[reason.value] += 1
        self._events.emit(events.JobEnded(job_id, reason.value, now_s))
        return pin

    def infer_job(self, request: Request, now_s: float) -> InferredJob | None:
        """Gives a request without a job its inferred job (None: it has a job, or inference
        is off); an explicit job is never changed."""
        if self.job_inference is None or request.job is not None:
            return None
        inferred = self.job_inference.infer(request, now_s)
        request.job = inferred.job
        if inferred.continues_request_id is None:
            self.num_jobs_inferred += 1
        return inferred

    def sweep_inferred_jobs(self, now_s: float) -> list[str]:
        """Ends the inferred jobs whose latest turn aged out; returns their ids."""
        if self.job_inference is None:
            return []
        return self._end_jobs(self.job_inference.sweep(now_s), now_s)

    def turn_finished(self, request: Request, now_s: float) -> None:
        """After a finished request's blocks were pinned or freed: a job's last turn ends its
        job; an inferred job's turn is remembered for its continuation, as long as its
        client's pin if it has one (ending the inferred jobs that no longer can be)."""
        job = request.job
        if job is None:
            return
        if job.is_last_step:
            self.end_job(job.job_id, PinReleaseReason.JOB_END, now_s)
        if self.job_inference is not None and job.inferred:
            pin = self.pins.get(job.job_id)
            kept_s = (pin.ttl_s if pin is not None and pin.request_id == request.request_id
                      and pin.source == "client" else 0.0)
            self._end_jobs(self.job_inference.turn_finished(request, now_s, kept_s=kept_s),
                           now_s)

    def _end_jobs(self, job_ids: list[str], now_s: float) -> list[str]:
        for job_id in job_ids:
            self.end_job(job_id, PinReleaseReason.JOB_END, now_s)
        return job_ids
