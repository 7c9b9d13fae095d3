"""How many intra-op threads torch gives the model of an engine core in a process of its own.

torch's default is one thread per core. `serve`'s engine core process shares the cores with
its frontend's event loop, parsing children and threads, and the clients; a parallel region
of the model then waits for a thread the OS has descheduled (on two busy cores, a step of 8
tokens took 137 ms instead of about 2). So such a core leaves one core to its frontend, as
vLLM's CPU backend reserves one (docs/benchmarks.md, "Torch threads of a core beside its
frontend"). An engine in the caller's process (`LLM`, the offline benches) keeps torch's
count, which large batches need. The torch executor applies `ModelConfig.cpu_threads`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from engine.config import EngineConfig


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def core_process_threads(requested: int | None, *, num_cores: int,
                         environ: Mapping[str, str]) -> int | None:
    """The threads of a core process's model: `requested` (`ModelConfig.cpu_threads`) if
    set; else None (torch's count, which follows it) when `OMP_NUM_THREADS` is set in
    `environ`; else `num_cores` - 1, at least 1."""
    if requested is not None:
        return requested
    if environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, num_cores - 1)


def for_core_process(config: EngineConfig,
                     environ: Mapping[str, str] = os.environ) -> EngineConfig:
    """`config` as the client sends it to the core process it starts: with `cpu_threads` set
    by `core_process_threads` when it was None."""
    threads = core_process_threads(config.model.cpu_threads, num_cores=usable_cores(),
                                   environ=environ)
    if threads == config.model.cpu_threads:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 cpu_threads=threads))
