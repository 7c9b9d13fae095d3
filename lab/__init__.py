"""The lab: this repository's benches that drive a `continuum serve` subprocess as users and
attackers would (load, soak, slow clients, one tenant against another, memory), its GPU
forward bench and the check of the simulator against its own GPU runs. Run from a checkout
(`python -m lab NAME`); not in the wheel. The tests run them reduced.

`LAB_COMMANDS` maps each command's name to its one-line help; the module of command `name`
is `lab.bench.<name with - replaced by _>`, with `add_arguments(parser)` and
`main(args) -> int` as `continuum bench`'s commands have. This module imports only the
standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

LAB_COMMANDS: Mapping[str, str] = MappingProxyType({
    "forward": "model runner steps at fixed decode, prefill shapes",
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
    "amplification": "memory of a `continuum serve` subprocess before and after one huge "
                     "completion request",
    "streams": "the API server's memory of a `continuum serve` subprocess around long "
               "completion streams with logprobs",
})
