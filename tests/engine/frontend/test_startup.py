"""A frontend builds its input processor (the tokenizer) while its core process starts."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.client import StartupCheck
from engine.engine_args import EngineArgs
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.processor import InputProcessor
from engine.frontend.startup import start_with_processor

# fcfs: no start-up prefill profile, so a core that is waited for starts sooner.
CONFIG = EngineArgs(max_model_len=256, num_kv_blocks=64,
                    scheduling_policy="fcfs").to_engine_config()


class FakeClient:
    def __init__(self) -> None:
        self.num_shutdowns = 0

    def shutdown(self) -> None:
        self.num_shutdowns += 1


def test_the_processor_is_built_while_the_client_starts(tokenizer, monkeypatch) -> None:
    """Each side waits for the other to have begun: in turn, this would time out."""
    building, starting = threading.Event(), threading.Event()
    built = InputProcessor.for_config

    def for_config(cls: type[InputProcessor], config: EngineConfig, given: Any
                   ) -> InputProcessor:
        building.set()
        assert starting.wait(timeout=30)
        return built(config, given)

    def start_client(check: StartupCheck) -> FakeClient:
        starting.set()
        assert building.wait(timeout=30)
        return FakeClient()

    monkeypatch.setattr(InputProcessor, "for_config", classmethod(for_config))
    processor, client = start_with_processor(CONFIG, tokenizer, start_client)
    assert processor.tokenizer is tokenizer and client.num_shutdowns == 0


def test_a_processor_that_fails_shuts_the_started_client_down(monkeypatch) -> None:
    def for_config(cls: type[InputProcessor], config: EngineConfig, given: Any) -> None:
        raise ValueError("no usable tokenizer")

    monkeypatch.setattr(InputProcessor, "for_config", classmethod(for_config))
    client = FakeClient()
    with pytest.raises(ValueError, match="no usable tokenizer"):
        start_with_processor(CONFIG, None, lambda check: client)
    assert client.num_shutdowns == 1


def test_a_processor_that_fails_stops_the_client_while_it_starts(monkeypatch) -> None:
    """The start asks its check until the processor's error comes, and raises it: a failed
    tokenizer does not wait for the core to be ready."""
    def for_config(cls: type[InputProcessor], config: EngineConfig, given: Any) -> None:
        raise ValueError("no usable tokenizer")

    def start_client(check: StartupCheck) -> FakeClient:
        for _ in range(30_000):  # at most 30 s
            error = check()
            if error is not None:
                raise error
            time.sleep(0.001)
        raise AssertionError("the check never returned the processor's error")

    monkeypatch.setattr(InputProcessor, "for_config", classmethod(for_config))
    with pytest.raises(ValueError, match="no usable tokenizer"):
        start_with_processor(CONFIG, None, start_client)


def test_a_client_that_fails_to_start_raises_once_the_processor_is_built(tokenizer,
                                                                        monkeypatch) -> None:
    finished = threading.Event()
    built = InputProcessor.for_config

    def for_config(cls: type[InputProcessor], config: EngineConfig, given: Any
                   ) -> InputProcessor:
        processor = built(config, given)
        finished.set()
        return processor

    def start_client(check: StartupCheck) -> FakeClient:
        raise RuntimeError("the engine core failed to start")

    monkeypatch.setattr(InputProcessor, "for_config", classmethod(for_config))
    with pytest.raises(RuntimeError, match="failed to start"):
        start_with_processor(CONFIG, tokenizer, start_client)
    assert finished.is_set()  # no helper thread left running


@pytest.mark.parametrize("frontend", ["AsyncLLM", "LLMEngine"])
def test_no_core_process_outlives_a_tokenizer_that_fails_to_load(frontend: str,
                                                                 monkeypatch) -> None:
    """The real clients ask the check as they wait for the core's handshake."""
    def for_config(cls: type[InputProcessor], config: EngineConfig, given: Any) -> None:
        raise ValueError("no usable tokenizer")

    monkeypatch.setattr(InputProcessor, "for_config", classmethod(for_config))
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="no usable tokenizer"):
        if frontend == "AsyncLLM":
            AsyncLLM(CONFIG)
        else:
            LLMEngine(CONFIG, multiprocess=True)
    assert set(multiprocessing.active_children()) <= before
