"""The serving engine: configs, requests, the KV cache, the scheduler, model execution, the
engine core and its clients, and the public APIs.

The public names below are imported lazily, so importing a torch-free module such as
`engine.scheduler` never loads the model code or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "engine.frontend.llm",
    "LLMEngine": "engine.frontend.llm_engine",
    "AsyncLLM": "engine.frontend.async_llm",
    "EngineArgs": "engine.engine_args",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "JobInfo": "engine.request",
    "EngineDeadError": "engine.core.client",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
