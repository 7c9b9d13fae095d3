"""Per-request statistics the frontend reports as outputs arrive (latencies, token counts).

The `OutputProcessor` calls a `RequestStatsObserver` (for example the HTTP server's Prometheus
metrics) on its own monotonic clock. Observers must be cheap: they run on the output path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class FinishedCompletionStats:
    """One finished completion (one of a request's `n`): why it ended and what it cost.

    `e2e_latency_s` runs from the request's arrival at the frontend to the completion's end.
    """

    finish_reason: str
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int


class RequestStatsObserver(Protocol):
    """Told about each completion's progress, in seconds of the frontend's clock.

    `on_first_token` once per completion when its first tokens arrive (time since the
    request's arrival); `on_inter_token` for each later output that carries tokens (time since
    the completion's previous tokens, per token); `on_completion_finished` once at its end,
    also for aborted or rejected completions.
    """

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_inter_token(self, interval_s: float) -> None: ...

    def on_completion_finished(self, stats: FinishedCompletionStats) -> None: ...
