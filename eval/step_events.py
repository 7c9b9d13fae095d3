"""What else ran inside a timed engine step: Python's collections and Triton's compiles.

`bench throughput --slow-steps` reports its slowest steps; these are the two causes of a
rare long step that the step's own figures cannot show. A collection of the oldest
generation walks every tracked object (`engine.core.gc_heap`); a kernel that meets a new
specialization, or an autotuner a new key, compiles in the step that launches it (hundreds
of milliseconds on a fresh machine, whose cache is empty), or loads the compiled kernel
from Triton's disk cache when an earlier process compiled it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

NUM_GENERATIONS = len(gc.get_count())


@dataclass(frozen=True)
class StepEvents:
    """What `StepEventRecorder.take` saw since its last take: collections by generation
    (oldest last), their milliseconds in all, and Triton's kernels compiled, each as `NAME
    (N ms)` or `NAME (from the disk cache)`; None when Triton's listener was not set (no
    Triton)."""

    gc_collections: tuple[int, ...] = (0,) * NUM_GENERATIONS
    gc_ms: float = 0.0
    triton_compiles: tuple[str, ...] | None = ()


@dataclass
class StepEventRecorder:
    """Records collections and compiles between `take`s while entered (a context manager).

    Entering sets Triton's `knobs.compilation.listener`, which Triton calls after each
    compile and each load from its disk cache (calling the listener it replaces, if any),
    and appends a callback to `gc.callbacks`; leaving removes both. Without Triton only
    collections are recorded. One recorder at a time: a second one's listener would chain
    to the first's. Counts are read between steps; collections run in any thread."""

    _collections: list[int] = field(init=False, default_factory=lambda: [0] * NUM_GENERATIONS)
    _gc_s: float = field(init=False, default=0.0)
    _compiles: list[str] = field(init=False, default_factory=list)
    _started_s: float | None = field(init=False, default=None)
    _replaced_listener: Callable[..., Any] | None = field(init=False, default=None)
    _knobs: Any = field(init=False, default=None)

    def __enter__(self) -> StepEventRecorder:
        self._knobs = _triton_compilation_knobs()
        if self._knobs is not None:
            self._replaced_listener = self._knobs.listener
            self._knobs.listener = self._on_compile
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        gc.callbacks.remove(self._on_collection)
        if self._knobs is not None:
            self._knobs.listener = self._replaced_listener
            self._knobs = None

    def take(self) -> StepEvents:
        """The events since the last take (or since entering), and a fresh count."""
        events = StepEvents(tuple(self._collections), self._gc_s * 1e3,
                            tuple(self._compiles) if self._knobs is not None else None)
        self._collections = [0] * NUM_GENERATIONS
        self._gc_s = 0.0
        self._compiles = []
        return events

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
            return
        self._collections[info["generation"]] += 1
        if self._started_s is not None:
            self._gc_s += time.perf_counter() - self._started_s
            self._started_s = None

    def _on_compile(self, *, src: Any, times: Any, cache_hit: bool, **kwargs: Any) -> None:
        name = str(getattr(src, "name", src))
        self._compiles.append(f"{name} (from the disk cache)" if cache_hit
                              else f"{name} ({times.total / 1e3:.0f} ms)")
        if self._replaced_listener is not None:
            self._replaced_listener(src=src, times=times, cache_hit=cache_hit, **kwargs)


def _triton_compilation_knobs() -> Any:
    """Triton's compilation knobs (`knobs.compilation`, whose `listener` Triton's compiler
    calls), or None without Triton (an optional dependency) or with one that has none."""
    try:
        from triton import knobs
    except ImportError:
        return None
    compilation = getattr(knobs, "compilation", None)
    return compilation if hasattr(compilation, "listener") else None
