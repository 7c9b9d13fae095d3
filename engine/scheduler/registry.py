"""Scheduling policies by name: a table of `module:Class` paths, resolved on demand.

The engine never imports policy packages such as `continuum` itself; they are named here as
strings and imported only when chosen (inside the engine-core process).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

from engine.scheduler.policy import SchedulingPolicy

POLICY_REGISTRY = MappingProxyType({
    "fcfs": "engine.scheduler.policies:FCFSPolicy",
    "priority": "engine.scheduler.policies:PriorityPolicy",
})


def resolve_policy_class(name: str) -> type:
    """The class for a registry name or a `module:Class` path; ValueError if unknown."""
    path = POLICY_REGISTRY.get(name, name if ":" in name else None)
    if path is None:
        known = ", ".join(sorted(POLICY_REGISTRY))
        raise ValueError(f"unknown scheduling policy {name!r}; known: {known}")
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, class_name)
    except (ImportError, AttributeError) as error:
        message = f"scheduling policy {name!r} ({path}) cannot be loaded: {error}"
        raise ValueError(message) from error


def make_policy(name: str, **kwargs: Any) -> SchedulingPolicy:
    """Instantiates the named policy with its keyword arguments (estimator, clock, ...)."""
    return resolve_policy_class(name)(**kwargs)
