"""Scheduling policies by name (`POLICIES`), registered as `module:attribute` paths.

The engine never imports policy packages such as `continuum` itself; they are named here as
paths and imported only when chosen, and any other `module:attribute` path loads a plugin
policy. An entry is a `PolicyFactory`: a policy class (see `BasePolicy`) or any object with
an `options_type` and a `from_options` that builds the policy with its options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from engine.registry import Registry
from engine.scheduler.options import describe_options, parse_policy_options
from engine.scheduler.policy import SchedulingPolicy


class PolicyFactory(Protocol):
    """What a registry entry is: the policy's options (a frozen config, None for none) and
    how to build it with them."""

    @property
    def options_type(self) -> type | None: ...

    def from_options(self, options: Mapping[str, object], **kwargs: Any) -> SchedulingPolicy:
        ...


POLICIES: Registry[PolicyFactory] = Registry("scheduling policy", {
    "fcfs": "engine.scheduler.policies:FCFSPolicy",
    "priority": "engine.scheduler.policies:PriorityPolicy",
    "continuum": "continuum.presets:CONTINUUM",
    "continuum-fixed": "continuum.presets:CONTINUUM_FIXED",
    "job-fcfs": "continuum.presets:JOB_FCFS",
    "infercept": "continuum.presets:INFERCEPT",
    "autellix": "continuum.presets:AUTELLIX",
}, accepts_paths=True)


def resolve_policy(name: str) -> PolicyFactory:
    """The factory for a registry name or a `module:attribute` path; ValueError if unknown."""
    return POLICIES.load(name)


def make_policy(
    name: str, options: Mapping[str, object] | None = None, **kwargs: Any
) -> SchedulingPolicy:
    """The named policy built with its options (and the keyword arguments its factory
    takes); ValueError naming an unknown policy or a bad option."""
    check_policy_options(name, options or {})
    return resolve_policy(name).from_options(options or {}, **kwargs)


def check_policy_options(name: str, options: Mapping[str, object]) -> None:
    """Validates a policy's options without building it; ValueError naming the problem."""
    options_type = getattr(resolve_policy(name), "options_type", None)
    parse_policy_options(options_type, options, owner=f"scheduling policy {name!r}")


def policy_option_lines(name: str) -> list[str]:
    """`name=default: help` for each option of the policy (none for a policy without)."""
    options_type = getattr(resolve_policy(name), "options_type", None)
    return [] if options_type is None else describe_options(options_type)


def policy_options_help(default_policy: str) -> str:
    """The options of every registered policy, for `--help`: the default policy's in full
    (with defaults), the others by name."""
    default_lines = policy_option_lines(default_policy)
    parts = [f"{default_policy}: " + "; ".join(default_lines)]
    default_keys = [line.split("=", 1)[0] for line in default_lines]
    for name in POLICIES:
        if name != default_policy:
            keys = [line.split("=", 1)[0] for line in policy_option_lines(name)]
            described = (f"those of {default_policy}" if keys == default_keys
                         else ", ".join(keys) or "none")
            parts.append(f"{name}: {described}")
    return ". ".join(parts)
