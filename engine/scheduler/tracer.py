"""The scheduler's tracer: turns the scheduler's events into `tracing` records, one step at a
time.

A subscriber of the scheduler's event stream (`engine.scheduler.events`): it reads what each
event carries and never the scheduler. A policy's explanation of a TTL reaches it as the
`RetentionInputs` of the `Retention` the policy returned.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import time
from typing import Any

import msgspec

from engine.kv_cache.pins import Pin
from engine.scheduler import events
from engine.scheduler.retention import RetentionInputs
from tracing.records import (
    SCHEMA_VERSION,
    JobEnded,
    PinDeclined,
    PinPinned,
    PinReleased,
    Preemption,
    PrefixCacheEvent,
    RequestArrived,
    RequestFinished,
    StepDecision,
    StepSnapshot,
    TraceHeader,
    TTLInputs,
)
from tracing.writer import TraceWriter

_request_id = operator.attrgetter("request_id")


class SchedulerTracer:
    """Writes one scheduler's trace to `path` (overwritten), capped at `max_bytes` if given.

    Subscribed to one scheduler's events: `started` writes the header (ValueError if the
    file cannot be created); each `StepEnded` flushes the step's records (the one flush per
    step) and each `Flushed` the records between steps; `close` at shutdown. Once tracing
    stopped (write error or cap), `receive` answers False and the stream drops it. `config`
    is recorded in the header as given (dataclasses are converted).
    """

    def __init__(self, path: str | os.PathLike[str], *, config: object = None,
                 max_bytes: int | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._config = _to_builtins(config)
        self._writer: TraceWriter | None = None
        self._step = 0
        self._block_size = 1
        self._resumed_ids: list[str] = []
        self._preempted: list[Preemption] = []

    def started(self, event: events.SchedulerStarted) -> None:
        """Opens the file and writes the header."""
        header = TraceHeader(
            schema_version=SCHEMA_VERSION,
            created_unix_s=time.time(),
            clock_origin_s=event.clock_origin_s,
            policy=event.policy_name,
            num_kv_blocks=event.num_kv_blocks,
            block_size=event.block_size,
            max_num_batched_tokens=event.max_num_batched_tokens,
            max_num_seqs=event.max_num_seqs,
            config=self._config,
        )
        self._writer = TraceWriter(self.path, header, max_bytes=self.max_bytes)
        self._step = event.first_step
        self._block_size = event.block_size

    def receive(self, event: events.SchedulerEvent) -> bool:
        match event:
            case events.StepStarted():
                self._step_started(event)
            case events.RequestArrived():
                self._request_arrived(event)
            case events.Admitted():
                self._admitted(event)
            case events.Preempted(request=request, needed_by=needed_by, reason=reason):
                self._preempted.append(Preemption(
                    request_id=request.request_id, job_id=request.job_id,
                    reason=reason, needed_by=needed_by.request_id,
                    num_computed_tokens=request.num_computed_tokens,
                ))
            case events.StepPlanned():
                self._step_planned(event)
            case events.ApplyingOutput(step=step):
                self._step = step
            case events.StepEnded(next_step=next_step):
                self._step = next_step
                return self._flush()
            case events.Flushed():
                return self._flush()
            case events.RequestFinished():
                self._request_finished(event)
            case events.RetentionDecided():
                self._retention_decided(event)
            case events.PinReleased(pin=pin):
                self._pin_released(pin)
            case events.JobEnded():
                self._write(JobEnded(step=self._step, time_s=event.now_s, job_id=event.job_id,
                                     reason=event.reason))
        return self.is_active

    @property
    def is_active(self) -> bool:
        """Whether records are still written (False after a write error or the cap)."""
        return self._writer is not None and self._writer.active

    # Requests.
    def _request_arrived(self, event: events.RequestArrived) -> None:
        request, job = event.request, event.request.job
        self._write(RequestArrived(
            step=self._step, time_s=event.now_s, request_id=request.request_id,
            job_id=None if job is None else job.job_id,
            num_prompt_tokens=request.num_tokens,
            max_tokens=request.sampling_params.max_tokens,
            is_last_turn=job is not None and job.is_last_step,
            tool_name=None if job is None else job.tool_name,
            job_inferred=job is not None and job.inferred,
            inferred_from=event.inferred_from,
        ))

    def _request_finished(self, event: events.RequestFinished) -> None:
        request = event.request
        self._write(RequestFinished(
            step=self._step, time_s=event.now_s, request_id=request.request_id,
            job_id=request.job_id, reason=str(request.finish_reason),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_preemptions=request.num_preemptions,
        ))

    # A step.
    def _step_started(self, event: events.StepStarted) -> None:
        self._step = event.step
        pool = event.pool
        self._write(StepSnapshot(
            step=event.step, time_s=event.now_s,
            running_ids=list(map(_request_id, event.running)),
            waiting_ids=list(map(_request_id, event.waiting)),
            num_total_blocks=pool.num_total_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_pinned_blocks=pool.num_pinned_blocks,
            pinned_job_ids=pool.pinned_job_ids,
            token_budget=event.token_budget,
            max_num_seqs=event.max_num_seqs,
        ))

    def _admitted(self, event: events.Admitted) -> None:
        request, hit, job_pin = event.request, event.hit, event.job_pin
        num_pin_hit_tokens = 0
        if job_pin is not None and hit.blocks:
            pinned_ids = {block.block_id for block in job_pin.blocks}
            num_pin_hit_blocks = sum(1 for block in hit.blocks if block.block_id in pinned_ids)
            num_pin_hit_tokens = num_pin_hit_blocks * self._block_size
        if event.resumed:
            self._resumed_ids.append(request.request_id)
        self._write(PrefixCacheEvent(
            step=self._step, time_s=event.now_s, request_id=request.request_id,
            job_id=request.job_id, num_prompt_tokens=request.num_tokens,
            num_hit_tokens=hit.num_tokens, num_pin_hit_tokens=num_pin_hit_tokens,
            num_host_hit_tokens=hit.num_host_tokens,
            resumed=event.resumed,
        ))

    def _step_planned(self, event: events.StepPlanned) -> None:
        resumed_ids = self._resumed_ids
        resumed = set(resumed_ids)
        self._write(StepDecision(
            step=self._step, time_s=event.now_s,
            new_ids=[r.request_id for r in event.admitted if r.request_id not in resumed],
            resumed_ids=resumed_ids,
            preempted=self._preempted,
            num_scheduled_tokens=event.num_scheduled_tokens,
            total_num_scheduled_tokens=event.total_num_scheduled_tokens,
            num_stored_blocks=event.transfers.num_stored_blocks,
            num_loaded_blocks=event.transfers.num_loaded_blocks,
        ))
        self._resumed_ids = []
        self._preempted = []

    def _flush(self) -> bool:
        """Flushes the records written since the last flush (none: writes nothing); False
        once tracing stopped."""
        if self._writer is None:
            return False
        self._writer.flush()
        return self._writer.active

    # Pins.
    def _retention_decided(self, event: events.RetentionDecided) -> None:
        request, pin = event.request, event.pin
        inputs = ttl_inputs(event.inputs)
        if pin is not None:
            self._write(PinPinned(
                step=self._step, time_s=event.now_s, job_id=pin.job_id,
                request_id=pin.request_id, num_blocks=pin.num_blocks,
                ttl_s=finite_or_none(pin.ttl_s), inputs=inputs,
            ))
        elif request.job_id is not None:
            self._write(PinDeclined(step=self._step, time_s=event.now_s, job_id=request.job_id,
                                    request_id=request.request_id, inputs=inputs))

    def _pin_released(self, pin: Pin) -> None:
        released_at_s = pin.released_at_s if pin.released_at_s is not None else pin.pinned_at_s
        self._write(PinReleased(
            step=self._step, time_s=released_at_s, job_id=pin.job_id,
            request_id=pin.request_id, num_blocks=pin.num_blocks,
            ttl_s=finite_or_none(pin.ttl_s),
            held_s=released_at_s - pin.pinned_at_s,
            reason="" if pin.release_reason is None else pin.release_reason.value,
        ))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _write(self, record: Any) -> None:
        if self._writer is not None:
            self._writer.write(record)


def ttl_inputs(inputs: RetentionInputs) -> TTLInputs:
    """A policy's retention inputs as the trace records them."""
    return TTLInputs(**dataclasses.asdict(inputs))


def finite_or_none(value: float) -> float | None:
    """A TTL for a record: JSON has no infinity, so an endless TTL is written as None."""
    return value if math.isfinite(value) else None


def _to_builtins(config: object) -> dict[str, Any]:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    builtins = msgspec.to_builtins(config)
    if not isinstance(builtins, dict):
        raise ValueError(f"trace config must be a mapping or a dataclass, got {config!r}")
    return builtins
