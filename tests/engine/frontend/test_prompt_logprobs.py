"""Prompt logprobs and logit_bias in the frontend: which core request computes them, how runs
from several prefill steps are assembled, and when outputs carry them."""

from __future__ import annotations

import pytest

from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import InputProcessor
from engine.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from engine.request import FinishReason
from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.frontend.test_output_processor import core_output

PROMPT = [10, 11, 12, 13]


@pytest.fixture
def processor(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, vocab_size=272, max_model_len=64)


def entry(token_id: int, logprob: float) -> TokenLogprobs:
    return TokenLogprobs(token_id=token_id, logprob=logprob, rank=1, top_token_ids=[],
                         top_logprobs=[])


def prompt_run(request_id: str, start_index: int, **fields: object) -> EngineCoreOutput:
    """A partial-prefill output carrying the logprobs of prompt tokens from `start_index`."""
    entries = [entry(PROMPT[start_index], -1.0 * start_index)]
    return EngineCoreOutput(request_id=request_id, new_token_ids=[],
                            prompt_logprobs=PromptLogprobs(start_index=start_index,
                                                           entries=entries), **fields)


def test_only_the_first_completion_computes_prompt_logprobs(processor) -> None:
    params = SamplingParams(n=3, prompt_logprobs=2, seed=4)
    processed = processor.process("r", PROMPT, params)
    assert [c.sampling_params.prompt_logprobs for c in processed.core_requests] == [2, None, None]
    assert [c.sampling_params.seed for c in processed.core_requests] == [4, 5, 6]
    assert processed.sampling_params.prompt_logprobs == 2


def test_logit_bias_ids_must_be_in_the_vocabulary(processor) -> None:
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 272\)"):
        processor.process("r", PROMPT, SamplingParams(logit_bias=((272, 1.0),)))
    processed = processor.process("r", PROMPT, SamplingParams(logit_bias=((271, -100.0),)))
    assert processed.core_requests[0].sampling_params.logit_bias == ((271, -100.0),)


def test_runs_are_assembled_and_the_first_delta_output_carries_them(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    params = SamplingParams(prompt_logprobs=0, output_kind=RequestOutputKind.DELTA)
    outputs.add_request(processor.process("r", PROMPT, params))
    assert outputs.process_outputs([prompt_run("r", 1)]).request_outputs == []
    assert outputs.process_outputs([prompt_run("r", 2)]).request_outputs == []
    last_run = prompt_run("r", 3)
    first, = outputs.process_outputs([EngineCoreOutput(
        request_id="r", new_token_ids=[65], prompt_logprobs=last_run.prompt_logprobs,
    )]).request_outputs
    assert first.prompt_logprobs == [None, entry(11, -1.0), entry(12, -2.0), entry(13, -3.0)]
    assert first.outputs[0].text == "A"
    second, = outputs.process_outputs([core_output("r", "B", finish=FinishReason.LENGTH)]
                                      ).request_outputs
    assert second.prompt_logprobs is None and second.finished


def test_a_recomputed_position_keeps_its_first_entry(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", PROMPT[:3], SamplingParams(prompt_logprobs=1)))
    outputs.process_outputs([prompt_run("r", 1)])
    again = EngineCoreOutput(request_id="r", new_token_ids=[], prompt_logprobs=PromptLogprobs(
        start_index=1, entries=[entry(11, -9.0), entry(12, -2.0)]))
    outputs.process_outputs([again])
    final, = outputs.process_outputs([core_output("r", "A", finish=FinishReason.LENGTH)]
                                     ).request_outputs
    assert final.prompt_logprobs == [None, entry(11, -1.0), entry(12, -2.0)]


def test_outputs_wait_until_the_prompt_logprobs_are_complete(processor, tokenizer) -> None:
    """With n > 1 only completion 0 computes them; another completion's tokens wait for them."""
    outputs = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA)
    outputs.add_request(processor.process("r", PROMPT[:2], params))
    assert outputs.process_outputs([core_output("r-1", "x")]).request_outputs == []
    first, = outputs.process_outputs([prompt_run("r-0", 1)]).request_outputs
    assert first.prompt_logprobs == [None, entry(11, -1.0)]
    assert {c.index: c.text for c in first.outputs} == {1: "x"}
    later, = outputs.process_outputs([core_output("r-0", "y")]).request_outputs
    assert later.prompt_logprobs is None and [c.text for c in later.outputs] == ["y"]


def test_final_only_and_cumulative_outputs_carry_the_whole_list(processor, tokenizer) -> None:
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
        outputs = OutputProcessor(tokenizer)
        outputs.add_request(processor.process(
            "r", PROMPT[:2], SamplingParams(prompt_logprobs=0, output_kind=kind)))
        assert outputs.process_outputs([core_output("r", "")]).request_outputs == []
        reported = outputs.process_outputs([prompt_run("r", 1), core_output("r", "A")]
                                           ).request_outputs
        if kind is RequestOutputKind.CUMULATIVE:
            assert reported[0].prompt_logprobs == [None, entry(11, -1.0)]
        final, = outputs.process_outputs([core_output("r", "B", finish=FinishReason.LENGTH)]
                                         ).request_outputs
        assert final.prompt_logprobs == [None, entry(11, -1.0)] and final.outputs[0].text == "AB"


def test_a_request_without_prompt_logprobs_reports_none(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", PROMPT, SamplingParams()))
    final, = outputs.process_outputs([core_output("r", "A", finish=FinishReason.LENGTH)]
                                     ).request_outputs
    assert final.prompt_logprobs is None
