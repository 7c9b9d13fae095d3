"""Pins as block holders, exercised through the scheduler with a retaining test policy."""

import pytest

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.pins import PinReleaseReason, PinTable
from tests.engine.helpers import (
    FakeClock,
    FakeRunner,
    PinningPolicy,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
)

PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 + 2


def pinned_setup(num_blocks: int = 16, ttl_s: float = 10.0):
    clock = FakeClock()
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=32,
                               policy=PinningPolicy(ttl_s), clock=clock)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("turn0", PROMPT, max_tokens=3, job_id="job"))
    run_until_done(scheduler, runner)
    return scheduler, runner, clock


def test_pin_holds_the_cached_blocks_out_of_the_free_queue() -> None:
    scheduler, _, clock = pinned_setup()
    pin = scheduler.pins.get("job")
    assert pin is not None and pin.request_id == "turn0"
    # 10 prompt + 3 output tokens; the last sampled token is never computed: 12 tokens of KV,
    # 3 full cached blocks. The partial tail block (none here) would have been freed.
    assert pin.num_blocks == 3
    assert all(block.ref_cnt == 1 for block in pin.blocks)
    free = set(scheduler.kv_cache_manager.block_pool.free_block_queue)
    assert not free & set(pin.blocks)
    assert pin.deadline_s == clock.now_s + 10.0
    assert scheduler.pins.num_pinned_blocks == 3


def test_next_turn_hits_the_pin_and_releases_it_after_taking_its_references() -> None:
    scheduler, runner, _ = pinned_setup()
    pinned = scheduler.pins.get("job").blocks
    next_prompt = [*PROMPT, 1, 1, 1, 7, 7, 7, 7]  # previous prompt + output + tool result
    scheduler.add_request(make_request("turn1", next_prompt, max_tokens=2, job_id="job"))
    output, _ = run_step(scheduler, runner)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12
    assert "job" not in scheduler.pins
    assert scheduler.pins.num_released[PinReleaseReason.REUSED] == 1
    assert all(block.ref_cnt == 1 for block in pinned)  # held by turn1 only now


def test_released_pin_leaves_evictable_cache_that_can_still_hit() -> None:
    scheduler, runner, _ = pinned_setup()
    pinned = scheduler.pins.get("job").blocks
    scheduler.pins.release("job", PinReleaseReason.EXPIRED, now_s=0.0)
    free = list(scheduler.kv_cache_manager.block_pool.free_block_queue)
    assert free[-3:] == pinned[::-1]  # freed tail-first at the LRU tail
    scheduler.add_request(make_request("other", [*PROMPT, 1, 1, 1, 5], max_tokens=1))
    output, _ = run_step(scheduler, runner)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12


def test_ref_cnt_counts_pins_and_requests_together() -> None:
    scheduler, runner, _ = pinned_setup()
    pinned = scheduler.pins.get("job").blocks
    scheduler.add_request(make_request("stranger", [*PROMPT, 1, 1, 1, 9], max_tokens=5))
    run_step(scheduler, runner)
    assert [block.ref_cnt for block in pinned] == [2, 2, 2]  # the pin and the stranger
    scheduler.check_invariants()


def test_pressure_from_a_running_request_releases_a_pin_first() -> None:
    scheduler, runner, _ = pinned_setup(num_blocks=8)  # the pin holds 3 of 8 blocks
    scheduler.add_request(make_request("big", list(range(20)), max_tokens=12))
    run_until_done(scheduler, runner)  # needs 8 blocks at the end: the pin must go
    assert scheduler.pins.num_released[PinReleaseReason.PRESSURE] == 1
    assert scheduler.num_preemptions == 0


def test_pins_never_wedge_admission() -> None:
    scheduler, runner, _ = pinned_setup(num_blocks=8)
    scheduler.add_request(make_request("huge", list(range(200, 230)), max_tokens=1))
    run_until_done(scheduler, runner)  # 30 tokens = 8 blocks: admitted after the release
    assert scheduler.pins.num_released[PinReleaseReason.PRESSURE] == 1


