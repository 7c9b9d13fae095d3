"""End to end on the tiny model: `LLM`, `LLMEngine` (in process and multiprocess), `AsyncLLM`."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import llguidance
import pytest

from engine.core.client import EngineDeadError
from engine.engine_args import EngineArgs
from engine.frontend.async_llm import AsyncLLM, QueueFullError
from engine.frontend.llm import LLM
from engine.frontend.llm_engine import LLMEngine
from engine.request import JobInfo
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.structured_output import grammars
from engine.structured_output.spec import StructuredOutputSpec
from tests.engine.structured_output.tokenizer_builds import CountingTokenizers

ENGINE_ARGS = {"max_model_len": 256, "num_kv_blocks": 128, "max_num_seqs": 32}
PROMPTS = ["Hello, world", "日本語のテキスト", [5, 6, 7, 8, 9] * 7, "a" * 40]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(**ENGINE_ARGS)
    yield llm
    llm.shutdown()


class AsyncEngine:
    """An `AsyncLLM` with the event loop it lives on, shared by a module's tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = AsyncLLM.from_engine_args(EngineArgs(**ENGINE_ARGS))

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def close(self) -> None:
        async def stop() -> None:
            self.engine.shutdown()
            await asyncio.sleep(0)  # let the cancelled background tasks finish

        self.loop.run_until_complete(stop())
        self.loop.close()


@pytest.fixture(scope="module")
def async_engine():
    engine = AsyncEngine()
    yield engine
    engine.close()


async def generate_all(engine: AsyncLLM, prompts, params: SamplingParams):
    async def one(index: int, prompt):
        final = None
        async for output in engine.generate(prompt, params, f"req-{index}"):
            final = output
        return final

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def summary(outputs) -> list[tuple[str, list[int], str]]:
    return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in outputs]


def test_every_client_kind_gives_identical_greedy_outputs(llm, async_engine) -> None:
    offline = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine = LLMEngine.from_engine_args(EngineArgs(**ENGINE_ARGS), multiprocess=True)
    try:
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(f"mp-{index}", prompt, GREEDY)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        multiprocess = [finished[f"mp-{index}"] for index in range(len(PROMPTS))]
    finally:
        engine.shutdown()
    streamed = async_engine.run(generate_all(async_engine.engine, PROMPTS, GREEDY))
    assert summary(offline) == summary(multiprocess) == summary(streamed)
    assert all(len(o.outputs[0].token_ids) == 12 for o in offline)
    assert offline[0].prompt == "Hello, world"
    assert offline[2].prompt is None and offline[2].prompt_token_ids == PROMPTS[2]


