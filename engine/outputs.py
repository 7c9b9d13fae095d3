"""What the model runner returns to the scheduler, and what the engine core reports per request.

Both are msgspec Structs: they cross process boundaries (executor workers, the ZMQ link to the
frontend). Fields are append-only. A launched step's output comes through a `PendingStep`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec

from engine.request import FinishReason


class TokenLogprobs(msgspec.Struct, kw_only=True, frozen=True):
    """Log-probabilities at one generated position: the sampled token's, with its rank
    (1 = most likely), and the `len(top_token_ids)` most likely tokens', best first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, kw_only=True, frozen=True):
    """Log-probabilities of consecutive prompt tokens computed in one step: `entries[k]` is
    that of prompt token `start_index + k` (given the tokens before it), with the token as
    `token_id`. `start_index >= 1`: the first prompt token has none. A chunked prefill yields
    one such run per step; a prompt prefilled again (after a preemption) yields the same
    positions again."""

    start_index: int
    entries: list[TokenLogprobs]


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """Tokens sampled in one step, `sampled_token_ids[i]` for `req_ids[i]`.

    A request that does not sample in the step (its prefill is still partial) is given an
    empty list. `logprobs[i]`, when the list is
    present, holds one entry per token of `sampled_token_ids[i]` for requests that asked for
    logprobs and is `None` for the others. `prompt_logprobs[i]`, when the list is present,
    holds the prompt logprobs of the positions `req_ids[i]` computed in the step, for requests
    that asked for them, and is `None` for the others. `kv_copy_time_s` is how long the
    step's host-tier copies held it up (seconds; copies overlapped by the forward do not
    count).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    kv_copy_time_s: float = 0.0

    def req_id_to_index(self) -> dict[str, int]:
        return {req_id: index for index, req_id in enumerate(self.req_ids)}


class PendingStep(Protocol):
    """A step an executor (or the model runner) has launched; `result` waits for its
    sampled tokens."""

    def result(self) -> ModelRunnerOutput:
        """The step's output, once its tokens are on the host (the same object each call)."""
        ...


@dataclass(frozen=True)
class CompletedStep:
    """A step whose output was complete when it was submitted."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one request from one step; `finish_reason` is set on its last output.

    `num_cached_tokens` is the prefix-cache hit of the request's first admission. `logprobs`
    has one entry per new token when the request asked for them. `prompt_logprobs` carries the
    prompt positions computed in the step for a request that asked for them (an output of a
    partial prefill then has no new tokens). `error` is set (with `finish_reason` ABORT and no
    tokens) when the core rejected the request; `error_param` then names the request field
    at fault, when the core knows it (a grammar's). `job_id` names the request's job (its
    client's, or the one the scheduler inferred) on its first output with a token.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    error_param: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    job_id: str | None = None
