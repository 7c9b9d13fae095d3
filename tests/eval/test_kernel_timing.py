"""`eval.kernel_timing.host_us`: the host's time of a call, the queue drained outside it."""

from __future__ import annotations

import time

from eval.kernel_timing import host_us


def test_host_time_is_the_calls_median_with_the_drains_untimed() -> None:
    events: list[str] = []

    def call() -> None:
        events.append("call")
        time.sleep(0.002)

    def drain() -> None:
        events.append("drain")
        time.sleep(0.05)  # far longer than a call: timed, it would lift the median

    median_us = host_us(call, drain, calls=10, drain_every=4)
    assert events.count("call") == 10
    # Before calls 0, 4 and 8, then once after the last.
    assert [index for index, event in enumerate(events) if event == "drain"] == [0, 5, 10, 13]
    assert 2000 <= median_us < 50000
