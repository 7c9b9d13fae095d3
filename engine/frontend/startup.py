"""Starting a frontend over a core process: the core and the tokenizer at once.

Neither needs the other. A tokenizer's loader imports transformers, about a second of CPU
(several when the tokenizer needs `AutoTokenizer`, which imports torch), and a core process
spends its own seconds importing torch and building the model: done at once, a frontend
starts in about the longer of the two instead of their sum.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from engine.config import EngineConfig
from engine.core.client import StartupCheck
from engine.frontend.processor import InputProcessor


class _Client(Protocol):
    """A core client: `shutdown` stops its core process."""

    def shutdown(self) -> None: ...


ClientT = TypeVar("ClientT", bound=_Client)


def start_with_processor(config: EngineConfig, tokenizer: Any,
                         start_client: Callable[[StartupCheck], ClientT]
                         ) -> tuple[InputProcessor, ClientT]:
    """The config's `InputProcessor` (`InputProcessor.for_config(config, tokenizer)`) and the
    client that `start_client` returns, built at once.

    `start_client` runs in the calling thread while the processor is built in a helper
    thread. It must start a core process, wait for it to be ready and, while it waits, ask
    the check it is given: that returns the processor's error once building it failed, so
    the start stops (its process stopped) and that error is raised without waiting for the
    core. A client that fails to start raises its own error once the processor is done. A
    client started when the processor then fails is shut down: no core process outlives
    the error.

    Frontends built at once in several threads should each be given a loaded `tokenizer`:
    transformers' lazy imports race when two threads start them.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        processor = pool.submit(InputProcessor.for_config, config, tokenizer)
        client = start_client(lambda: _error_of(processor))
        try:
            return processor.result(), client
        except BaseException:
            client.shutdown()
            raise


def _error_of(future: Future[Any]) -> BaseException | None:
    """The error `future` ended with; None while it runs or once it succeeded."""
    return future.exception() if future.done() else None
