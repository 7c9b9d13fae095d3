"""`LLM`: offline batch generation and chat on the engine, with a progress bar."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm import tqdm

from engine.engine_args import EngineArgs
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.processor import Prompt
from engine.frontend.request_outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]


class LLM:
    """`LLM(model="tiny", **engine_args)`; keyword arguments are `EngineArgs` fields.

    The core runs in this process unless `multiprocess=True`.
    """

    def __init__(
        self, model: str = "tiny", *, multiprocess: bool = False, **engine_args: Any
    ) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args),
                                                 multiprocess=multiprocess)
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completes every prompt (text, or a list of token ids); outputs in prompt order.

        One `SamplingParams` applies to all prompts, or give one per prompt. Every prompt is
        validated before any runs: a ValueError leaves nothing queued.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation or to each of several."""
        if not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.engine.processor.chat_prompt(
                list(conversation), tools=tools, add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self._run(prompts, _as_params_list(sampling_params, len(prompts)), use_tqdm)

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer the engine uses."""
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stops the engine (and its core process, if it has one)."""
        self.engine.shutdown()

    def _run(
        self, prompts: list[Prompt], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        processor = self.engine.processor
        request_ids = [f"llm-{next(self._request_counter)}" for _ in prompts]
        validated = [  # all of them before queuing any
            processor.process(request_id, prompt, msgspec.structs.replace(
                params, output_kind=RequestOutputKind.FINAL_ONLY
            ))
            for request_id, prompt, params in zip(request_ids, prompts, params_list, strict=True)
        ]
        try:
            for processed in validated:
                self.engine.add_processed_request(processed)
        except BaseException:
            self.engine.abort_requests(request_ids)
            raise
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        outputs[output.request_id] = output
                        progress.update(1)
        return [outputs[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params_list = list(params)
    if len(params_list) != count:
        raise ValueError(f"got {len(params_list)} sampling params for {count} prompts")
    return params_list
