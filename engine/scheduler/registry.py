"""Scheduling policies by name: a table of `module:Class` paths, resolved on demand.

The engine never imports policy packages such as `continuum` itself; they are named here as
strings and imported only when chosen (inside the engine-core process).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from engine.plugins import load_named
from engine.scheduler.policy import SchedulingPolicy

POLICY_REGISTRY = MappingProxyType({
    "fcfs": "engine.scheduler.policies:FCFSPolicy",
    "priority": "engine.scheduler.policies:PriorityPolicy",
    "continuum": "continuum.policy:ContinuumPolicy",
    "continuum-fixed": "continuum.policy:ContinuumFixedPolicy",
    "infercept": "continuum.baselines:InferCeptPolicy",
    "autellix": "continuum.baselines:AutellixPolicy",
})


def resolve_policy_class(name: str) -> type:
    """The class for a registry name or a `module:Class` path; ValueError if unknown."""
    return load_named("scheduling policy", name, POLICY_REGISTRY)


def make_policy(name: str, **kwargs: Any) -> SchedulingPolicy:
    """Instantiates the named policy with its keyword arguments (estimator, clock, ...)."""
    return resolve_policy_class(name)(**kwargs)
