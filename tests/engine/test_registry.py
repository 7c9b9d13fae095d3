import re
import typing

import pytest

from engine.executor.base import EXECUTORS
from engine.model.attention import ATTENTION_BACKENDS
from engine.registry import Registry
from engine.replicas.routing import ROUTER_NAMES, ROUTERS, RouterName, make_router
from engine.scheduler.policies import FCFSPolicy
from engine.scheduler.policy_registry import POLICIES
from engine.tool_calls import TOOL_PARSERS
from estimator.estimator_registry import ESTIMATORS

EVERY_REGISTRY = [POLICIES, EXECUTORS, ATTENTION_BACKENDS, TOOL_PARSERS, ESTIMATORS, ROUTERS]


@pytest.mark.parametrize("registry", EVERY_REGISTRY, ids=lambda registry: registry.kind)
def test_every_kind_refuses_an_unknown_name_the_same_way(registry: Registry) -> None:
    message = f"unknown {registry.kind} 'nosuch'; known: {', '.join(registry.names)}"
    with pytest.raises(ValueError, match=re.escape(message)):
        registry.load("nosuch")
    with pytest.raises(ValueError, match=re.escape(f"unknown {registry.kind} 'nosuch'")):
        registry.check("nosuch")
    assert "nosuch" not in registry and len(registry) == len(registry.names) > 0
    for name in registry:
        registry.check(name)


def test_entries_load_by_object_or_path_in_registration_order() -> None:
    registry: Registry[type] = Registry("policy", {
        "by-path": "engine.scheduler.policies:FCFSPolicy", "by-object": FCFSPolicy,
    })
    assert registry.names == ("by-path", "by-object") and list(registry) == list(registry.names)
    assert registry.load("by-path") is FCFSPolicy and registry.load("by-object") is FCFSPolicy


def test_a_path_loads_only_where_paths_are_accepted() -> None:
    path = "engine.scheduler.policies:FCFSPolicy"
    assert POLICIES.accepts_paths and POLICIES.load(path) is FCFSPolicy
    with pytest.raises(ValueError, match="or a module:attribute path"):
        POLICIES.load("nosuch")
    with pytest.raises(ValueError, match=r"^unknown router"):
        ROUTERS.load(path)


@pytest.mark.parametrize("path", ["engine.nosuch:Policy", "engine.scheduler.policies:Nosuch"])
def test_a_path_that_cannot_be_loaded_says_so(path: str) -> None:
    with pytest.raises(ValueError, match=f"scheduling policy '{path}' .* cannot be loaded"):
        POLICIES.load(path)


def test_the_routers_are_the_names_the_flags_offer() -> None:
    assert typing.get_args(RouterName) == ROUTER_NAMES
    assert type(make_router("affinity", seed=3)).__name__ == "JobAffinityRouter"
