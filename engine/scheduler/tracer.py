"""The scheduler's tracer: turns scheduler events into `tracing` records, one step at a time.

Injected into the `Scheduler` (None: tracing off, and every trace point is skipped by a
`None` check). The scheduler hands it explicit values; it never reads the scheduler. A
policy's explanation of a TTL reaches it as the `Retention` the policy returned.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.kv_cache.manager import PrefixHit
from engine.kv_cache.pins import Pin
from engine.kv_cache.transfers import KVTransfers
from engine.request import Request
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


@dataclass(frozen=True, slots=True)
class PoolState:
    """The block pool entering a step: totals, free blocks (those still caching a prefix
    among them), blocks held by pins (summed over pins), and the jobs holding pins."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_pinned_blocks: int
    pinned_job_ids: list[str]


class SchedulerTracer:
    """Writes one scheduler's trace to `path` (overwritten), capped at `max_bytes` if given.

    Owned by the scheduler: `start` from its constructor (writes the header, ValueError if
    the file cannot be created), then the event methods from the step loop, `end_step` after
    each step's output was applied (the one flush per step), `flush` after events between
    steps (an idle sweep's pin releases), `close` at shutdown. `config` is
    recorded in the header as given (dataclasses are converted).
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

    def start(self, *, policy_name: str, clock_origin_s: float, num_kv_blocks: int,
              block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
              first_step: int = 0) -> None:
        """Opens the file and writes the header; called once by the scheduler."""
        header = TraceHeader(
            schema_version=SCHEMA_VERSION,
            created_unix_s=time.time(),
            clock_origin_s=clock_origin_s,
            policy=policy_name,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            config=self._config,
        )
        self._writer = TraceWriter(self.path, header, max_bytes=self.max_bytes)
        self._step = first_step
        self._block_size = block_size

    # Requests.
    def request_arrived(self, request: Request, now_s: float, *,
                        inferred_from: str | None = None) -> None:
        """`request` joined the waiting queue; if its job was inferred, `inferred_from` is
        the finished request whose turn it continues (None: it started the job)."""
        job = request.job
        self._write(RequestArrived(
            step=self._step, time_s=now_s, request_id=request.request_id,
            job_id=None if job is None else job.job_id,
            num_prompt_tokens=request.num_tokens,
            max_tokens=request.sampling_params.max_tokens,
            is_last_turn=job is not None and job.is_last_step,
            tool_name=None if job is None else job.tool_name,
            job_inferred=job is not None and job.inferred,
            inferred_from=inferred_from,
        ))

    def request_finished(self, request: Request, now_s: float) -> None:
        self._write(RequestFinished(
            step=self._step, time_s=now_s, request_id=request.request_id,
            job_id=request.job_id, reason=str(request.finish_reason),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_preemptions=request.num_preemptions,
        ))

    # A step.
    def start_step(self, step: int, now_s: float, running: Iterable[Request],
                   waiting: Iterable[Request], pool: PoolState, *, token_budget: int,
                   max_num_seqs: int) -> None:
        """Records the state entering step `step`."""
        self._step = step
        self._write(StepSnapshot(
            step=step, time_s=now_s,
            running_ids=list(map(_request_id, running)),
            waiting_ids=list(map(_request_id, waiting)),
            num_total_blocks=pool.num_total_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_pinned_blocks=pool.num_pinned_blocks,
            pinned_job_ids=pool.pinned_job_ids,
            token_budget=token_budget,
            max_num_seqs=max_num_seqs,
        ))

    def admitted(self, request: Request, hit: PrefixHit, job_pin: Pin | None, *,
                 resumed: bool, now_s: float) -> None:
        """A waiting request took its blocks (`hit` is its prefix in both tiers); `job_pin`
        is its job's pin, still live."""
        num_pin_hit_tokens = 0
        if job_pin is not None and hit.blocks:
            pinned_ids = {block.block_id for block in job_pin.blocks}
            num_pin_hit_blocks = sum(1 for block in hit.blocks if block.block_id in pinned_ids)
            num_pin_hit_tokens = num_pin_hit_blocks * self._block_size
        if resumed:
            self._resumed_ids.append(request.request_id)
        self._write(PrefixCacheEvent(
            step=self._step, time_s=now_s, request_id=request.request_id,
            job_id=request.job_id, num_prompt_tokens=request.num_tokens,
            num_hit_tokens=hit.num_tokens, num_pin_hit_tokens=num_pin_hit_tokens,
            num_host_hit_tokens=hit.num_host_tokens,
            resumed=resumed,
        ))

    def preempted(self, request: Request, needed_by: Request) -> None:
        """`request` is about to lose its `num_computed_tokens` for `needed_by`."""
        self._preempted.append(Preemption(
            request_id=request.request_id, job_id=request.job_id,
            needed_by=needed_by.request_id, num_computed_tokens=request.num_computed_tokens,
        ))

    def step_planned(self, admitted: Sequence[Request], num_scheduled_tokens: dict[str, int],
                     total_num_scheduled_tokens: int, transfers: KVTransfers,
                     now_s: float) -> None:
        resumed_ids = self._resumed_ids
        resumed = set(resumed_ids)
        self._write(StepDecision(
            step=self._step, time_s=now_s,
            new_ids=[r.request_id for r in admitted if r.request_id not in resumed],
            resumed_ids=resumed_ids,
            preempted=self._preempted,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            num_stored_blocks=transfers.num_stored_blocks,
            num_loaded_blocks=transfers.num_loaded_blocks,
        ))
        self._resumed_ids = []
        self._preempted = []

    def end_step(self) -> bool:
        """Flushes the step's records; False once tracing stopped (write error or cap)."""
        self._step += 1
        return self.flush()

    def flush(self) -> bool:
        """Flushes the records written since the last flush without ending a step (events
        between steps, such as the pins an idle sweep released); writes nothing when there
        are none. False once tracing stopped (write error or cap)."""
        if self._writer is None:
            return False
        self._writer.flush()
        return self._writer.active

    # Pins.
    def retention_decided(self, request: Request, pin: Pin | None, inputs: TTLInputs,
                          now_s: float) -> None:
        """The scheduler carried out a policy's retention decision, explained by `inputs`:
        it pinned `request`'s blocks (`pin`) or freed them (None)."""
        job_id = request.job_id
        if pin is not None:
            self._write(PinPinned(
                step=self._step, time_s=now_s, job_id=pin.job_id, request_id=pin.request_id,
                num_blocks=pin.num_blocks, ttl_s=finite_or_none(pin.ttl_s), inputs=inputs,
            ))
        elif job_id is not None:
            self._write(PinDeclined(step=self._step, time_s=now_s, job_id=job_id,
                                    request_id=request.request_id, inputs=inputs))

    def pin_released(self, pin: Pin) -> None:
        released_at_s = pin.released_at_s if pin.released_at_s is not None else pin.pinned_at_s
        self._write(PinReleased(
            step=self._step, time_s=released_at_s, job_id=pin.job_id,
            request_id=pin.request_id, num_blocks=pin.num_blocks,
            ttl_s=finite_or_none(pin.ttl_s),
            held_s=released_at_s - pin.pinned_at_s,
            reason="" if pin.release_reason is None else pin.release_reason.value,
        ))

    def job_ended(self, job_id: str, reason: str, now_s: float) -> None:
        self._write(JobEnded(step=self._step, time_s=now_s, job_id=job_id, reason=reason))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _write(self, record: Any) -> None:
        if self._writer is not None:
            self._writer.write(record)


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
