"""The preparation pool: one tenant's flood never takes every thread, tenants are served in
turn, a tenant's queue is bounded (429), cancelled waiters leave it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import weakref
from collections.abc import Callable

import pytest

from engine.entrypoints.openai import work_pool
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.work_pool import BACKGROUND_NICENESS, TenantWorkPool


def _blocker(started: list[str], name: str, gate: threading.Event) -> Callable[[], str]:
    def work() -> str:
        started.append(name)
        gate.wait(10)
        return name
    return work


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_a_flooding_tenant_leaves_threads_to_the_others():
    async def scenario() -> None:
        pool = TenantWorkPool.for_tenants(2, num_threads=4)
        assert pool.max_threads_per_tenant == 2
        gate, started = threading.Event(), []
        flood = [asyncio.ensure_future(pool.run("attacker", _blocker(started, f"a{i}", gate)))
                 for i in range(10)]
        await _until(lambda: pool.num_running("attacker") == 2)
        assert pool.num_waiting("attacker") == 8
        # The attacker's items all wait on the gate, yet the victim's runs at once.
        assert await asyncio.wait_for(pool.run("victim", lambda: "served"), 5) == "served"
        gate.set()
        assert sorted(await asyncio.gather(*flood)) == sorted(f"a{i}" for i in range(10))
        pool.shutdown()
    asyncio.run(scenario())


def test_tenants_are_served_in_turn():
    async def scenario() -> None:
        pool = TenantWorkPool(1)
        gate, started = threading.Event(), []
        first = asyncio.ensure_future(pool.run("a", _blocker(started, "a0", gate)))
        await _until(lambda: started == ["a0"])
        order: list[str] = []
        waiting = [asyncio.ensure_future(pool.run(tenant, order.append, f"{tenant}{index}"))
                   for tenant, index in (("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2))]
        gate.set()
        await asyncio.gather(first, *waiting)
        assert order == ["b1", "a1", "b2", "a2", "a3"]
        pool.shutdown()
    asyncio.run(scenario())


def test_a_full_queue_answers_429_and_changes_nothing():
    async def scenario() -> None:
        pool = TenantWorkPool(1, max_waiting_per_tenant=2, retry_after_s=7)
        gate, started = threading.Event(), []
        running = asyncio.ensure_future(pool.run("a", _blocker(started, "a0", gate)))
        await _until(lambda: started == ["a0"])
        queued = [asyncio.ensure_future(pool.run("a", lambda: "ok")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as refused:
            await pool.run("a", lambda: "refused")
        assert refused.value.status_code == 429
        assert refused.value.headers == {"Retry-After": "7"}
        assert pool.num_waiting("a") == 2
        gate.set()
        assert await asyncio.gather(running, *queued) == ["a0", "ok", "ok"]
        pool.shutdown()
    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_errors_reach_the_caller():
    async def scenario() -> None:
        pool = TenantWorkPool(1)
        gate, started = threading.Event(), []
        running = asyncio.ensure_future(pool.run("a", _blocker(started, "a0", gate)))
        await _until(lambda: started == ["a0"])
        ran: list[str] = []
        waiter = asyncio.ensure_future(pool.run("a", ran.append, "never"))
        await asyncio.sleep(0)
        assert pool.num_waiting("a") == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert pool.num_waiting("a") == 0
        gate.set()
        await running

        def fail() -> None:
            raise ValueError("bad input")
        with pytest.raises(ValueError, match="bad input"):
            await pool.run("a", fail)
        assert ran == []
        assert (pool.num_running("a"), pool.num_waiting("a")) == (0, 0)
        pool.shutdown()
    asyncio.run(scenario())


class Body:
    """Stands for a request body that only the caller's frame refers to."""


def test_a_failed_item_leaves_nothing_for_the_cyclic_gc() -> None:
    """An item's exception, kept in its future, must not tie the caller's frames (and the
    request body they hold) into a cycle: with the cyclic GC off they are freed at once."""
    def fail(body: Body) -> None:
        raise ValueError("over a limit")

    async def parse(pool: TenantWorkPool, body: Body) -> None:
        await pool.run("a", fail, body, background=True)

    async def scenario() -> weakref.ref[Body]:
        pool = TenantWorkPool(1)
        body = Body()
        alive = weakref.ref(body)
        with contextlib.suppress(ValueError):
            await parse(pool, body)
        del body
        pool.shutdown()
        return alive

    gc.disable()
    try:
        assert asyncio.run(scenario())() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("kwargs", [{"num_threads": 0}, {"max_waiting_per_tenant": 0},
                                    {"num_threads": 2, "max_threads_per_tenant": 3}])
def test_bad_sizes_are_refused(kwargs):
    with pytest.raises(ValueError):
        TenantWorkPool(**kwargs)


def test_one_tenant_may_use_every_thread():
    assert TenantWorkPool.for_tenants(1, num_threads=6).max_threads_per_tenant == 6
    assert TenantWorkPool.for_tenants(3, num_threads=1).max_threads_per_tenant == 1


def _thread_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_background_work_runs_at_lower_cpu_priority_in_the_same_turns():
    async def scenario() -> None:
        pool = TenantWorkPool.for_tenants(2, num_threads=2)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert await pool.run("a", _thread_niceness) == base
        assert await pool.run("a", _thread_niceness, background=True) == max(
            base, BACKGROUND_NICENESS)
        gate, started = threading.Event(), []
        held = asyncio.ensure_future(pool.run("a", _blocker(started, "bg", gate),
                                              background=True))
        await _until(lambda: pool.num_running("a") == 1)
        second = asyncio.ensure_future(pool.run("a", _blocker(started, "fg", gate)))
        await asyncio.sleep(0.05)
        assert pool.num_waiting("a") == 1  # one thread a tenant, whichever the priority
        gate.set()
        assert await asyncio.gather(held, second) == ["bg", "fg"]
        pool.shutdown()

    asyncio.run(scenario())


