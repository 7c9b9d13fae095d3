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
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.frontend.tokenizer import load_tokenizer
from engine.model.directory import load_arch
from engine.outputs import ModelRunnerOutput
from engine.scheduler.output import NewRequestData, SchedulerOutput

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


@dataclass
class _Progress:
    """One request's script and how far the runner got through its prompt and the script."""

    script: list[int]
    num_tokens: int
    num_computed_tokens: int
    num_generated: int


class ToolThenAnswerExecutor:
    """The executor of the module docstring (the executor interface of `engine.executor`)."""

    def __init__(self, config: EngineConfig) -> None:
        self._tokenizer: Any = load_tokenizer(config.model.model, config.model.tokenizer)
        self._response_start = self._tokenizer.convert_tokens_to_ids(TOOL_RESPONSE_START)
        self._response_end = self._tokenizer.convert_tokens_to_ids(TOOL_RESPONSE_END)
        self._call_script = self._encode(TOOL_CALL_TEXT)
        self._num_kv_blocks = config.cache.num_kv_blocks or 512
        self._vocab_size = load_arch(config.model.model).vocab_size
        self._progress: dict[str, _Progress] = {}

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._progress.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._progress[new.req_id] = _Progress(
                self._script_for(new), len(new.prompt_token_ids) + len(new.output_token_ids),
                new.num_computed_tokens, len(new.output_token_ids))
        req_ids, sampled = [], []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            progress = self._progress[req_id]
            progress.num_computed_tokens += num_tokens
            req_ids.append(req_id)
            if progress.num_computed_tokens < progress.num_tokens:
                sampled.append([])  # a prefill chunk short of the prompt's end samples nothing
                continue
            position = min(progress.num_generated, len(progress.script) - 1)
            sampled.append([progress.script[position]])
            progress.num_generated += 1
            progress.num_tokens += 1
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def shutdown(self) -> None:
        self._progress.clear()

    def _script_for(self, new: NewRequestData) -> list[int]:
        prompt = new.prompt_token_ids
        if self._response_start not in prompt:
            return self._call_script
        start = len(prompt) - prompt[::-1].index(self._response_start)
        end = next((index for index in range(start, len(prompt))
                    if prompt[index] == self._response_end), len(prompt))
        result = self._tokenizer.decode(prompt[start:end]).strip()
        return self._encode(ANSWER_PREFIX + result)

    def _encode(self, text: str) -> list[int]:
        return [*self._tokenizer(text, add_special_tokens=False).input_ids,
                self._tokenizer.eos_token_id]
