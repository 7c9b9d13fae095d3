"""Stand-ins loaded by name inside the engine-core process of test servers.

`ScriptedExecutor` runs no model: every request generates the tokens of `SCRIPT` (a Hermes
tool call after some text and a line break), then EOS. `PinJobTurnsPolicy` is FCFS that pins
every non-final turn of a job, for `PIN_TTL_S` plus the length of the turn's tool name, so
tests can see the job extension reach the scheduler (the TTL shows the tool name arrived).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.executor.base import SynchronousExecutor
from engine.model.directory import load_arch
from engine.model.tokenizer import load_tokenizer
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.scheduler.output import NewRequestData, SchedulerOutput
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.retention import Retention, RetentionInputs

SCRIPT = (
    'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
)
PIN_TTL_S = 300.0


@dataclass
class _Progress:
    """One request's script and how far the runner got through its prompt and the script."""

    script: list[int]
    num_tokens: int
    num_computed_tokens: int
    num_generated: int


class ScriptedExecutor(SynchronousExecutor):
    """An executor that replays `SCRIPT` for every request (see the module docstring).
    Subclasses choose another script per request with `_script_for`."""

    def __init__(self, config: EngineConfig) -> None:
        self._tokenizer: Any = load_tokenizer(config.model.model, config.model.tokenizer)
        self._script = self._encode(SCRIPT)
        self._num_kv_blocks = config.cache.num_kv_blocks or 512
        self._vocab_size = load_arch(config.model.model).vocab_size
        self._progress: dict[str, _Progress] = {}

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def num_host_kv_blocks(self) -> int:
        return 0

    @property
    def num_cpu_threads(self) -> int | None:
        return None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._progress.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._progress[new.req_id] = _Progress(
                self._script_for(new), len(new.prompt_token_ids) + len(new.output_token_ids),
                new.num_computed_tokens, len(new.output_token_ids),
            )
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
        return self._script

    def _encode(self, text: str) -> list[int]:
        """`text`'s tokens, then EOS."""
        return [*self._tokenizer(text, add_special_tokens=False).input_ids,
                self._tokenizer.eos_token_id]


# A tool call whose argument is an integer of more digits than Python converts.
HUGE_INTEGER_CALL = '<tool_call>{"name": "t", "arguments": {"x": ' + "9" * 5_000 + "}}</tool_call>"


class HugeIntegerExecutor(ScriptedExecutor):
    """Replays `HUGE_INTEGER_CALL` for every request."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._script = self._encode(HUGE_INTEGER_CALL)


# Whitespace, then a Hermes call of `bash`.
BLANK_THEN_CALL = " \n\n" + SCRIPT.removeprefix("Let me look.\n")


class BlankThenCallExecutor(ScriptedExecutor):
    """Replays `BLANK_THEN_CALL` for every request."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._script = self._encode(BLANK_THEN_CALL)


class PinJobTurnsPolicy(FCFSPolicy):
    """FCFS that pins every finished non-final turn of a job (see the module docstring) that
    the client named: the jobs the scheduler infers for requests without one are not pinned,
    so that those requests hold nothing between tests."""

    def retention(self, request: Request, now_s: float) -> Retention | None:
        job = request.job
        if (job is None or job.inferred or job.is_last_step
                or request.status is RequestStatus.FINISHED_ABORTED):
            return None
        ttl_s = PIN_TTL_S + len(job.tool_name or "")
        return Retention(ttl_s, RetentionInputs(ttl_s=ttl_s, source="scripted", tool=job.tool_name))