def test_large_bodies_take_at_most_the_background_threads_and_small_ones_pass_them():
    async def scenario() -> None:
        pool = TenantWorkPool.for_tenants(2, num_threads=4, num_background_threads=1)
        gate, started = threading.Event(), []
        large = [asyncio.ensure_future(pool.run(tenant, _blocker(started, name, gate),
                                                background=True))
                 for tenant, name in (("a", "a-large0"), ("a", "a-large1"), ("b", "b-large"))]
        await _until(lambda: started == ["a-large0"])
        await asyncio.sleep(0.05)
        assert started == ["a-large0"]  # one background thread, whoever waits
        # A small item waits behind neither its tenant's large one nor the other tenant's.
        assert await asyncio.wait_for(pool.run("b", lambda: "small"), 5) == "small"
        gate.set()
        assert await asyncio.gather(*large) == ["a-large0", "a-large1", "b-large"]
        # b's small item did not cost its large one its background turn.
        assert started == ["a-large0", "b-large", "a-large1"]
        pool.shutdown()
    asyncio.run(scenario())


def test_a_tenant_sending_small_items_keeps_its_large_ones_turn():
    async def scenario() -> None:
        pool = TenantWorkPool.for_tenants(2, num_threads=4, num_background_threads=1)
        gate, started = threading.Event(), []
        first = asyncio.ensure_future(pool.run("a", _blocker(started, "a0", gate),
                                               background=True))
        await _until(lambda: started == ["a0"])
        backlog = [asyncio.ensure_future(pool.run("a", _blocker(started, f"a{i}", gate),
                                                  background=True)) for i in range(1, 6)]
        large_b = asyncio.ensure_future(pool.run("b", _blocker(started, "B", gate),
                                                 background=True))
        for _ in range(5):  # b keeps starting small items while a's backlog waits
            assert await asyncio.wait_for(pool.run("b", lambda: "small"), 5) == "small"
        gate.set()
        await asyncio.gather(first, *backlog, large_b)
        assert started.index("B") == 1  # the next background item, not the last
        pool.shutdown()
    asyncio.run(scenario())


def test_shutdown_fails_waiting_and_later_items_with_503():
    async def scenario() -> None:
        pool = TenantWorkPool(2, num_background_threads=1)
        gate, started = threading.Event(), []
        running = asyncio.ensure_future(pool.run("a", _blocker(started, "run", gate),
                                                 background=True))
        await _until(lambda: started == ["run"])
        waiting = asyncio.ensure_future(pool.run("a", lambda: "never", background=True))
        await _until(lambda: pool.num_waiting("a") == 1)
        pool.shutdown()
        with pytest.raises(APIError) as refused:
            await waiting
        assert refused.value.status_code == 503
        gate.set()
        assert await running == "run"  # a running item finishes
        await _until(lambda: pool.num_running("a") == 0)
        with pytest.raises(APIError):
            await pool.run("a", lambda: "late")
    asyncio.run(scenario())


def test_the_background_threads_default_to_the_cores_left_to_them(monkeypatch):
    monkeypatch.setattr(work_pool, "usable_cores", lambda: 16)
    assert TenantWorkPool(20).num_background_threads == 8  # MAX_DEFAULT_BACKGROUND_THREADS
    assert TenantWorkPool(6).num_background_threads == 6
    monkeypatch.setattr(work_pool, "usable_cores", lambda: 7)
    assert TenantWorkPool(20).num_background_threads == 5
    monkeypatch.setattr(work_pool, "usable_cores", lambda: 2)
    assert TenantWorkPool(6).num_background_threads == 1
    with pytest.raises(ValueError, match="num_background_threads"):
        TenantWorkPool(2, num_background_threads=3)


def test_each_tenants_large_bodies_are_sent_at_its_own_pace():
    """1 MB a second after a burst of 0.1 s of it: a tenant's second and third megabytes wait
    for the first to be paid for; another tenant's do not wait for them; after a pause the
    burst is there again."""
    now_s = [100.0]
    slept: list[tuple[str, float]] = []
    current: list[str] = [""]

    async def sleep(delay_s: float) -> None:
        slept.append((current[0], round(delay_s, 6)))

    async def send(tenant: str, num_bytes: int) -> None:
        current[0] = tenant
        await pool.pace_large_body(tenant, num_bytes)

    pool = TenantWorkPool(2, large_body_bytes_per_s=1e6, clock=lambda: now_s[0], sleep=sleep)
    try:
        asyncio.run(send("a", 100_000))  # within the burst
        assert slept == []
        asyncio.run(send("a", 1_000_000))
        asyncio.run(send("a", 1_000_000))
        asyncio.run(send("b", 1_000_000))
        assert slept == [("a", 1.0), ("a", 2.0), ("b", 0.9)]
        now_s[0] += 10.0
        asyncio.run(send("a", 100_000))
        assert slept[3:] == []
    finally:
        pool.shutdown()
    with pytest.raises(ValueError, match="large_body_bytes_per_s"):
        TenantWorkPool(2, large_body_bytes_per_s=0)