def test_every_release_reason_is_recorded() -> None:
    scheduler, runner, _ = pinned_setup(num_blocks=8)
    counts = scheduler.pins.num_released

    scheduler.end_job("job")  # explicit release
    assert counts[PinReleaseReason.RELEASE] == 1

    scheduler.add_request(make_request("j2a", PROMPT, max_tokens=1, job_id="j2"))
    scheduler.add_request(make_request("j2b", PROMPT, max_tokens=2, job_id="j2"))
    run_until_done(scheduler, runner)  # j2b's pin replaces j2a's
    assert counts[PinReleaseReason.REPLACED] == 1
    assert scheduler.pins.get("j2").request_id == "j2b"

    scheduler.add_request(make_request("j2c", [*PROMPT, 3], max_tokens=1, job_id="j2"))
    scheduler.finish_requests(["j2c"])  # the next turn aborted while waiting
    assert counts[PinReleaseReason.ABORT] == 1

    scheduler.add_request(make_request("j3a", PROMPT, max_tokens=1, job_id="j3"))
    run_until_done(scheduler, runner)
    scheduler.add_request(make_request("j3b", [*PROMPT, 1, 4], max_tokens=1, job_id="j3",
                                       is_last_step=True))
    run_until_done(scheduler, runner)  # j3b reuses j3a's pin, then its own ends with the job
    assert counts[PinReleaseReason.REUSED] == 1
    assert counts[PinReleaseReason.JOB_END] == 1

    scheduler.add_request(make_request("j4", PROMPT, max_tokens=1, job_id="j4"))
    run_until_done(scheduler, runner)
    scheduler.pins.release("j4", PinReleaseReason.EXPIRED, now_s=0.0)
    assert counts[PinReleaseReason.EXPIRED] == 1
    scheduler.add_request(make_request("j6", PROMPT, max_tokens=1, job_id="j6"))
    run_until_done(scheduler, runner)
    scheduler.pins.release("j6", PinReleaseReason.TENANT_SHARE, now_s=0.0)  # see admission
    assert counts[PinReleaseReason.TENANT_SHARE] == 1
    scheduler.add_request(make_request("j7", PROMPT, max_tokens=1, job_id="j7"))
    run_until_done(scheduler, runner)
    scheduler.pins.release("j7", PinReleaseReason.CLIENT_PRESSURE, now_s=0.0)  # client pins
    assert counts[PinReleaseReason.CLIENT_PRESSURE] == 1

    scheduler.add_request(make_request("j5", PROMPT, max_tokens=1, job_id="j5"))
    run_until_done(scheduler, runner)
    scheduler.add_request(make_request("hog", list(range(300, 330)), max_tokens=1))
    run_until_done(scheduler, runner)  # needs all 8 blocks, the pinned ones included
    assert counts[PinReleaseReason.PRESSURE] == 1

    assert set(counts) == set(PinReleaseReason)
    # The hog named no job: it started an inferred one, whose turn PinningPolicy pins too.
    (hog_pin,) = scheduler.pins
    assert hog_pin.request_id == "hog" and hog_pin.job_id.startswith("~inferred/")
    scheduler.end_job(hog_pin.job_id)
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 8


def test_aborted_turn_is_never_pinned() -> None:
    scheduler = make_scheduler(policy=PinningPolicy())
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", PROMPT, max_tokens=5, job_id="job"))
    run_step(scheduler, runner)
    scheduler.finish_requests(["a"])
    assert len(scheduler.pins) == 0
    scheduler.check_invariants()


def test_pin_table_rejects_empty_and_non_positive_pins() -> None:
    table = PinTable(BlockPool(2))
    with pytest.raises(ValueError, match="at least one block"):
        table.add("job", "r", [], now_s=0.0, ttl_s=1.0)
    pool_blocks = table._block_pool.allocate(1)
    with pytest.raises(ValueError, match="ttl_s"):
        table.add("job", "r", pool_blocks, now_s=0.0, ttl_s=0.0)
    assert len(table) == 0


def test_admission_releases_other_jobs_pins_before_its_own() -> None:
    scheduler, runner, clock = pinned_setup(num_blocks=8)  # job holds 3 blocks
    clock.advance(1.0)
    scheduler.add_request(make_request("other0", list(range(200, 210)), max_tokens=3,
                                       job_id="other"))
    run_until_done(scheduler, runner)  # other holds 3 blocks, pinned later than job's
    # job's next turn shares job's prefix and needs 7 blocks in all: other's pin must go,
    # and job's own pin (its prefix hit) must survive until admission reuses it.
    turn1 = make_request("turn1", [*PROMPT, 1, 1, 1, *range(300, 315)], max_tokens=1,
                         job_id="job")
    scheduler.add_request(turn1)
    output, _ = run_step(scheduler, runner)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12
    counts = scheduler.pins.num_released
    assert counts[PinReleaseReason.PRESSURE] == 1 and counts[PinReleaseReason.REUSED] == 1
    assert "other" not in scheduler.pins
    assert scheduler.pins.get("job").request_id == "turn1"  # turn1 finished and was pinned


def test_pin_table_reports_every_release_to_its_listener() -> None:
    pool = BlockPool(8)
    events: list[tuple[str, str, PinReleaseReason | None]] = []
    pins = PinTable(
        pool,
        on_released=lambda pin: events.append(("released", pin.request_id, pin.release_reason)),
    )
    for request_id in ("t1", "t2"):
        blocks = pool.allocate(1)
        pool.cache_full_blocks(blocks, [request_id.encode()], 0, 1)
        pins.add("J", request_id, blocks, now_s=0.0, ttl_s=1.0)
    pins.release("J", PinReleaseReason.EXPIRED, now_s=2.0)
    pins.release("J", PinReleaseReason.EXPIRED, now_s=3.0)  # nothing left: no event
    assert events == [
        ("released", "t1", PinReleaseReason.REPLACED),
        ("released", "t2", PinReleaseReason.EXPIRED),
    ]
