"""`HostStacks`: a sampled thread's time by innermost frame and by the repository's frame
above it, the switch interval restored, and misuse refused."""

from __future__ import annotations

import sys
import time

import pytest

from eval.host_stacks import HostStacks


def _busy_python(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sum(range(200))


def _asleep(seconds: float) -> None:
    time.sleep(seconds)


def test_the_sampled_time_goes_to_the_functions_the_thread_was_in() -> None:
    switch_interval_s = sys.getswitchinterval()
    with HostStacks(interval_s=0.001) as stacks:
        _busy_python(0.15)
        _asleep(0.1)
    assert sys.getswitchinterval() == switch_interval_s
    by_function: dict[str, float] = {}
    for (leaf, own), seconds in stacks.seconds.items():
        # Both are in this file, the repository's own code: each frame is its own caller's.
        assert leaf == own or own.endswith("test_the_sampled_time_goes_to_the_functions_"
                                           "the_thread_was_in")
        name = leaf.split()[-1]
        by_function[name] = by_function.get(name, 0.0) + seconds
    assert by_function.get("_busy_python", 0.0) == pytest.approx(0.15, abs=0.06)
    assert by_function.get("_asleep", 0.0) == pytest.approx(0.1, abs=0.05)
    assert stacks.num_samples > 50
    table = stacks.table(rows=3, num_steps=2)
    assert table.splitlines()[1] == "| ms | share | innermost frame | repository frame above it |"
    assert "tests/eval/test_host_stacks.py:" in table and "sampled, a step, over 2" in table
    assert len(table.splitlines()) == 3 + min(3, len(stacks.seconds))
    assert stacks.table().splitlines()[0].endswith("sampled, the run")


def test_a_sampler_is_entered_once_at_a_time_and_needs_a_positive_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        HostStacks(interval_s=0)
    stacks = HostStacks()
    with stacks, pytest.raises(RuntimeError, match="already sampling"):
        stacks.__enter__()
