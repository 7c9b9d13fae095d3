"""The scheduler's consistency checks, run by `Scheduler.check_invariants()`.

Tests (and the engine core, when asked to) call them after every step; they read the
scheduler only through its public attributes and change nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from engine.config import SchedulerConfig
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.pins import PinTable
from engine.request import Request, RequestStatus
from engine.scheduler.job_inference import JobInference


class SchedulerState(Protocol):
    """What the checks read of a scheduler (`Scheduler` provides it)."""

    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def block_size(self) -> int: ...
    @property
    def kv_cache_manager(self) -> KVCacheManager: ...
    @property
    def pins(self) -> PinTable: ...
    @property
    def job_inference(self) -> JobInference | None: ...
    @property
    def requests(self) -> Mapping[str, Request]: ...
    @property
    def running(self) -> Sequence[Request]: ...
    @property
    def waiting(self) -> Iterable[Request]: ...


def check_invariants(scheduler: SchedulerState) -> None:
    """Asserts the scheduler's and the KV cache's invariants.

    Every block is free (in the free queue, unreferenced) or held, and its `ref_cnt` is
    the number of running requests plus pins holding it. The job inference table agrees with
    the unfinished requests (`JobInference.check_invariants`).
    """
    kv_cache_manager = scheduler.kv_cache_manager
    kv_cache_manager.check_invariants()
    scheduler.pins.check_invariants()
    _check_request_sets(scheduler)
    if scheduler.job_inference is not None:
        scheduler.job_inference.check_invariants(
            scheduler.requests, [pin.job_id for pin in scheduler.pins])
    expected: Counter[int] = Counter()
    for blocks in kv_cache_manager.req_to_blocks.values():
        expected.update(block.block_id for block in blocks)
    for pin in scheduler.pins:
        expected.update(block.block_id for block in pin.blocks)
    for block in kv_cache_manager.block_pool.blocks:
        assert block.ref_cnt == expected[block.block_id], (
            f"{block} has ref_cnt {block.ref_cnt}, holders {expected[block.block_id]}"
        )


def _check_request_sets(scheduler: SchedulerState) -> None:
    """Every unfinished request is running or waiting, once, in a state that fits there."""
    req_to_blocks = scheduler.kv_cache_manager.req_to_blocks
    running_ids = [request.request_id for request in scheduler.running]
    waiting_ids = [request.request_id for request in scheduler.waiting]
    assert len(set(running_ids)) == len(running_ids), "a request runs twice"
    assert len(set(waiting_ids)) == len(waiting_ids), "a request waits twice"
    assert len(scheduler.waiting) == len(waiting_ids), "the waiting count is off"
    assert not set(running_ids) & set(waiting_ids), "a request both runs and waits"
    assert set(running_ids) | set(waiting_ids) == scheduler.requests.keys(), "lost a request"
    assert len(running_ids) <= scheduler.config.max_num_seqs, "max_num_seqs exceeded"
    assert req_to_blocks.keys() == set(running_ids), (
        "block owners differ from the running requests"
    )
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING, f"{request} in running"
        num_blocks = len(req_to_blocks[request.request_id])
        assert 0 <= request.num_output_placeholders <= 2, f"{request} awaits too many tokens"
        assert request.num_computed_tokens <= min(
            request.num_tokens + request.num_output_placeholders,
            num_blocks * scheduler.block_size,
        ), f"{request} computed beyond its tokens or blocks"
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
            f"{request} in waiting"
        )
        assert request.num_computed_tokens == 0, f"waiting {request} has computed tokens"
        assert request.num_output_placeholders == 0, f"waiting {request} awaits tokens"
