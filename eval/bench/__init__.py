"""The benchmarks and load tools behind `continuum bench NAME`, one module per command.

`BENCH_COMMANDS` maps each command's name to its one-line help, in the order `continuum bench
--help` lists them. The module of command `name` is `eval.bench.<name with - replaced by _>`;
like every command module it provides `add_arguments(parser)` and `main(args) -> int`.

What several commands share lives beside this package in `eval/`: arrivals, workloads and
their flags, policy specs, run metrics, reports, the replay client, the simulator, the
`continuum serve` subprocess, the load clients and the checks run on a server after a load.

This module imports only the standard library, so that `continuum --help` lists the commands
without loading any of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

BENCH_COMMANDS: Mapping[str, str] = MappingProxyType({
    "scheduler": "CPU cost of one scheduler step",
    "forward": "model runner steps at fixed decode, prefill shapes",
    "throughput": "offline LLM.generate vs transformers",
    "estimator": "TTL estimators replayed over an agent trace",
    "agent": "agent jobs replayed against an OpenAI-compatible server",
    "sim": "policies compared on an agent trace in simulated time",
    "calibrate": "a measured cost profile for `bench sim`, fitted to the step traces of a "
                 "real run",
    "check-calibration": "a cost profile's simulation of the shipped GPU runs against their "
                         "measurements",
    "load": "load test of a `continuum serve` subprocess: leaks, pins, memory",
    "soak": "agent replay for minutes with the invariant checker on",
    "connections": "slow and many clients against a `continuum serve` subprocess: timeouts, "
                   "cap, descriptors",
    "structured": "structured outputs: step cost, grammar compile time",
    "grammars": "one tenant's hostile grammars against a `continuum serve` subprocess: its "
                "memory, the other tenant's latency",
    "bodies": "one tenant's huge chat and Responses bodies against a `continuum serve` "
              "subprocess: the other tenant's latency",
    "flood": "one tenant's flood of completions against a `continuum serve` subprocess: the "
             "other tenant's wait for its first token",
    "inference": "one tenant's requests of one prompt, filed by job inference, against a "
                 "`continuum serve` subprocess: the other tenant's latency, a lookup's cost",
    "pins": "one tenant's agent jobs pinning the KV pool against a `continuum serve` "
            "subprocess: the other tenant's latency, the pins' share",
    "drain": "SIGTERM to a `continuum serve` subprocess (one server or --replicas) with "
             "streams in flight: stop time, how each stream ended",
    "ingress": "clients without an API key sending large bodies to a `continuum serve "
               "--replicas` subprocess: the memory of its processes",
    "workloads": "the named workloads that ship with the package",
    "amplification": "memory of a `continuum serve` subprocess before and after one huge "
                     "completion request",
    "streams": "the API server's memory of a `continuum serve` subprocess around long "
               "completion streams with logprobs",
})
