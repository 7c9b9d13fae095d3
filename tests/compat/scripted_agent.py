"""An executor loaded by name inside the engine-core process of the compatibility suite's
scripted server: it plays a model that calls a tool, then answers with what the tool returned.

`ToolThenAnswerExecutor` runs no model. It calls `TOOL_NAME` once for each city of `CITIES`
that the user's question names, in the question's order (for `TOOL_ARGUMENTS`' city when it
names none), one call a turn: a request whose prompt holds fewer tool results than that
generates `CALL_PREAMBLE` and a Hermes call for the next city, then EOS; a request whose
prompt holds them all (the chat template wraps each in the `<tool_response>` special tokens)
generates `ANSWER_PREFIX` followed by the text of the last tool result, then EOS. So an agent
loop is deterministic (two turns for `shared.PROMPT`, three for a question naming two
cities), and its final answer shows the tool's output reached the prompt. Grammar masks are
ignored: only requests without an output constraint (or whose constraint these scripts meet)
may be sent to it.
"""

from __future__ import annotations

import json

from engine.config import EngineConfig
from engine.scheduler.output import NewRequestData
from tests.engine.entrypoints.openai.scripted import ScriptedExecutor

TOOL_NAME = "get_weather"
TOOL_ARGUMENTS = {"city": "Paris"}
CITIES = ("Paris", "Rome", "Oslo")
CALL_PREAMBLE = "Checking."
TOOL_CALL_START = "<tool_call>"
ANSWER_PREFIX = "The tool says: "
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"


class ToolThenAnswerExecutor(ScriptedExecutor):
    """The executor of the module docstring (the executor interface of `engine.executor`)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._response_start = self._tokenizer.convert_tokens_to_ids(TOOL_RESPONSE_START)
        self._response_end = self._tokenizer.convert_tokens_to_ids(TOOL_RESPONSE_END)

    def _script_for(self, new: NewRequestData) -> list[int]:
        prompt = new.prompt_token_ids
        cities = self._cities_asked(prompt)
        num_results = prompt.count(self._response_start)
        if num_results < len(cities):
            return self._encode(tool_call_text(cities[num_results]))
        start = len(prompt) - prompt[::-1].index(self._response_start)
        end = next((index for index in range(start, len(prompt))
                    if prompt[index] == self._response_end), len(prompt))
        result = self._tokenizer.decode(prompt[start:end]).strip()
        return self._encode(ANSWER_PREFIX + result)

    def _cities_asked(self, prompt: list[int]) -> list[str]:
        """The cities the conversation names before its first tool result, in order of first
        mention: the question's (the calls made so far name only those)."""
        end = prompt.index(self._response_start) if self._response_start in prompt \
            else len(prompt)
        question = self._tokenizer.decode(prompt[:end])
        named = sorted((question.find(city), city) for city in CITIES if city in question)
        return [city for _, city in named] or [TOOL_ARGUMENTS["city"]]


def tool_call_text(city: str) -> str:
    """What the scripted model says to call the tool for `city`."""
    return (CALL_PREAMBLE + "\n" + TOOL_CALL_START + "\n"
            + json.dumps({"name": TOOL_NAME, "arguments": {"city": city}}) + "\n</tool_call>")
