"""Input processing: validate a prompt and its sampling parameters, tokenize, and split a
request with `n` completions into `n` core requests.

Everything a request can get wrong is caught here with a `ValueError`, before the engine core
sees it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.core.wire import EngineCoreRequest
from engine.frontend.chat_template import render_chat
from engine.frontend.content_text import (
    client_texts,
    special_content_spans,
    special_text_pattern,
)
from engine.frontend.detokenizer import special_token_ids
from engine.frontend.text_encoder import TextEncoder
from engine.model.directory import load_arch
from engine.model.tokenizer import load_tokenizer
from engine.request import JobInfo
from engine.sampling_params import MAX_SEED, SamplingParams
from engine.tool_calls import ToolCallFormat

Prompt = str | list[int]
# A `max_tokens` for counting a conversation's tokens however many there are.
COUNT_ANY_LENGTH = 1 << 40


class PromptTooLongError(ValueError):
    """A prompt of `num_tokens` tokens (at least that many with `at_least`: a text whose
    length alone shows it too long is not tokenized), which leaves no room for output within
    the model's context (`max_model_len`)."""

    def __init__(self, num_tokens: int, max_model_len: int, *, at_least: bool = False) -> None:
        super().__init__(f"the prompt has {token_count_text(num_tokens, at_least)} tokens, "
                         "which leaves no room for output "
                         f"within max_model_len ({max_model_len})")
        self.num_tokens = num_tokens
        self.at_least = at_least


def token_count_text(num_tokens: int, at_least: bool) -> str:
    """A prompt's token count as a client is told it: "N", or "at least N" for a lower
    bound (`PromptTooLongError.at_least`)."""
    return f"at least {num_tokens}" if at_least else f"{num_tokens}"


