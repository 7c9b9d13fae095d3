"""What the frontend returns for a request: its completions so far, as text and tokens."""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import TokenLogprobs


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    What `text`, `token_ids` and `logprobs` cover depends on the request's output kind: all so
    far (cumulative, final-only) or only what is new since the previous output (delta).
    `finish_reason` is "stop", "length" or "abort" once finished; `stop_reason` is the stop
    string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times of a request on the frontend's monotonic clock, in seconds."""

    arrival_time_s: float
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None
    finished_time_s: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    `outputs` lists the completions this output reports (for delta outputs of an `n > 1`
    request, only those that changed). `finished` is True on the last output of the request.
    `num_cached_tokens` is the prompt's prefix-cache hit. `error` is set when the engine
    rejected the request (it is then finished with reason "abort"), and `error_param` names
    the request field at fault when the engine knows it.

    `prompt_logprobs`, for a request that asked for them, has one entry per prompt token: that
    token's logprobs given the tokens before it, `None` for the first token. Outputs wait until
    it is complete (only a request that ends early reports `None` for positions never
    computed). Delta outputs carry it in the request's first output only. `job_id` is the
    engine's id of the request's job (None: no job, or not known before its first token).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_param: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    job_id: str | None = None


class RequestRejected(ValueError):
    """The engine rejected a request (`RequestOutput.error`): `param` names the request field
    at fault, when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
