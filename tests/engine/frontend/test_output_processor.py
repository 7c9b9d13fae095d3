"""Output processing from scripted core outputs: output kinds, stop strings, n > 1, errors."""

from __future__ import annotations

import asyncio
import sys

import pytest

from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import InputProcessor
from engine.frontend.stop_strings import find_stop_string, num_held_back_chars
from engine.outputs import EngineCoreOutput, TokenLogprobs
from engine.request import FinishReason
from engine.sampling_params import RequestOutputKind, SamplingParams

EOS = 258


@pytest.fixture
def processor(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, vocab_size=272, max_model_len=64, eos_token_ids=(EOS,))


def core_output(request_id: str, text: str = "", *, finish: FinishReason | None = None,
                **fields: object) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=list(text.encode()),
                            finish_reason=finish, **fields)


def stream(processor: InputProcessor, tokenizer, params: SamplingParams, steps: list[str],
           *, last_finish: FinishReason | None = FinishReason.LENGTH):
    """Feeds one token-per-byte step at a time; returns (outputs per step, ids to abort)."""
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", [1, 2, 3], params))
    per_step, aborts = [], []
    for index, text in enumerate(steps):
        finish = last_finish if index == len(steps) - 1 else None
        result = outputs.process_outputs([core_output("r", text, finish=finish)])
        per_step.append(result.request_outputs)
        aborts += result.core_requests_to_abort
    return per_step, aborts, outputs


def test_find_stop_string_only_in_the_window_new_text_can_complete() -> None:
    assert find_stop_string("abcSTOPdef", ["STOP"], num_old_chars=5) == (3, "STOP")
    assert find_stop_string("STOP and more", ["STOP"], num_old_chars=8) is None
    assert find_stop_string("xx ab yy", ["yy", "ab"], num_old_chars=0) == (3, "ab")
    assert num_held_back_chars(["ab", "abcd"], include_stop_str_in_output=False) == 3
    assert num_held_back_chars(["abcd"], include_stop_str_in_output=True) == 0


def test_delta_outputs_concatenate_to_the_final_text(processor, tokenizer) -> None:
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    per_step, _, outputs = stream(processor, tokenizer, params, ["he", "llo", " 日"])
    texts = [step[0].outputs[0].text for step in per_step]
    assert "".join(texts) == "hello 日"
    final = per_step[-1][0]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert sum(len(step[0].outputs[0].token_ids) for step in per_step) == len("hello 日".encode())
    assert not outputs.has_unfinished_requests()


def test_cumulative_outputs_grow_and_final_only_reports_once(processor, tokenizer) -> None:
    cumulative, _, _ = stream(processor, tokenizer, SamplingParams(), ["ab", "cd"])
    assert [step[0].outputs[0].text for step in cumulative] == ["ab", "abcd"]
    final_only, _, _ = stream(
        processor, tokenizer, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY),
        ["ab", "cd"],
    )
    assert final_only[0] == []
    assert final_only[1][0].outputs[0].text == "abcd"


def test_a_stop_string_split_across_steps_ends_the_request(processor, tokenizer) -> None:
    params = SamplingParams(stop=("STOP",), output_kind=RequestOutputKind.DELTA)
    per_step, aborts, outputs = stream(processor, tokenizer, params,
                                       ["one S", "T", "OP two"], last_finish=None)
    streamed = "".join(out.outputs[0].text for step in per_step for out in step)
    assert streamed == "one "
    assert all("S" not in out.outputs[0].text for step in per_step for out in step)
    final = per_step[-1][0]
    assert final.finished
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == "STOP"
    assert aborts == ["r"]  # the core is still generating it
    assert not outputs.has_unfinished_requests()


def test_text_that_only_looked_like_a_stop_string_is_released(processor, tokenizer) -> None:
    params = SamplingParams(stop=("STOP",), output_kind=RequestOutputKind.DELTA)
    per_step, aborts, _ = stream(processor, tokenizer, params, ["aS", "T", "x", "yz"])
    texts = [out.outputs[0].text for step in per_step for out in step]
    assert texts[0] == ""  # held back: might become the stop string
    assert "".join(texts) == "aSTxyz"
    assert aborts == []