@dataclass(frozen=True)
class ProcessedRequest:
    """A validated request: its prompt as text (when given as text) and token ids, and one
    core request per completion (`n` of them, in completion order).

    `kept_special_token_ids` stay in the output text even with `skip_special_tokens` (the
    special tokens a parser of the output reads, such as tool-call tags).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    core_requests: list[EngineCoreRequest]
    kept_special_token_ids: frozenset[int] = frozenset()


class InputProcessor:
    """Turns user prompts into core requests for one model.

    `eos_token_ids` are the model's end-of-sequence ids: the tokenizer's EOS is the request's
    `eos_token_id`, the others become extra stop token ids (unless `ignore_eos`).
    """

    def __init__(
        self, tokenizer: Any, *, vocab_size: int, max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self._text_encoder = TextEncoder(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._special_text_pattern = special_text_pattern(
            str(token.content) for token in added.values() if getattr(token, "special", False))
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = tokenizer_eos if tokenizer_eos is not None else (
            eos_token_ids[0] if eos_token_ids else None
        )
        self.extra_stop_token_ids = tuple(t for t in eos_token_ids if t != self.eos_token_id)

    @classmethod
    def for_config(cls, config: EngineConfig, tokenizer: Any = None) -> InputProcessor:
        """The processor of the configured model (its own tokenizer unless one is given)."""
        arch = load_arch(config.model.model)
        return cls(
            load_tokenizer(config.model.model, config.model.tokenizer) if tokenizer is None
            else tokenizer,
            vocab_size=arch.vocab_size, max_model_len=config.scheduler.max_model_len,
            eos_token_ids=arch.eos_token_ids,
        )

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams,
        *,
        job: JobInfo | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        kept_special_token_ids: frozenset[int] = frozenset(),
        continues_request_id: str | None = None,
        tool_call_format: ToolCallFormat | None = None,
    ) -> ProcessedRequest:
        """Validates and tokenizes one request; ValueError naming what is wrong.
        `kept_special_token_ids`: see `ProcessedRequest`; `tenant`, `continues_request_id`
        and `tool_call_format`: see `engine.request.Request`."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if job is not None and not isinstance(job, JobInfo):
            raise ValueError("job must be a JobInfo")
        if isinstance(priority, bool) or not isinstance(priority, int) \
                or not -MAX_SEED - 1 <= priority <= MAX_SEED:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        prompt_text, token_ids = self.tokenize(prompt)
        self._check_tokens(token_ids, sampling_params)
        core_params = self._core_params(sampling_params)
        return ProcessedRequest(
            request_id=request_id, prompt=prompt_text, prompt_token_ids=token_ids,
            sampling_params=sampling_params,
            core_requests=[
                EngineCoreRequest(
                    request_id=core_request_id(request_id, index, sampling_params.n),
                    prompt_token_ids=token_ids,
                    sampling_params=_completion_params(core_params, index),
                    eos_token_id=self.eos_token_id, priority=priority, job=job,
                    cache_salt=cache_salt, tenant=tenant,
                    continues_request_id=continues_request_id,
                    tool_call_format=tool_call_format,
                )
                for index in range(sampling_params.n)
            ],
            kept_special_token_ids=kept_special_token_ids,
        )

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a text or token-id prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self._encode(prompt, add_special_tokens=True, what="the prompt")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}")

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        """The token ids of a conversation rendered by the chat template, the client's texts in
        it encoded as text (`engine.frontend.content_text`); ValueError if they cannot be
        built, `PromptTooLongError` if they are more than `max_tokens` (default: more than
        leave room for output)."""
        text = render_chat(self.tokenizer, messages, tools=tools,
                           add_generation_prompt=add_generation_prompt,
                           chat_template_kwargs=chat_template_kwargs)
        limit = self.max_model_len - 1 if max_tokens is None else max_tokens
        spans = special_content_spans(text, client_texts(messages), self._special_text_pattern)
        if not spans:
            return self._encode(text, add_special_tokens=False, what="the conversation",
                                max_tokens=limit)
        return self._encode_pieces(text, spans, limit)

    def _encode_pieces(self, text: str, spans: list[tuple[int, int]],
                       max_tokens: int) -> list[int]:
        """`text`'s token ids, the client's texts at `spans` encoded as text (special
        tokens' texts in them split: `engine.frontend.content_text`), the rest as usual."""
        token_ids: list[int] = []
        cursor = 0
        for start, end in [*spans, (len(text), len(text))]:
            for piece, split in ((text[cursor:start], False), (text[start:end], True)):
                if not piece:
                    continue
                try:
                    token_ids += self._encode(piece, add_special_tokens=False,
                                              what="the conversation", split=split,
                                              max_tokens=max_tokens - len(token_ids))
                except PromptTooLongError as error:  # the pieces after it are not counted
                    raise PromptTooLongError(error.num_tokens + len(token_ids),
                                             self.max_model_len, at_least=True) from error
            cursor = end
        return token_ids

    def _encode(self, text: str, *, add_special_tokens: bool, what: str, split: bool = False,
                max_tokens: int | None = None) -> list[int]:
        """`text`'s token ids (special tokens' texts encoded as text with `split`), at most
        `max_tokens` of them (default: what leaves room for output); ValueError if it cannot
        be tokenized or leaves no room for output (`PromptTooLongError`, before the ids of a
        text too long are built: see `TextEncoder`)."""
        limit = self.max_model_len - 1 if max_tokens is None else max_tokens
        try:
            encoded = self._text_encoder.encode(text, add_special_tokens=add_special_tokens,
                                                max_tokens=max(0, limit),
                                                split_special_tokens=split)
        except (TypeError, UnicodeError) as error:  # for example a lone surrogate
            raise ValueError(f"{what} cannot be tokenized: {error}") from error
        if encoded.token_ids is None:
            raise PromptTooLongError(encoded.num_tokens, self.max_model_len,
                                     at_least=encoded.num_tokens_is_lower_bound)
        return encoded.token_ids

    def special_token_ids(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of the special tokens (those `skip_special_tokens` leaves out of the text)
        whose text is one of `texts`."""
        wanted = frozenset(texts)
        special = special_token_ids(self.tokenizer)
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        return frozenset(token_id for token_id, token in added.items()
                         if token_id in special and getattr(token, "content", None) in wanted)

    def _check_tokens(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(token_ids), self.max_model_len)
        vocab_size = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
               for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        if any(token_id >= vocab_size for token_id, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")

    def _core_params(self, params: SamplingParams) -> SamplingParams:
        """What the core needs of the request's parameters, once for all its completions: one
        sequence, the model's extra EOS ids as stop ids, and no stop strings (the frontend
        matches those), so that a request's stop lists are held once, not once per
        completion."""
        changes: dict[str, Any] = {"n": 1, "stop": ()}
        if not params.ignore_eos and self.extra_stop_token_ids:
            extra = [t for t in self.extra_stop_token_ids if t not in params.stop_token_ids]
            changes["stop_token_ids"] = (*params.stop_token_ids, *extra)
        return msgspec.structs.replace(params, **changes)


def _completion_params(core_params: SamplingParams, index: int) -> SamplingParams:
    """Parameters of completion `index`: the request's, with its own seed. Only the first
    completion computes prompt logprobs (the prompt is the same for all), so the others may
    reuse cached KV of the prompt."""
    changes: dict[str, Any] = {}
    if index > 0 and core_params.seed is not None:
        changes["seed"] = (core_params.seed + index) % MAX_SEED
    if index > 0 and core_params.prompt_logprobs is not None:
        changes["prompt_logprobs"] = None
    return msgspec.structs.replace(core_params, **changes) if changes else core_params


def core_request_id(request_id: str, index: int, n: int) -> str:
    """The core's id for completion `index` of a request: the request id itself when n == 1."""
    return request_id if n == 1 else f"{request_id}-{index}"
