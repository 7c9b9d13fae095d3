"""A chat request's conversation as the engine's prompt: its fields checked, its messages
rendered by the chat template and tokenized, and the engine request it continues.

Built on a preparation thread for a small body, and for a large one in the child process
that parses it (`json_body.BodyParser`, with the body): rendering and tokenizing an 8 MB chat
hold the GIL for about 60 ms (the template's Python, then freeing the encoding of its
millions of tokens), and in the server's process each such stretch delays every other
request's next step on the event loop by up to a GIL switch interval at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from engine.entrypoints.openai.tool_call_ids import continued_request_id
from engine.frontend.processor import InputProcessor, PromptTooLongError
from engine.tool_calls import JSON_ERRORS


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation made into a prompt. `token_ids`: the prompt's; None when it cannot be
    made: `error` then says why (the chat template's message), else the prompt has
    `num_tokens` tokens (at least that many with `num_tokens_is_lower_bound`), too many for
    the model's context. `continues_request_id`: the finished engine request whose turn it
    continues (`tool_call_ids.continued_request_id`)."""

    token_ids: list[int] | None
    continues_request_id: str | None
    num_tokens: int = 0
    error: str | None = None
    num_tokens_is_lower_bound: bool = False

    def checked_token_ids(self, max_model_len: int) -> list[int]:
        """`token_ids`; ValueError (`error`) or PromptTooLongError when there are none."""
        if self.error is not None:
            raise ValueError(self.error)
        if self.token_ids is None:
            raise PromptTooLongError(self.num_tokens, max_model_len,
                                     at_least=self.num_tokens_is_lower_bound)
        return self.token_ids


def check_chat_fields(body: ChatCompletionRequest) -> None:
    """APIError(400) for fields a chat request may not combine, or may not send at all
    (checked before its conversation is rendered: a request may not replace the template)."""
    for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(body, legacy) is not None:
            raise APIError(400, f"{legacy} is OpenAI's deprecated form of {current}, which "
                           f"this server does not take: send {current} instead", param=legacy)
    if body.chat_template_kwargs and "chat_template" in body.chat_template_kwargs:
        raise APIError(400, "a request may not replace the chat template",
                       param="chat_template_kwargs")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    choice = body.tool_choice
    if choice is not None and choice != "none" and not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice is not None and not isinstance(choice, str):
        names = {tool.function.name for tool in body.tools or ()}
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not "
                                "among the tools", param="tool_choice")


def render_chat_prompt(processor: InputProcessor, body: ChatCompletionRequest) -> ChatPrompt:
    """`body`'s conversation rendered with `processor`'s chat template and tokenized. Call
    only once `check_chat_fields(body)` has passed."""
    messages = [template_message(message) for message in body.messages]
    continues = continued_request_id(messages)
    tools = None if not body.tools else [tool.model_dump(exclude_none=True)
                                          for tool in body.tools]
    try:
        token_ids = processor.chat_prompt(
            messages, tools=tools, add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs)
    except PromptTooLongError as error:
        return ChatPrompt(None, continues, num_tokens=error.num_tokens,
                          num_tokens_is_lower_bound=error.at_least)
    except ValueError as error:
        return ChatPrompt(None, continues, error=str(error))
    return ChatPrompt(token_ids, continues)


def chat_prompt_unless_refused(processor: InputProcessor, body: ChatCompletionRequest
                               ) -> ChatPrompt | None:
    """`render_chat_prompt` for a large chat body, in the child that parsed it; None (left to
    the route, which refuses it) when its fields fail `check_chat_fields`. Checks that need
    the server's state (its model name, limits, queue, drain) come later, in the route: a
    body they refuse has been rendered for nothing, never with a template of its own."""
    try:
        check_chat_fields(body)
    except APIError:
        return None
    return render_chat_prompt(processor, body)


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: text content as a string, and tool-call
    arguments as objects (templates render them with `tojson`)."""
    rendered = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        rendered["content"] = "".join(part.text for part in content)
    elif content is None:
        rendered["content"] = ""
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.function.name,
                          "arguments": _arguments_object(call.function.arguments)}}
            for call in message.tool_calls
        ]
    return rendered


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except JSON_ERRORS:
        return arguments