def test_include_stop_str_in_output_keeps_it(processor, tokenizer) -> None:
    params = SamplingParams(stop=("##",), include_stop_str_in_output=True)
    per_step, _, _ = stream(processor, tokenizer, params, ["a#", "#b"], last_finish=None)
    assert per_step[-1][0].outputs[0].text == "a##"


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_stop_token_finish_reports_its_id_and_keeps_it_out_of_the_text(
    processor, tokenizer, kind: RequestOutputKind
) -> None:
    outputs = OutputProcessor(tokenizer)
    params = SamplingParams(stop_token_ids=(7,), skip_special_tokens=False, output_kind=kind)
    outputs.add_request(processor.process("r", [1], params))
    result = outputs.process_outputs([EngineCoreOutput(
        request_id="r", new_token_ids=[65, 7], finish_reason=FinishReason.STOP, stop_reason=7,
    )])
    completion = result.request_outputs[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", 7)
    assert completion.text == "A"
    assert completion.token_ids == [65, 7]


def test_stop_token_is_in_the_text_with_include_stop_str_in_output(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    params = SamplingParams(stop_token_ids=(7,), include_stop_str_in_output=True)
    outputs.add_request(processor.process("r", [1], params))
    result = outputs.process_outputs([EngineCoreOutput(
        request_id="r", new_token_ids=[65, 7], finish_reason=FinishReason.STOP, stop_reason=7,
    )])
    assert result.request_outputs[0].outputs[0].text == "A\x07"


def test_n_completions_are_tracked_separately(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.DELTA, seed=5)
    processed = processor.process("r", [1, 2], params)
    assert [c.request_id for c in processed.core_requests] == ["r-0", "r-1"]
    assert [c.sampling_params.seed for c in processed.core_requests] == [5, 6]
    outputs.add_request(processed)
    first = outputs.process_outputs([core_output("r-1", "x")]).request_outputs
    assert [c.index for c in first[0].outputs] == [1]
    assert not first[0].finished
    last = outputs.process_outputs([
        core_output("r-0", "yz", finish=FinishReason.LENGTH),
        core_output("r-1", "w", finish=FinishReason.LENGTH),
    ]).request_outputs
    assert len(last) == 1 and last[0].finished
    assert {c.index: c.text for c in last[0].outputs} == {0: "yz", 1: "w"}


def test_logprobs_follow_their_tokens(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", [1], SamplingParams(logprobs=1)))
    entry = TokenLogprobs(token_id=65, logprob=-0.5, rank=1, top_token_ids=[65],
                          top_logprobs=[-0.5])
    result = outputs.process_outputs([EngineCoreOutput(
        request_id="r", new_token_ids=[65], logprobs=[entry], finish_reason=FinishReason.LENGTH,
    )])
    assert result.request_outputs[0].outputs[0].logprobs == [entry]


def _logprobs_entry(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id=token_id, logprob=-0.5, rank=1, top_token_ids=[token_id],
                         top_logprobs=[-0.5])


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_stream_keeps_only_the_logprobs_it_has_not_reported(processor, tokenizer,
                                                              kind) -> None:
    """A delta request's logprobs are the processor's only until reported (a long stream's
    would otherwise stay for its whole length); a cumulative one reports all of them each
    time, so it keeps them."""
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", [1], SamplingParams(logprobs=1,
                                                                    output_kind=kind)))
    entries = [_logprobs_entry(65 + step) for step in range(3)]
    reported = []
    for step, entry in enumerate(entries):
        finish = FinishReason.LENGTH if step == len(entries) - 1 else None
        num_refs = sys.getrefcount(entry)
        result = outputs.process_outputs([EngineCoreOutput(
            request_id="r", new_token_ids=[entry.token_id], logprobs=[entry],
            finish_reason=finish)])
        reported.append([e.token_id for e in result.request_outputs[0].outputs[0].logprobs])
        del result
        if finish is None:  # the processor still holds the entry, or let go of it
            assert (sys.getrefcount(entry) == num_refs) == (kind is RequestOutputKind.DELTA)
    if kind is RequestOutputKind.DELTA:
        assert reported == [[65], [66], [67]]
    else:
        assert reported == [[65], [65, 66], [65, 66, 67]]


def test_core_rejection_finishes_the_request_with_its_error(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", [1], SamplingParams()))
    result = outputs.process_outputs([EngineCoreOutput(
        request_id="r", new_token_ids=[], finish_reason=FinishReason.ABORT, error="bad",
    )])
    output = result.request_outputs[0]
    assert output.finished and output.error == "bad"
    assert output.outputs[0].finish_reason == "abort"


def test_queued_requests_get_outputs_and_errors_on_their_queue(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    queue: asyncio.Queue = asyncio.Queue()
    outputs.add_request(processor.process("r", [1], SamplingParams()), queue)
    assert outputs.process_outputs([core_output("r", "a")]).request_outputs == []
    assert queue.get_nowait().outputs[0].text == "a"
    outputs.propagate_error(RuntimeError("dead"))
    assert isinstance(queue.get_nowait(), RuntimeError)


def test_aborted_requests_are_forgotten_and_late_outputs_ignored(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("r", [1], SamplingParams(n=2)))
    assert outputs.abort_requests(["r", "unknown"]) == ["r-0", "r-1"]
    assert outputs.process_outputs([core_output("r-0", "a")]).request_outputs == []
    with pytest.raises(ValueError, match="in use"):
        outputs.add_request(processor.process("s", [1], SamplingParams()))
        outputs.add_request(processor.process("s", [1], SamplingParams()))


def test_a_request_whose_completion_ids_are_taken_is_rejected(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    outputs.add_request(processor.process("a-1", [1], SamplingParams()))
    with pytest.raises(ValueError, match="in use"):
        outputs.add_request(processor.process("a", [1], SamplingParams(n=2)))
    assert len(outputs) == 1
    result = outputs.process_outputs([core_output("a-1", "x", finish=FinishReason.LENGTH)])
    assert result.request_outputs[0].request_id == "a-1"


def test_an_aborted_queued_request_gets_a_final_abort_output(processor, tokenizer) -> None:
    outputs = OutputProcessor(tokenizer)
    queue: asyncio.Queue = asyncio.Queue()
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    outputs.add_request(processor.process("r", [1], params), queue)
    outputs.process_outputs([core_output("r", "ab")])
    assert outputs.abort_requests(["r"]) == ["r"]
    queue.get_nowait()
    final = queue.get_nowait()
    assert final.finished and final.outputs[0].finish_reason == "abort"
