"""Freezing the start-up heap: what exists is kept off the collector's walks, what serving
allocates later is still collected."""

from __future__ import annotations

import gc
import weakref

from engine.core.gc_heap import freeze_startup_heap, startup_heap_frozen


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_the_start_up_heap_is_frozen_and_later_garbage_is_still_collected() -> None:
    before_freeze = _cycle()
    try:
        num_frozen = freeze_startup_heap()
        assert num_frozen > 0 and gc.get_freeze_count() > 0
        assert before_freeze() is None  # start-up's garbage was collected before the freeze
        after_freeze = _cycle()
        assert after_freeze() is not None
        gc.collect()
        assert after_freeze() is None
    finally:
        gc.unfreeze()


def test_a_frozen_block_leaves_the_heap_collectable_again() -> None:
    with startup_heap_frozen() as num_frozen:
        assert num_frozen > 0 and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_frozen_block_leaves_an_already_frozen_heap_frozen() -> None:
    try:
        freeze_startup_heap()
        with startup_heap_frozen() as num_frozen:
            assert num_frozen > 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
