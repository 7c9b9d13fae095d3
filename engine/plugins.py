"""Named implementations resolved from `module:Name` paths, imported only when chosen.

Policies and executors are registered as strings so that choosing one never requires the
engine to import packages it must not depend on (`continuum`) or heavy ones it may not need
(`torch`, for the simulated executor).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def load_named(kind: str, name: str, registry: Mapping[str, str]) -> Any:
    """The object registered as `name`, or at the `module:Name` path `name`; ValueError if it
    is unknown or cannot be imported. `kind` names what is looked up, for error messages."""
    path = registry.get(name, name if ":" in name else None)
    if path is None:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}")
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{kind} {name!r} ({path}) cannot be loaded: {error}") from error
