"""Scheduling policies by name (`POLICIES`), registered as `module:Class` paths.

The engine never imports policy packages such as `continuum` itself; they are named here as
paths and imported only when chosen, and any other `module:Class` path loads a plugin policy.
A policy class is built with its options by its `from_options` classmethod (see
`BasePolicy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.registry import Registry
from engine.scheduler.options import describe_options, parse_policy_options
from engine.scheduler.policy import SchedulingPolicy

POLICIES: Registry[type] = Registry("scheduling policy", {
    "fcfs": "engine.scheduler.policies:FCFSPolicy",
    "priority": "engine.scheduler.policies:PriorityPolicy",
    "continuum": "continuum.policy:ContinuumPolicy",
    "continuum-fixed": "continuum.policy:ContinuumFixedPolicy",
    "continuum-oracle": "continuum.oracle:ContinuumOraclePolicy",
    "continuum-af226d3": "continuum.af226d3:ContinuumAf226d3Policy",
    "job-fcfs": "continuum.program_order:JobFCFSPolicy",
    "infercept": "continuum.baselines:InferCeptPolicy",
    "autellix": "continuum.baselines:AutellixPolicy",
}, accepts_paths=True)


def resolve_policy_class(name: str) -> type:
    """The class for a registry name or a `module:Class` path; ValueError if unknown."""
    return POLICIES.load(name)


def make_policy(
    name: str, options: Mapping[str, object] | None = None, **kwargs: Any
) -> SchedulingPolicy:
    """The named policy built with its options (and the keyword arguments its class takes);
    ValueError naming an unknown policy or a bad option."""
    check_policy_options(name, options or {})
    return resolve_policy_class(name).from_options(options or {}, **kwargs)


def check_policy_options(name: str, options: Mapping[str, object]) -> None:
    """Validates a policy's options without building it; ValueError naming the problem."""
    options_type = getattr(resolve_policy_class(name), "options_type", None)
    parse_policy_options(options_type, options, owner=f"scheduling policy {name!r}")


def policy_option_lines(name: str) -> list[str]:
    """`name=default: help` for each option of the policy (none for a policy without)."""
    options_type = getattr(resolve_policy_class(name), "options_type", None)
    return [] if options_type is None else describe_options(options_type)


def policy_options_help(default_policy: str) -> str:
    """The options of every registered policy, for `--help`: the default policy's in full
    (with defaults), the others by name."""
    parts = [f"{default_policy}: " + "; ".join(policy_option_lines(default_policy))]
    for name in POLICIES:
        if name != default_policy:
            lines = policy_option_lines(name)
            keys = ", ".join(line.split("=", 1)[0] for line in lines) or "none"
            parts.append(f"{name}: {keys}")
    return ". ".join(parts)
