"""Starting a frontend over a core process: the core and the tokenizer at once.

Neither needs the other. A tokenizer's loader imports transformers, which takes seconds on a
CPU, and a core process spends its own seconds importing torch and building the model: done
at once, a frontend starts in about the longer of the two instead of their sum.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from engine.config import EngineConfig
from engine.frontend.processor import InputProcessor


class _Client(Protocol):
    def shutdown(self) -> None: ...


ClientT = TypeVar("ClientT", bound=_Client)


def start_with_processor(config: EngineConfig, tokenizer: Any,
                         start_client: Callable[[], ClientT]) -> tuple[InputProcessor, ClientT]:
    """The config's `InputProcessor` (`InputProcessor.for_config(config, tokenizer)`) and the
    client that `start_client` returns, built at once.

    `start_client` runs in this thread; it must start a core process and wait for it to be
    ready, so that this thread mostly waits while the processor is built in a helper
    thread. If either fails, the error is raised once the other is done. A client started
    when the processor then fails is shut down, so no core process outlives the error.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        processor = pool.submit(InputProcessor.for_config, config, tokenizer)
        client = start_client()
        try:
            return processor.result(), client
        except BaseException:
            client.shutdown()
            raise
