"""The jobs the engine gave an agent's turns, read from the scheduler trace of a live server.

An agent framework sends no job fields on its default path; the engine infers each turn's
job, and the trace's `request_arrived` records say which (`job_id`, `inferred_from`), while
`request_finished` records carry each turn's prefix-cache hit. `TracedServer.turns(run)` runs
an agent and returns the turns that arrived meanwhile, so the suite's modules can assert that
one agent run is one job whose later turns hit the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.engine.entrypoints.openai.conftest import ServerThread
from tracing.reader import read_trace
from tracing.records import RequestArrived, RequestFinished

T = TypeVar("T")


@dataclass(frozen=True)
class Turn:
    """One engine request of an agent run: its arrival and its end."""

    arrived: RequestArrived
    finished: RequestFinished

    @property
    def request_id(self) -> str:
        return self.arrived.request_id

    @property
    def job_id(self) -> str | None:
        return self.arrived.job_id


class TracedServer(ServerThread):
    """A live server whose engine traces every scheduler step to `trace`."""

    def __init__(self, *args: Any, trace: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace = trace

    def turns(self, run: Callable[[], T]) -> tuple[T, list[Turn]]:
        """`run()`'s result and the requests that arrived while it ran, in arrival order (it
        must be the only client meanwhile)."""
        before = self._num_events()
        result = run()
        self.wait_idle()
        events = read_trace(self.trace).events[before:]
        finished = {event.request_id: event for event in events
                    if isinstance(event, RequestFinished)}
        turns = [Turn(event, finished[event.request_id]) for event in events
                 if isinstance(event, RequestArrived)]
        return result, turns

    def _num_events(self) -> int:
        return len(read_trace(self.trace).events) if self.trace.exists() else 0


def check_one_job(turns: list[Turn], num_turns: int, block_size: int) -> str:
    """`turns` are one inferred job of `num_turns` turns, each continuing the one before, and
    each later turn's prompt hit the cache for at least the full blocks of the previous
    turn's prompt; returns the job's id."""
    assert len(turns) == num_turns, [turn.request_id for turn in turns]
    (job_id,) = {turn.job_id for turn in turns}
    assert job_id is not None and all(turn.arrived.job_inferred for turn in turns)
    assert turns[0].arrived.inferred_from is None
    for previous, turn in itertools.pairwise(turns):
        assert turn.arrived.inferred_from == previous.request_id
        full_blocks = previous.arrived.num_prompt_tokens // block_size * block_size
        assert turn.finished.num_cached_tokens >= full_blocks > 0
    return job_id


def jobs_of(turns: list[Turn]) -> dict[str, list[str]]:
    """The request ids of each job's turns, in arrival order."""
    jobs: dict[str, list[str]] = {}
    for turn in turns:
        assert turn.job_id is not None
        jobs.setdefault(turn.job_id, []).append(turn.request_id)
    return jobs
