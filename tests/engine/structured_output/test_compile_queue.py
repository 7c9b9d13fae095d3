"""`CompileQueue`: waiting compiles taken by tenants in turn."""

from __future__ import annotations

import threading

from engine.structured_output.compile_queue import CompileQueue


def _drain(queue: CompileQueue[str]) -> list[str]:
    taken = []
    while (item := queue.take()) is not None:
        taken.append(item)
    return taken


def test_tenants_take_turns_and_each_keeps_its_order() -> None:
    queue: CompileQueue[str] = CompileQueue(lambda item: True)
    for index in range(4):
        queue.add("flood", f"f{index}")
    queue.add("other", "o0")
    queue.add("other", "o1")
    queue.add(None, "n0")
    # Tenants seen later come first (none has had a turn yet); then each goes to the back.
    assert _drain(queue) == ["n0", "o0", "f0", "o1", "f1", "f2", "f3"]
    assert queue.take() is None


def test_a_tenant_that_just_had_its_turn_goes_behind_the_others() -> None:
    queue: CompileQueue[str] = CompileQueue(lambda item: True)
    queue.add("flood", "f0")
    assert queue.take() == "f0"
    for index in range(1, 4):
        queue.add("flood", f"f{index}")
    queue.add("victim", "v0")
    assert _drain(queue) == ["v0", "f1", "f2", "f3"]
    queue.add("flood", "f4")
    queue.add("victim", "v1")  # added later, but the flood's last turn came after the victim's
    assert _drain(queue) == ["v1", "f4"]


def test_dead_items_are_skipped_and_a_shared_item_comes_out_once() -> None:
    started: set[str] = set()
    queue: CompileQueue[str] = CompileQueue(lambda item: item not in started and
                                            not item.startswith("cancelled"))
    queue.add("a", "shared")
    queue.add("a", "cancelled")
    queue.add("a", "a1")
    queue.add("b", "b0")
    queue.add("b", "shared")
    taken = []
    while (item := queue.take()) is not None:
        started.add(item)
        taken.append(item)
    assert taken == ["b0", "shared", "a1"]


def test_clear_returns_each_waiting_item_once() -> None:
    queue: CompileQueue[str] = CompileQueue(lambda item: True)
    queue.add("a", "shared")
    queue.add("b", "shared")
    queue.add("b", "b0")
    assert sorted(queue.clear()) == ["b0", "shared"]
    assert queue.take() is None


def test_threads_adding_while_one_takes_lose_nothing() -> None:
    queue: CompileQueue[int] = CompileQueue(lambda item: True)
    taken: list[int] = []
    done = threading.Event()

    def take_until_done() -> None:
        while True:
            finished = done.is_set()
            item = queue.take()
            if item is not None:
                taken.append(item)
            elif finished:
                return

    taker = threading.Thread(target=take_until_done)
    taker.start()
    adders = [threading.Thread(target=lambda tenant=tenant: [
        queue.add(tenant, tenant * 1000 + index) for index in range(500)])
        for tenant in range(4)]
    for adder in adders:
        adder.start()
    for adder in adders:
        adder.join()
    done.set()
    taker.join()
    assert sorted(taken) == sorted(tenant * 1000 + index for tenant in range(4)
                                   for index in range(500))