def test_generate_keeps_prompt_order_and_reports_cached_tokens(llm) -> None:
    shared = [7] * 40
    outputs = llm.generate([[*shared, 1], [*shared, 2]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids[-1] for o in outputs] == [1, 2]
    assert llm.generate([[*shared, 3]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 32


def test_llm_builds_the_grammar_tokenizer_before_its_first_grammar_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not on the compile thread, where building it would stall the steps of the requests
    without a grammar beside it; once, whatever the later grammar requests."""
    tokenizers = CountingTokenizers()
    monkeypatch.setattr(llguidance, "LLTokenizer", tokenizers)
    llm = LLM(**ENGINE_ARGS)
    try:
        plain = llm.generate("no grammar", GREEDY, use_tqdm=False)[0]
        assert plain.outputs[0].token_ids and tokenizers.builds == []
        choice = SamplingParams(temperature=0.0, max_tokens=8,
                                structured_output=StructuredOutputSpec(
                                    kind="grammar", grammar=grammars.choice_grammar(["yes"])))
        for _ in range(2):
            outputs = llm.generate(["no grammar", "a grammar"], [GREEDY, choice],
                                   use_tqdm=False)
            assert outputs[1].outputs[0].text == "yes"
        eos = llm.engine.processor.eos_token_id
        assert tokenizers.builds == [(eos, threading.current_thread().name)]
    finally:
        llm.shutdown()


def test_seeded_sampling_is_reproducible_and_n_completions_differ(llm) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, n=3, ignore_eos=True)
    first, second = (llm.generate("seeded", params, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def test_stop_strings_cut_the_text(llm) -> None:
    reference = llm.generate("stop here", GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = reference[3:5]
    assert stop
    completion = llm.generate("stop here", SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,),
    ), use_tqdm=False)[0].outputs[0]
    assert completion.text == reference[: reference.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_chat_applies_the_template(llm) -> None:
    messages = [{"role": "user", "content": "hi"}]
    output = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=False)
    assert llm.get_tokenizer().decode(output.prompt_token_ids) == expected
    assert len(llm.chat([messages, messages], GREEDY, use_tqdm=False)) == 2


def test_one_bad_prompt_queues_nothing(llm) -> None:
    with pytest.raises(ValueError, match="no room for output"):
        llm.generate(["fine", [1] * 256], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params for"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.get_stats()
    assert stats.num_waiting == stats.num_running == 0


def test_logprobs_are_returned_per_token(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    completion = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    assert all(lp.rank == 1 and len(lp.top_token_ids) == 3 for lp in completion.logprobs)


def test_200_concurrent_async_requests_complete(async_engine) -> None:
    prompts = [[(i % 200) + 1] * (4 + i % 30) for i in range(200)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    outputs = async_engine.run(generate_all(async_engine.engine, prompts, params))
    assert len(outputs) == 200 and all(o.finished for o in outputs)
    stats = async_engine.run(async_engine.engine.get_stats())
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_cancelled_and_abandoned_streams_free_their_blocks(async_engine) -> None:
    engine = async_engine.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def consume(request_id: str, stop_after: int | None,
                      started: asyncio.Event | None = None) -> None:
        count = 0
        async for _ in engine.generate([3] * 40, params, request_id,
                                       job=JobInfo(job_id=request_id)):
            count += 1
            if started is not None:
                started.set()
            if count == stop_after:
                break  # abandoned: the generator is closed, which aborts

    async def scenario() -> None:
        started = [asyncio.Event() for _ in range(4)]
        cancelled = [asyncio.ensure_future(consume(f"c{i}", None, started[i]))
                     for i in range(4)]
        abandoned = [consume(f"a{i}", 2) for i in range(4)]
        await asyncio.gather(*abandoned)
        for event in started:
            await event.wait()
        assert not any(task.done() for task in cancelled)
        for task in cancelled:
            task.cancel()
        await asyncio.gather(*cancelled, return_exceptions=True)
        deadline_s = time.monotonic() + 10
        while (stats := await engine.get_stats()).num_running and time.monotonic() < deadline_s:
            await asyncio.sleep(0.01)
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_kv_blocks
        await engine.check_invariants()
        assert not engine.output_processor.has_unfinished_requests()

    async_engine.run(scenario())


def test_async_errors_surface_per_request(async_engine) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="in \\[0, 272\\)"):
            async for _ in async_engine.engine.generate([999], GREEDY):
                pass
        assert await async_engine.engine.release_job("nobody") is False
        assert await async_engine.engine.reset_prefix_cache() is True

    async_engine.run(scenario())


def test_an_external_abort_ends_the_stream(async_engine) -> None:
    engine = async_engine.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def scenario() -> None:
        outputs = []
        async for output in engine.generate([4] * 20, params, "to-abort"):
            outputs.append(output)
            if len(outputs) == 2:
                await engine.abort("to-abort")
        assert outputs[-1].finished
        assert outputs[-1].outputs[0].finish_reason == "abort"

    async_engine.run(scenario())


def test_submit_queues_all_requests_or_none(async_engine) -> None:
    engine = async_engine.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, n=2, ignore_eos=True)

    async def scenario() -> None:
        batch = [engine.processor.process(f"batch-{i}", [5, 6, 7], params) for i in range(3)]
        with pytest.raises(QueueFullError, match="adds 6") as refused:
            engine.submit(batch, max_waiting_requests=5)
        assert refused.value.num_new == 6
        duplicate = [batch[0], engine.processor.process("batch-0", [1], params)]
        with pytest.raises(ValueError, match="already in use"):
            engine.submit(duplicate)
        assert engine.num_unfinished_requests == 0
        assert engine.num_waiting_requests == 0
        finals = []
        for stream in engine.submit(batch, max_waiting_requests=6):
            async for output in stream:
                finals.append(output)
        assert [len(o.outputs) for o in finals if o.finished] == [2, 2, 2]
        assert engine.num_unfinished_requests == 0

    async_engine.run(scenario())


def test_fail_requests_ends_every_stream_with_the_error() -> None:
    async_engine = AsyncEngine()
    engine = async_engine.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def scenario() -> None:
        (stream,) = engine.submit([engine.processor.process("to-fail", [4] * 8, params)])
        await anext(stream)
        engine.fail_requests(RuntimeError("draining"))
        with pytest.raises(RuntimeError, match="draining"):
            async for _ in stream:
                pass
        await asyncio.sleep(0.2)  # the abort reaches the core
        await engine.check_invariants()
        assert engine.num_unfinished_requests == 0
        with pytest.raises(RuntimeError, match="draining"):  # later ones are refused
            engine.submit([engine.processor.process("too-late", [4], params)])
        assert engine.num_unfinished_requests == 0

    try:
        async_engine.run(scenario())
    finally:
        async_engine.close()


def test_shutdown_fails_requests_in_flight() -> None:
    engine = AsyncEngine()
    params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)

    async def scenario() -> None:
        async def consume() -> None:
            async for _ in engine.engine.generate([1] * 10, params):
                pass

        task = asyncio.ensure_future(consume())
        while not engine.engine.output_processor.has_unfinished_requests():
            await asyncio.sleep(0.001)
        engine.engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 5)

    try:
        engine.run(scenario())
    finally:
        engine.close()


def test_killing_the_core_fails_pending_requests_within_seconds() -> None:
    engine = AsyncEngine()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)

        async def consume(index: int, started: asyncio.Event) -> None:
            async for _ in engine.engine.generate([1] * 10, params, f"k{index}"):
                started.set()

        async def scenario() -> float:
            started = asyncio.Event()
            tasks = [asyncio.ensure_future(consume(i, started)) for i in range(8)]
            await started.wait()
            os.kill(engine.engine.client.process.pid, signal.SIGKILL)
            killed_s = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            assert all(isinstance(result, EngineDeadError) for result in results), results
            with pytest.raises(EngineDeadError):
                async for _ in engine.engine.generate("again", GREEDY):
                    pass
            return time.monotonic() - killed_s

        assert engine.run(scenario()) < 5
        assert engine.engine.is_dead
    finally:
        engine.close()
