"""Where a thread's Python time goes, by sampling its stack from another thread: what the torch
profiler's table of operators cannot say when a step's host time is spent between operators
(Triton's launcher, an autotuner, the engine's own Python).

`HostStacks` is entered around the work to sample. Every `interval_s` its thread reads the
sampled thread's current frame (`sys._current_frames`); each sample weighs the seconds since
the previous one, so a long call that holds the GIL, during which no sample can be taken,
still counts in full, against the frame the thread is in when it lets go. While sampling,
Python's switch interval is lowered to `interval_s / 2` so that a thread busy in Python
hands over the GIL on time; it is restored on exit. The cost to the sampled thread is a GIL
handover per sample (tens of microseconds at most).

`table` names, for the most sampled places, the innermost frame (`file:line function`, its
path from `site-packages/` or the repository) and the innermost frame of the repository's
own code above it (a file under the repository, not an installed package), with their
milliseconds (a step's, or the run's).
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType

_REPO = Path(__file__).resolve().parents[1]


class HostStacks:
    """Samples the Python stack of the thread that enters it (see the module docstring)."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.seconds: collections.Counter[tuple[str, str]] = collections.Counter()
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch_interval_s = sys.getswitchinterval()

    def __enter__(self) -> HostStacks:
        if self._thread is not None:
            raise RuntimeError("HostStacks is already sampling")
        target = threading.get_ident()
        self._stop.clear()
        self._switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(self.interval_s / 2)
        self._thread = threading.Thread(target=self._sample, args=(target,),
                                        name="host-stacks", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self._thread = None
        sys.setswitchinterval(self._switch_interval_s)

    def _sample(self, target: int) -> None:
        last_s = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(target)
            now_s = time.perf_counter()
            if frame is not None:
                self.seconds[_where(frame)] += now_s - last_s
                self.num_samples += 1
            last_s = now_s

    def table(self, rows: int = 15, num_steps: int | None = None) -> str:
        """A markdown table of the `rows` most sampled (innermost frame, own caller) pairs,
        their milliseconds (a step's, over `num_steps` steps; else the whole run's) and
        their share of all sampled time."""
        total_s = sum(self.seconds.values())
        per = num_steps or 1
        unit = "the run" if num_steps is None else f"a step, over {num_steps}"
        lines = [f"{self.num_samples} samples; {1e3 * total_s / per:.2f} ms sampled, {unit}",
                 "| ms | share | innermost frame | repository frame above it |",
                 "|---:|---:|---|---|"]
        for (leaf, own), seconds in self.seconds.most_common(rows):
            lines.append(f"| {1e3 * seconds / per:.2f} | {seconds / total_s:.0%} | {leaf} | "
                         f"{own} |")
        return "\n".join(lines)


def _where(frame: FrameType) -> tuple[str, str]:
    """The innermost frame, and the innermost frame of the repository's own code (itself
    when it is one; "-" when none is on the stack)."""
    leaf = _describe(frame)
    own: FrameType | None = frame
    while own is not None and not _file(own.f_code.co_filename)[1]:
        own = own.f_back
    return leaf, "-" if own is None else _describe(own)


def _describe(frame: FrameType) -> str:
    return f"{_file(frame.f_code.co_filename)[0]}:{frame.f_lineno} {frame.f_code.co_name}"


@functools.cache
def _file(filename: str) -> tuple[str, bool]:
    """A source file's short name (from `site-packages/`, or from the repository) and
    whether it is the repository's own code; cached, as the sampler holds the GIL."""
    path = Path(filename)
    if "site-packages" in path.parts:
        return "/".join(path.parts[path.parts.index("site-packages") + 1:]), False
    try:
        relative = path.resolve().relative_to(_REPO)
    except ValueError:
        return filename, False
    return str(relative), True
