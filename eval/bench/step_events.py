"""What else ran inside a timed engine step: Python's collections and Triton's compiles.

`bench throughput --slow-steps` reports its slowest steps; these are the two causes of a
rare long step that the step's own figures cannot show. A collection of the oldest
generation walks every tracked object (`engine.core.gc_heap`); a kernel that meets a new
specialization, or an autotuner a new key, compiles in the step that launches it (hundreds
of milliseconds on a fresh machine, whose cache is empty).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

NUM_GENERATIONS = 3


@dataclass(frozen=True)
class StepEvents:
    """What `StepEventRecorder.take` saw since its last take: collections by generation
    (oldest last), their milliseconds in all, and the Triton kernels compiled, by name."""

    gc_collections: tuple[int, ...] = (0,) * NUM_GENERATIONS
    gc_ms: float = 0.0
    triton_compiles: tuple[str, ...] = ()


@dataclass
class StepEventRecorder:
    """Records collections and compiles between `take`s while entered (a context manager).

    Entering appends a callback to `gc.callbacks` and sets Triton's
    `knobs.runtime.jit_post_compile_hook` (calling the hook it replaces, if any); leaving
    removes both. Without Triton, only collections are recorded. One recorder at a time: a
    second one's hook would chain to the first's. Not thread-safe (collections run in any
    thread; counts are only read between steps)."""

    _collections: list[int] = field(default_factory=lambda: [0] * NUM_GENERATIONS)
    _gc_s: float = 0.0
    _compiles: list[str] = field(default_factory=list)
    _started_s: float | None = None
    _replaced_hook: Callable[..., Any] | None = None
    _knobs: Any = None

    def __enter__(self) -> StepEventRecorder:
        gc.callbacks.append(self._on_collection)
        self._knobs = _triton_runtime_knobs()
        if self._knobs is not None:
            self._replaced_hook = self._knobs.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._on_compile
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        gc.callbacks.remove(self._on_collection)
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._replaced_hook
            self._knobs = None

    def take(self) -> StepEvents:
        """The events since the last take (or since entering), and a fresh count."""
        events = StepEvents(tuple(self._collections), self._gc_s * 1e3,
                            tuple(self._compiles))
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

    def _on_compile(self, *, fn: Any, **kwargs: Any) -> bool | None:
        self._compiles.append(str(getattr(fn, "name", fn)))
        if self._replaced_hook is not None:
            return self._replaced_hook(fn=fn, **kwargs)
        return None


def _triton_runtime_knobs() -> Any:
    """Triton's runtime knobs, or None without Triton (it is an optional dependency)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime
