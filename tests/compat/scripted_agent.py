"""An executor loaded by name inside the engine-core process of the compatibility suite's
scripted server: it plays a model that calls a tool, then answers with what the tool returned.

`ToolThenAnswerExecutor` runs no model. A request whose prompt holds no tool result generates
`TOOL_CALL_TEXT` (`CALL_PREAMBLE`, then a Hermes call of `TOOL_NAME` with `TOOL_ARGUMENTS`),
then EOS; a request whose prompt holds one (the chat template wraps it in the
`<tool_response>` special tokens) generates `ANSWER_PREFIX` followed by the text of the last
tool result, then EOS. So an agent loop over two turns is deterministic, and its final answer
shows the tool's output reached the prompt. Grammar masks are ignored: only requests without
an output constraint (or whose constraint these scripts meet) may be sent to it.
"""

from __future__ import annotations

import json

from engine.config import EngineConfig
from engine.scheduler.output import NewRequestData
from tests.engine.entrypoints.openai.scripted import ScriptedExecutor

TOOL_NAME = "get_weather"
TOOL_ARGUMENTS = {"city": "Paris"}
CALL_PREAMBLE = "Checking."
TOOL_CALL_TEXT = (
    CALL_PREAMBLE + "\n<tool_call>\n"
    + json.dumps({"name": TOOL_NAME, "arguments": TOOL_ARGUMENTS})
    + "\n</tool_call>"
)
ANSWER_PREFIX = "The tool says: "
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"


class ToolThenAnswerExecutor(ScriptedExecutor):
    """The executor of the module docstring (the executor interface of `engine.executor`)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._response_start = self._tokenizer.convert_tokens_to_ids(TOOL_RESPONSE_START)
        self._response_end = self._tokenizer.convert_tokens_to_ids(TOOL_RESPONSE_END)
        self._call_script = self._encode(TOOL_CALL_TEXT)

    def _script_for(self, new: NewRequestData) -> list[int]:
        prompt = new.prompt_token_ids
        if self._response_start not in prompt:
            return self._call_script
        start = len(prompt) - prompt[::-1].index(self._response_start)
        end = next((index for index in range(start, len(prompt))
                    if prompt[index] == self._response_end), len(prompt))
        result = self._tokenizer.decode(prompt[start:end]).strip()
        return self._encode(ANSWER_PREFIX + result)
