"""`HostStacks`: a sampled thread's time by innermost function and the repository's line
above it, and by repository line inclusive; code that is not the repository's (the standard
library, `exec`'d code, installed packages) named as such; the switch interval restored, an
exception let through, misuse refused."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest

from lab import host_stacks
from lab.host_stacks import HostStacks

THIS_FILE = "tests/lab/test_host_stacks.py"


def _busy_python(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sum(range(200))


def _in_the_standard_library(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    values = list(range(2000))
    while time.perf_counter() < deadline:
        statistics.pvariance(values)


def _by_function(stacks: HostStacks) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for (leaf, _), leaf_s in stacks.seconds.items():
        seconds[leaf] = seconds.get(leaf, 0.0) + leaf_s
    return seconds


def test_the_sampled_time_goes_to_the_functions_the_thread_was_in() -> None:
    switch_interval_s = sys.getswitchinterval()
    started_s = time.perf_counter()
    with HostStacks(interval_s=0.001) as stacks:
        _busy_python(0.3)
        time.sleep(0.2)
    wall_s = time.perf_counter() - started_s
    assert sys.getswitchinterval() == switch_interval_s
    by_function = _by_function(stacks)
    # A sample is charged the time since the last one, so a sampler starved by a busy host
    # moves time from one function to the next; the total stays the time sampled.
    assert 0.35 <= sum(by_function.values()) <= wall_s
    assert by_function.get(f"{THIS_FILE} _busy_python", 0.0) >= 0.15
    # Asleep in C: the sampled line is this test's own, the line that called.
    here = f"{THIS_FILE} test_the_sampled_time_goes_to_the_functions_the_thread_was_in"
    assert by_function.get(here, 0.0) >= 0.1
    assert stacks.num_samples > 50
    # The repository's line above `_busy_python` is this test's call of it.
    callers = {above for (leaf, above) in stacks.seconds if leaf.endswith(" _busy_python")}
    assert len(callers) == 1 and callers.pop().startswith(f"{THIS_FILE}:")
    table = stacks.table(rows=3, num_steps=2)
    assert "sampled, a step, over 2" in table.splitlines()[0]
    assert "| ms | share | innermost function | the repository's line above it |" in table
    assert "| ms | share | repository line, with what it calls |" in table
    assert stacks.table().splitlines()[0].endswith("sampled, the run")


def test_time_in_other_code_goes_to_the_repository_line_that_called_it() -> None:
    with HostStacks(interval_s=0.001) as stacks:
        _in_the_standard_library(0.15)
    outside = {leaf: above for (leaf, above) in stacks.seconds
               if not leaf.startswith(THIS_FILE)}
    assert outside and all(not leaf.startswith("/work") for leaf in outside)
    assert all(above.split()[-1] == "_in_the_standard_library" for above in outside.values())
    # Inclusive: the helper's loop line holds (nearly) all the samples, whatever is inside.
    helper = max(seconds for line, seconds in stacks.inclusive_seconds.items()
                 if line.endswith(" _in_the_standard_library"))
    assert helper >= 0.8 * sum(stacks.seconds.values())


def test_source_files_are_the_repositorys_only_when_they_are_real_files_under_it() -> None:
    repository = Path(host_stacks.__file__).resolve().parents[1]
    assert host_stacks._source(str(repository / "engine" / "clock.py")) == (
        "engine/clock.py", True)
    assert host_stacks._source("<string>") == ("<string>", False)  # exec'd, e.g. Triton's
    assert host_stacks._source("<frozen importlib._bootstrap>").is_repository_code is False
    installed = repository / ".venv" / "lib" / "site-packages" / "torch" / "nn" / "x.py"
    assert host_stacks._source(str(installed)).is_repository_code is False
    name, own = host_stacks._source(statistics.__file__)
    assert not own and name == "statistics.py"  # short: from the sys.path entry holding it


def test_an_exception_inside_passes_through_and_restores_the_interval() -> None:
    switch_interval_s = sys.getswitchinterval()
    stacks = HostStacks()
    with pytest.raises(KeyError), stacks:
        raise KeyError("inside")
    assert sys.getswitchinterval() == switch_interval_s
    with stacks:  # enterable again; the counts add up
        _busy_python(0.01)


def test_a_sampler_is_entered_once_at_a_time_and_needs_positive_figures() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        HostStacks(interval_s=0)
    stacks = HostStacks()
    with stacks, pytest.raises(RuntimeError, match="already sampling"):
        stacks.__enter__()
    with pytest.raises(ValueError, match="num_steps"):
        stacks.table(num_steps=0)


def test_the_sampler_s_own_exit_is_recognised_and_never_recorded() -> None:
    # The thread can be sampled inside `__exit__` before the stop flag is set; such a stack
    # (here, the join of the sampling thread) is the sampler's own.
    seen: list[bool] = []
    stacks = HostStacks(interval_s=0.001)
    with stacks:
        thread = stacks._thread
        assert thread is not None

        class Joining:
            def join(self) -> None:
                seen.append(host_stacks._in_sampler(sys._getframe()))
                thread.join()

        stacks._thread = Joining()  # type: ignore[assignment]
    assert seen == [True] and not host_stacks._in_sampler(sys._getframe())
