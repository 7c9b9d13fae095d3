"""Whether an engine core process leaves a core to its frontend.

torch's default is one intra-op thread per physical core. `serve`'s engine core process
shares the cores with its frontend's event loop, parsing children and threads, and the
clients; a parallel region of the model then waits for a thread the OS has descheduled (on
two busy cores, a step of 8 tokens took 137 ms instead of about 2). So the client that starts
such a process asks its torch executor to take one thread fewer, leaving a core to the
frontend, as vLLM's CPU backend reserves one (docs/decisions/0016-torch-threads.md). An
engine in the caller's process (`LLM`, the offline benches) keeps torch's count, which large
batches need.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from engine.config import EngineConfig


def for_core_process(config: EngineConfig,
                     environ: Mapping[str, str] = os.environ) -> EngineConfig:
    """`config` as the client sends it to the core process it starts: with
    `leave_core_to_frontend` on, unless it was given, or `cpu_threads` or `OMP_NUM_THREADS`
    (in `environ`, which the process inherits; Ray sets it in each replica from its CPUs)
    chose the count."""
    model = config.model
    if (model.leave_core_to_frontend is not None or model.cpu_threads is not None
            or environ.get("OMP_NUM_THREADS")):
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 leave_core_to_frontend=True))
