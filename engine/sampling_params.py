"""Sampling parameters: a torch-free, immutable wire type validated on construction.

The scheduler reads the stop-related fields (`max_tokens`, `min_tokens`, `stop_token_ids`,
`ignore_eos`); the model runner reads the rest. Stop *strings* are matched on text by the
frontend, never by the scheduler.
"""

from __future__ import annotations

import enum
import math

import msgspec

from engine.structured_output.spec import StructuredOutputSpec

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
# OpenAI's limits on `logit_bias`: entries per request, and the magnitude of one bias.
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
# Counts and token ids travel as 32-bit integers in the model runner.
MAX_INT32 = 2**31 - 1


class RequestOutputKind(enum.IntEnum):
    """What each streamed output of a request holds: everything so far, only what is new since
    the previous output, or nothing until the single final output."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class CacheBreakpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A client's ask to keep the KV of its prompt's first `num_prompt_tokens` tokens cached
    for `ttl_s` seconds, renewed by each request that hits it (the last `cache_control`
    breakpoint of an Anthropic Messages request, its TTL already within the server's cap).
    Travels to the scheduler with the request's sampling parameters
    (`engine.request.Request.cache_breakpoint`); the scheduler decides what it keeps."""

    num_prompt_tokens: int
    ttl_s: float

    def __post_init__(self) -> None:
        _check_int("cache_breakpoint.num_prompt_tokens", self.num_prompt_tokens, minimum=1,
                   maximum=MAX_INT32)
        if (isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float))
                or not math.isfinite(self.ttl_s) or self.ttl_s <= 0):
            raise ValueError(f"cache_breakpoint.ttl_s must be a positive finite number of "
                             f"seconds, got {self.ttl_s!r}")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How one completion is sampled and when it stops.

    - `max_tokens`: cap on generated tokens; `None` means up to the model's `max_model_len`.
    - `min_tokens`: EOS and stop token ids are ignored until this many tokens were generated.
    - `temperature == 0` is greedy decoding; `top_k == 0` disables top-k.
    - `seed`: per-request seed, reproducible whatever else is in the batch.
    - `logprobs`: number of top log-probabilities to return per generated token.
    - `prompt_logprobs`: number of top log-probabilities to return per prompt token, beside
      the prompt token's own (`0`: only its own); the first prompt token has none. A request
      with prompt logprobs computes its whole prompt (no prefix-cache hit).
    - `logit_bias`: `(token_id, bias)` pairs added to the logits before penalties and
      temperature (at most `MAX_LOGIT_BIAS_ENTRIES`, each bias in
      [-`MAX_LOGIT_BIAS`, `MAX_LOGIT_BIAS`], each token once); logprobs stay those of the
      unbiased distribution.
    - `stop`: strings that end the completion (matched on the text by the frontend, also across
      tokens); the match is cut from the text unless `include_stop_str_in_output`.
    - `skip_special_tokens`, `output_kind`: how the frontend detokenizes and streams.
    - `structured_output`: a grammar the output must match (EOS is allowed only where the
      grammar is complete, and `min_tokens` does not hold it back).
    - `cache_breakpoint`: the prompt prefix the client asks to keep cached, and for how long
      (`CacheBreakpoint`; None: no ask).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_output: StructuredOutputSpec | None = None
    cache_breakpoint: CacheBreakpoint | None = None

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        self._check_stops()
        self._check_structured_output()
        self._check_logit_bias()
        if self.cache_breakpoint is not None and not isinstance(self.cache_breakpoint,
                                                                CacheBreakpoint):
            raise ValueError("cache_breakpoint must be a CacheBreakpoint")

    def _check_counts(self) -> None:
        _check_int("n", self.n, minimum=1, maximum=MAX_INT32)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1, maximum=MAX_INT32)
        _check_int("min_tokens", self.min_tokens, minimum=0, maximum=MAX_INT32)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-MAX_SEED - 1, maximum=MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0,
                       maximum=MAX_LOGPROBS)

    def _check_distribution(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, minimum=0, maximum=MAX_INT32)
        _check_range("min_p", self.min_p, 0.0, 1.0)

    def _check_penalties(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)

    def _check_stops(self) -> None:
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id, minimum=0, maximum=MAX_INT32)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop strings must be non-empty, got {text!r}")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries, over the limit "
                             f"of {MAX_LOGIT_BIAS_ENTRIES}")
        seen: set[int] = set()
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise ValueError(f"logit_bias entries must be (token_id, bias) pairs, "
                                 f"got {entry!r}")
            token_id, bias = entry
            _check_int("logit_bias token id", token_id, minimum=0, maximum=MAX_INT32)
            _check_range("logit_bias value", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            if token_id in seen:
                raise ValueError(f"logit_bias names token {token_id} more than once")
            seen.add(token_id)

    def _check_structured_output(self) -> None:
        if self.structured_output is None:
            return
        if not isinstance(self.structured_output, StructuredOutputSpec):
            raise ValueError("structured_output must be a StructuredOutputSpec")
        if self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a structured output: the "
                             "grammar ends the output with EOS")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens generated so far (presence, frequency or
        repetition penalty)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_range(
    name: str, value: float, low: float, high: float, *, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high or value != value:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be in {interval}, got {value}")
