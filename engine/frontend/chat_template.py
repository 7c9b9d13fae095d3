"""Rendering a chat conversation as prompt text with the model's chat template, and the tool
format for templates that leave tools out.

Many chat templates (SmolLM2's, for one) ignore the `tools` they are given, render an
assistant turn that only called a tool as an empty message, or drop tool results. A model
served with such a template never learns which tools it may call, and repeats a call whose
result it cannot see. `render_chat` finds out what a template renders of tools by rendering
probe conversations with and without them (`template_tool_support`, once per template), and
renders what the template leaves out itself, in the Hermes format that the tool-call parser
reads back (`engine.tool_calls`):

- the tool definitions go at the end of the system message (one is added when there is
  none): a `# Tools` section with each function's JSON definition on its own line inside
  `<tools></tools>`, and how to call one: a JSON object `{"name": ..., "arguments": {...}}`
  inside `<tool_call></tool_call>` tags, one block per call (`tools_system_prompt`);
- an assistant turn's `tool_calls` become such blocks after its text;
- a `tool` result goes inside `<tool_response></tool_response>` tags: in a user message where
  the template drops results (consecutive results share one), else in its own message when
  the tool definitions are the fallback's.

The first time a template needs this, a log line says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.tool_calls import JSON_ERRORS

logger = logging.getLogger(__name__)

TOOLS_START = "<tools>"
TOOLS_END = "</tools>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

# Probe conversations: names no real conversation uses, so that finding them in a rendering
# says the template rendered that part.
_PROBE_FUNCTION = "continuum_probe_function"
_PROBE_CALLED_FUNCTION = "continuum_probe_called_function"
_PROBE_RESULT = "continuum probe tool result"
_PROBE_USER = {"role": "user", "content": "continuum probe question"}
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_FUNCTION, "description": "continuum probe description",
    "parameters": {"type": "object", "properties": {"continuum_probe_parameter": {
        "type": "string"}}}}}]
_PROBE_CALL = {"id": "call_continuum_probe", "type": "function", "function": {
    "name": _PROBE_CALLED_FUNCTION, "arguments": {"continuum_probe_argument": "x"}}}


@dataclass(frozen=True)
class TemplateToolSupport:
    """What a chat template renders of tools: the offered tools' definitions
    (`renders_tools`), assistant turns' tool calls (`renders_tool_calls`) and tool results
    (`renders_tool_results`)."""

    renders_tools: bool
    renders_tool_calls: bool
    renders_tool_results: bool

    @property
    def is_complete(self) -> bool:
        """Whether the template renders all three (no fallback is needed)."""
        return self.renders_tools and self.renders_tool_calls and self.renders_tool_results


_support_lock = threading.Lock()
_support_by_template: dict[str, TemplateToolSupport] = {}
_fallback_logged: set[str] = set()


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as prompt text, by the model's chat template (tools included, in the
    Hermes format where the template leaves them out).

    ValueError if the model has no chat template or the messages do not fit it.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template; send a plain prompt instead")
    if tools or any(_is_tool_turn(message) for message in messages):
        support = template_tool_support(tokenizer)
        if not support.is_complete:
            messages, tools = with_tool_fallback(messages, tools, support)
            _log_fallback_once(tokenizer, support)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            tokenize=False, **(chat_template_kwargs or {}),
        )
    except Exception as error:  # template errors surface as many exception types
        raise ValueError(f"cannot apply the chat template: {error}") from error
    if not isinstance(text, str):
        raise ValueError("the chat template did not produce text")
    return text


def template_tool_support(tokenizer: Any) -> TemplateToolSupport:
    """What the tokenizer's chat template renders of tools, found by rendering probe
    conversations (once per template text; a probe the template fails on counts as not
    rendered)."""
    key = _template_key(tokenizer)
    with _support_lock:
        support = _support_by_template.get(key)
    if support is None:
        support = _probe(tokenizer)
        with _support_lock:
            _support_by_template[key] = support
    return support


def with_tool_fallback(
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
    support: TemplateToolSupport,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to give a template of `support`: what it leaves out rendered
    in the Hermes format (see the module's docstring). The tools come back as None when they
    went into the system message."""
    rendered: list[dict[str, Any]] = []
    merged_results: dict[str, Any] | None = None  # the user message holding tool results
    for message in messages:
        if not isinstance(message, dict):  # left for the template to refuse
            rendered.append(message)
            continue
        if message.get("role") == "tool" and not support.renders_tool_results:
            block = _tool_response_block(message)
            if merged_results is None:
                merged_results = {"role": "user", "content": block}
                rendered.append(merged_results)
            else:
                merged_results["content"] += "\n" + block
            continue
        merged_results = None
        if message.get("role") == "tool" and not support.renders_tools:
            # The template renders the result, but not the tags the fallback's tool
            # definitions announce.
            message = {**message, "content": _tool_response_block(message)}
        if (message.get("role") == "assistant" and message.get("tool_calls")
                and not support.renders_tool_calls):
            calls = "\n".join(tool_call_block(call) for call in message["tool_calls"])
            text = _text(message.get("content"))
            message = {key: value for key, value in message.items() if key != "tool_calls"}
            message["content"] = f"{text}\n{calls}" if text else calls
        rendered.append(message)
    if tools and not support.renders_tools:
        prompt = tools_system_prompt(tools)
        if rendered and rendered[0].get("role") == "system":
            text = _text(rendered[0].get("content"))
            rendered[0] = {**rendered[0], "content": f"{text}\n\n{prompt}" if text else prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
        tools = None
    return rendered, tools


def tools_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The tool definitions and the way to call them, as the system message's `# Tools`
    section (each definition is the function's JSON: name, description, parameters)."""
    definitions = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False)
                            for tool in tools)
    return (
        "# Tools\n\n"
        "You may call the functions defined below, one JSON definition a line (the "
        "function's name, what it does, and the JSON schema of its arguments):\n"
        f"{TOOLS_START}\n{definitions}\n{TOOLS_END}\n\n"
        "To call a function, answer with a JSON object that names it and gives its "
        f"arguments, inside {TOOL_CALL_START}{TOOL_CALL_END} tags, one block per call:\n"
        f'{TOOL_CALL_START}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n'
        f"{TOOL_CALL_END}\n"
        "Each result comes back inside "
        f"{TOOL_RESPONSE_START}{TOOL_RESPONSE_END} tags. Answer in plain text when no "
        "function is needed."
    )


