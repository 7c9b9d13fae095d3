"""`eval.gpu.kernel_timing.host_us`: the host's time of a call, the queue drained outside it."""

from __future__ import annotations

import time

from eval.gpu.kernel_timing import host_us


def test_the_device_queue_is_drained_every_few_calls_and_after_the_last() -> None:
    events: list[str] = []
    host_us(lambda: events.append("call"), lambda: events.append("drain"), calls=10,
            drain_every=4)
    assert events.count("call") == 10
    # Before calls 0, 4 and 8, then once after the last.
    assert [index for index, event in enumerate(events) if event == "drain"] == [0, 5, 10, 13]


def test_the_drains_are_not_timed() -> None:
    # A drain before every call, far longer than the call: timed, every sample would hold one.
    median_us = host_us(lambda: time.sleep(0.002), lambda: time.sleep(0.03), calls=6,
                        drain_every=1)
    assert 2000 <= median_us < 30000
