"""The benchmarks behind `continuum bench NAME`, one module per command: what a user of the
engine runs (replaying agent jobs against a server, simulating policies on workloads,
calibrating the simulator on their own traces, the engine's own throughput and step cost).
The attack, load, soak and GPU benches of this repository are the lab's (`python -m lab`).

`BENCH_COMMANDS` maps each command's name to its one-line help, in the order `continuum bench
--help` lists them. The module of command `name` is `eval.bench.<name with - replaced by _>`;
like every command module it provides `add_arguments(parser)` and `main(args) -> int`.

What several commands share lives beside this package in `eval/`: arrivals, workloads and
their flags, policy specs, run metrics, reports, the replay client and the simulator.

This module imports only the standard library, so that `continuum --help` lists the commands
without loading any of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

BENCH_COMMANDS: Mapping[str, str] = MappingProxyType({
    "scheduler": "CPU cost of one scheduler step",
    "throughput": "offline LLM.generate vs transformers",
    "estimator": "TTL estimators replayed over an agent trace",
    "agent": "agent jobs replayed against an OpenAI-compatible server",
    "sim": "policies compared on an agent trace in simulated time",
    "calibrate": "a measured cost profile for `bench sim`, fitted to the step traces of a "
                 "real run",
    "workloads": "the named workloads that ship with the package",
})