def tool_call_block(call: dict[str, Any]) -> str:
    """One tool call (an OpenAI `tool_calls` entry, its arguments an object or JSON text) as
    the Hermes block the parser reads back."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(*JSON_ERRORS):  # else kept as text
            arguments = json.loads(arguments)
    payload = json.dumps({"name": function.get("name"), "arguments": arguments},
                         ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{payload}\n{TOOL_CALL_END}"


def _tool_response_block(message: dict[str, Any]) -> str:
    return f"{TOOL_RESPONSE_START}\n{_text(message.get('content'))}\n{TOOL_RESPONSE_END}"


def _is_tool_turn(message: Any) -> bool:
    return isinstance(message, dict) and (message.get("role") == "tool"
                                          or bool(message.get("tool_calls")))


def _text(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _template_key(tokenizer: Any) -> str:
    template = tokenizer.chat_template
    return template if isinstance(template, str) else repr(template)


def _render(tokenizer: Any, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None) -> str | None:
    """The probe's rendering, or None when the template fails on it."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # a template that cannot render the probe leaves that part out
        return None
    return text if isinstance(text, str) else None


def _probe(tokenizer: Any) -> TemplateToolSupport:
    without_tools = _render(tokenizer, [_PROBE_USER])
    with_tools = _render(tokenizer, [_PROBE_USER], _PROBE_TOOLS)
    renders_tools = (with_tools is not None and with_tools != without_tools
                     and _PROBE_FUNCTION in with_tools)
    calling = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    with_call = _render(tokenizer, [_PROBE_USER, calling])
    renders_tool_calls = with_call is not None and _PROBE_CALLED_FUNCTION in with_call
    result = {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "name": _PROBE_CALLED_FUNCTION,
              "content": _PROBE_RESULT}
    answered = _render(tokenizer, [_PROBE_USER, calling, result])
    if answered is None:  # a template that fails on the call may still take the result
        answered = _render(tokenizer, [_PROBE_USER, {"role": "assistant", "content": "ok"},
                                       result])
    renders_tool_results = answered is not None and _PROBE_RESULT in answered
    return TemplateToolSupport(renders_tools, renders_tool_calls, renders_tool_results)


def _log_fallback_once(tokenizer: Any, support: TemplateToolSupport) -> None:
    key = _template_key(tokenizer)
    with _support_lock:
        if key in _fallback_logged:
            return
        _fallback_logged.add(key)
    left_out = [name for name, rendered in (
        ("tool definitions", support.renders_tools), ("tool calls", support.renders_tool_calls),
        ("tool results", support.renders_tool_results)) if not rendered]
    logger.info("the chat template of %s leaves out %s: the server renders them in the "
                "Hermes format (<tools>, <tool_call>, <tool_response>)",
                getattr(tokenizer, "name_or_path", None) or "this model", ", ".join(left_out))
