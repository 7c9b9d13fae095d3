"""Steps the model runner launched whose sampled tokens may still be on the device.

`ModelRunner.submit` launches a step and returns a `RunnerStep` at once: its sampled ids and
logprobs are being copied to pinned host memory behind the step's kernels. Until its
`result` is taken, the tokens it sampled are placeholders in the persistent batch, listed in
`PendingTokens`; a later step whose input is such a token reads it from the device
(`TokenPatch`), so the runner never waits for a step to launch the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.outputs import ModelRunnerOutput, PromptLogprobs
from engine.sample.sampler import SampledLogprobs


@dataclass(frozen=True)
class TokenPatch:
    """Input ids of a step that earlier steps sampled and the host has not read back:
    `values[k]` (on the device) goes to token index `token_indices[k]` of the step."""

    token_indices: torch.Tensor  # [k] int64, on the device
    values: torch.Tensor  # [k] int64, on the device

    def apply(self, input_ids: torch.Tensor) -> None:
        """Writes the values into `input_ids` (the step's flat input ids, on the device)."""
        input_ids.index_copy_(0, self.token_indices, self.values)


@dataclass(eq=False)
class RunnerStep:
    """A launched step that sampled tokens: what `result` needs to build its output.

    `sampled` is the device tensor of the ids (row `i` for `sampling_req_ids[i]`), read by
    later steps' `TokenPatch`es; `host_token_ids` and `host_logprobs` are its pinned copies,
    complete once `ready` (None on CPU, where they are complete at once) has passed.
    `placed` lists the `(req_id, position, index)` placeholders the step appended to the
    persistent batch. `logprob_counts[i]` is how many top logprobs `sampling_req_ids[i]`
    asked for (None: no logprobs).
    """

    req_ids: list[str]
    sampling_req_ids: list[str]
    sampled: torch.Tensor
    host_token_ids: torch.Tensor
    host_logprobs: SampledLogprobs | None
    logprob_counts: list[int | None]
    prompt_logprobs: dict[str, PromptLogprobs]
    placed: list[tuple[str, int, int]]
    ready: torch.cuda.Event | None
    resolve: Callable[[RunnerStep], ModelRunnerOutput]
    output: ModelRunnerOutput | None = field(default=None, init=False)

    def result(self) -> ModelRunnerOutput:
        """The step's output; waits for its copies to the host the first time."""
        if self.output is None:
            self.output = self.resolve(self)
        return self.output


class PendingTokens:
    """Positions of the persistent batch whose token is still a placeholder: per request,
    position -> (the step that sampled it, its index in that step's `sampled`)."""

    def __init__(self) -> None:
        self._by_request: dict[str, dict[int, tuple[RunnerStep, int]]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_request)

    def add(self, req_id: str, position: int, step: RunnerStep, index: int) -> None:
        self._by_request.setdefault(req_id, {})[position] = (step, index)

    def of(self, req_id: str) -> dict[int, tuple[RunnerStep, int]] | None:
        return self._by_request.get(req_id)

    def drop(self, req_id: str) -> None:
        """Forgets a request that left the batch (its tokens are not written back)."""
        self._by_request.pop(req_id, None)

    def settle(self, req_id: str, position: int, step: RunnerStep) -> bool:
        """Removes the placeholder `step` put at `position` of `req_id`; False when it is
        not pending any more (the request left the batch)."""
        positions = self._by_request.get(req_id)
        if positions is None or positions.get(position, (None, 0))[0] is not step:
            return False
        del positions[position]
        if not positions:
            del self._by_request[req_id]
        return True
