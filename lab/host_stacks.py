"""Where a thread's wall time goes, by sampling its Python stack from another thread: what the
torch profiler's table of operators cannot say when a step's host time is spent between
operators (Triton's launcher, its argument binding, an autotuner, the engine's own Python).

`HostStacks` is entered around the work to sample, once or several times (the counts add up
across entries). Every `interval_s` (nominal: the GIL handover makes it about twice that on
a loaded CPU) its thread reads the sampled thread's current frame (`sys._current_frames`);
each sample weighs the seconds since the previous one, so a call that holds the GIL, during
which no sample can be taken, still counts in full, against the line the thread is on when
it lets go (the line that made the call). While sampling, Python's switch interval is
lowered to `interval_s / 2` so that a thread busy in Python hands over the GIL on time; it is
restored on exit. Sampling slows the sampled thread's Python: a pure-Python loop ran about
11 % slower at 0.5 ms on this 2-core CPU (a review's measurement), so time a step apart from
sampling it.

The time is wall time: a thread waiting for the device (`torch.cuda.synchronize`, a copy to
the host) is sampled in that wait as in work.

`table` prints two views, in milliseconds (a step's, or the run's) and shares:
- by innermost function (`file function`, its path short: from the `sys.path` entry that
  holds it, or from the repository) and the repository's nearest line above it (`file:line
  function`, the engine's call that led there);
- by repository line, each counted once a sample whatever its depth: the engine's code
  inclusive of what it calls.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import NamedTuple

_REPO = Path(__file__).resolve().parents[1]


class _SourceFile(NamedTuple):
    short_name: str
    is_repository_code: bool


class HostStacks:
    """Samples the Python stack of the thread that enters it (see the module docstring).
    Read `seconds`, `inclusive_seconds` and `table` after exiting."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        # (innermost function, repository line above it) -> seconds
        self.seconds: collections.Counter[tuple[str, str]] = collections.Counter()
        # repository line -> seconds of the samples with it on the stack
        self.inclusive_seconds: collections.Counter[str] = collections.Counter()
        self.num_samples = 0
        self._entered = threading.Event()  # set once `__enter__` is done, until `__exit__`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._switch_interval_s = 0.0

    def __enter__(self) -> HostStacks:
        if self._thread is not None:
            raise RuntimeError("HostStacks is already sampling")
        self._stop.clear()
        self._entered.clear()
        self._error = None
        thread = threading.Thread(target=self._sample, args=(threading.get_ident(),),
                                  name="host-stacks", daemon=True)
        thread.start()
        self._thread = thread
        self._switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(self.interval_s / 2)
        self._entered.set()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
        finally:
            self._thread = None
            sys.setswitchinterval(self._switch_interval_s)
        if self._error is not None and exc is None:
            raise RuntimeError("the host stack sampler failed") from self._error

    def _sample(self, target: int) -> None:
        try:
            last_s = time.perf_counter()
            while not self._stop.wait(self.interval_s):
                frame = sys._current_frames().get(target)
                now_s = time.perf_counter()
                # Not the sampler's own start or exit: the flags bound it, but the thread
                # may be sampled inside `__enter__` or `__exit__` before either flag moves.
                if (frame is not None and self._entered.is_set() and not self._stop.is_set()
                        and not _in_sampler(frame)):
                    self._record(frame, now_s - last_s)
                last_s = now_s
        except BaseException as error:  # handed to the sampled thread on exit
            self._error = error

    def _record(self, frame: FrameType, seconds: float) -> None:
        leaf = f"{_source(frame.f_code.co_filename).short_name} {frame.f_code.co_name}"
        above: str | None = None  # the repository's nearest line strictly above the leaf
        own_lines: list[str] = []
        caller: FrameType | None = frame
        while caller is not None:
            if _source(caller.f_code.co_filename).is_repository_code:
                # Each frame's line read once: the thread runs on between reads.
                own_line = _line(caller)
                own_lines.append(own_line)
                if above is None and caller is not frame:
                    above = own_line
            caller = caller.f_back
        self.seconds[(leaf, above or "-")] += seconds
        for own_line in dict.fromkeys(own_lines):
            self.inclusive_seconds[own_line] += seconds
        self.num_samples += 1

    def table(self, rows: int = 15, num_steps: int | None = None) -> str:
        """Both views (module docstring) as markdown tables of their `rows` largest entries,
        in milliseconds a step over `num_steps` steps, or of the whole run (None)."""
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps must be positive, got {num_steps}")
        total_s = sum(self.seconds.values())
        per = num_steps or 1
        unit = "the run" if num_steps is None else f"a step, over {num_steps}"
        lines = [f"{self.num_samples} samples; {1e3 * total_s / per:.2f} ms sampled, {unit}",
                 "| ms | share | innermost function | the repository's line above it |",
                 "|---:|---:|---|---|"]
        lines += [f"| {1e3 * seconds / per:.2f} | {_share(seconds, total_s)} | {leaf} | "
                  f"{above} |" for (leaf, above), seconds in self.seconds.most_common(rows)]
        lines += ["", "| ms | share | repository line, with what it calls |", "|---:|---:|---|"]
        lines += [f"| {1e3 * seconds / per:.2f} | {_share(seconds, total_s)} | {own_line} |"
                  for own_line, seconds in self.inclusive_seconds.most_common(rows)]
        return "\n".join(lines)


_SAMPLER_CODES = frozenset({HostStacks.__enter__.__code__, HostStacks.__exit__.__code__})


def _in_sampler(frame: FrameType | None) -> bool:
    """Whether a stack runs the sampler's own start or exit (`HostStacks.__enter__` or
    `__exit__`, or what they call)."""
    while frame is not None:
        if frame.f_code in _SAMPLER_CODES:
            return True
        frame = frame.f_back
    return False


def _share(seconds: float, total_s: float) -> str:
    return f"{seconds / total_s:.0%}" if total_s else "-"


def _line(frame: FrameType) -> str:
    code = frame.f_code
    return f"{_source(code.co_filename).short_name}:{frame.f_lineno} {code.co_name}"


@functools.cache
def _source(filename: str) -> _SourceFile:
    """A source file's short name and whether it is the repository's own code (a real file
    under the repository, not in an environment installed there); cached, as the sampler
    holds the GIL. Code built by `exec` (`<string>`) and frozen modules are not the
    repository's, wherever the process started."""
    if filename.startswith("<") or not Path(filename).is_absolute():
        return _SourceFile(filename, False)
    path = Path(filename).resolve()
    installed = {"site-packages", "dist-packages", ".venv"} & set(path.parts)
    if not installed and path.is_relative_to(_REPO):
        return _SourceFile(str(path.relative_to(_REPO)), True)
    entries = [Path(entry).resolve() for entry in sys.path if entry]
    holders = [entry for entry in entries if path.is_relative_to(entry) and entry != path]
    if holders:
        return _SourceFile(str(path.relative_to(max(holders, key=lambda e: len(e.parts)))),
                           False)
    return _SourceFile(filename, False)
