"""How often a served model answers 20 fixed questions that each need one of four tools with
a valid tool call, over Chat Completions with `tool_choice` "auto" and greedy decoding: the
figure `docs/frameworks.md` reports for SmolLM2-135M-Instruct (and, beside it, which tool it
picks when `tool_choice` "required" makes the grammar force a call).

A call is valid when the server returned it as a tool call (`finish_reason` "tool_calls")
and its arguments match the called tool's JSON schema; it is the right tool when it is the one
the question needs. Run it against the real model in the model cache (`continuum models pull
smollm2-135m-instruct`) with `.venv/bin/python -m tests.engine.entrypoints.openai.tool_call_rate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Converts an amount between currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"}, "from_currency": {"type": "string"},
            "to_currency": {"type": "string"}},
            "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Searches the web for recent information.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
# (question, the tool it needs)
PROMPTS = [
    ("What is the weather in Paris right now?", "get_weather"),
    ("Is it raining in London today?", "get_weather"),
    ("How hot is it in Cairo at the moment?", "get_weather"),
    ("Tell me the current weather in Tokyo.", "get_weather"),
    ("Do I need an umbrella in Seattle now?", "get_weather"),
    ("What time is it in New York?", "get_time"),
    ("What is the local time in Sydney right now?", "get_time"),
    ("Tell me the current time in Berlin.", "get_time"),
    ("Is it morning or evening in Mumbai now?", "get_time"),
    ("What time is it currently in Mexico City?", "get_time"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 euros?", "convert_currency"),
    ("Convert 20 pounds sterling to US dollars.", "convert_currency"),
    ("What is 1000 Indian rupees in Swiss francs?", "convert_currency"),
    ("How much is 75 Canadian dollars in euros?", "convert_currency"),
    ("Search the web for the latest news about the Mars rover.", "search_web"),
    ("Find recent articles on electric car sales.", "search_web"),
    ("Look up who won yesterday's football match.", "search_web"),
    ("Search for this week's top science headlines.", "search_web"),
    ("Find the newest reviews of the latest smartphone.", "search_web"),
]
MAX_TOKENS = 96


@dataclass(frozen=True)
class Answer:
    """What the model answered one question with: its calls (name, arguments as parsed)
    and whether each matched its tool's schema."""

    question: str
    expected_tool: str
    calls: tuple[tuple[str, Any, bool], ...]

    @property
    def is_valid_call(self) -> bool:
        return bool(self.calls) and all(valid for _, _, valid in self.calls)

    @property
    def is_right_tool(self) -> bool:
        return self.is_valid_call and self.calls[0][0] == self.expected_tool


def answer(client: Any, model: str, question: str, expected_tool: str,
           tool_choice: str = "auto") -> Answer:
    """`question` asked with every tool offered, greedily."""
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], tools=TOOLS,
        tool_choice=tool_choice, temperature=0, max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    calls = []
    if choice.finish_reason == "tool_calls":
        for call in choice.message.tool_calls or ():
            arguments = json.loads(call.function.arguments)
            try:
                jsonschema.validate(arguments, SCHEMAS[call.function.name])
                valid = True
            except jsonschema.ValidationError:
                valid = False
            calls.append((call.function.name, arguments, valid))
    return Answer(question, expected_tool, tuple(calls))


def measure(client: Any, model: str, tool_choice: str = "auto") -> list[Answer]:
    return [answer(client, model, question, tool, tool_choice) for question, tool in PROMPTS]


def main() -> None:
    from engine.entrypoints.openai.serving import ServerSettings
    from tests.engine.entrypoints.openai.conftest import start_server
    from tests.engine.model.real_model import REAL_MODEL, require_real_model

    server = start_server(model=str(require_real_model()), max_model_len=2048,
                          max_num_batched_tokens=512,
                          settings=ServerSettings(served_model_name=REAL_MODEL))
    try:
        for tool_choice in ("auto", "required"):
            answers = measure(server.client(), REAL_MODEL, tool_choice)
            for item in answers:
                print(f"{item.expected_tool:>16} {'valid' if item.is_valid_call else '-':>5} "
                      f"{item.calls!r:.90} <- {item.question}")
            num_valid = sum(item.is_valid_call for item in answers)
            num_right = sum(item.is_right_tool for item in answers)
            print(f"tool_choice {tool_choice!r}: valid tool calls {num_valid}/{len(answers)}, "
                  f"the right tool {num_right}/{len(answers)}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
