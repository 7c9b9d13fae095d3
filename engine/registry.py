"""Named implementations of one kind, looked up the same way for every kind.

Scheduling policies, executors, attention backends, tool-call parsers, estimators and replica
routers each have one `Registry`, defined by the module that owns the kind. An entry is the
implementation itself, or its `module:attribute` path when importing it must wait until it
is chosen: it lives in a package the registering layer may not import (`continuum`'s
policies) or needs a heavy dependency (torch for the torch executor, triton for its
attention backend).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class Registry(Generic[T]):
    """The implementations of one kind by name, in registration order; immutable.

    `kind` names the kind in error messages ("scheduling policy"). With `accepts_paths`, a
    `module:attribute` path that is not a registered name loads that attribute (a plugin).
    """

    def __init__(self, kind: str, entries: Mapping[str, T | str], *,
                 accepts_paths: bool = False) -> None:
        self.kind = kind
        self.accepts_paths = accepts_paths
        self._entries: Mapping[str, T | str] = MappingProxyType(dict(entries))

    @property
    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, name: str) -> None:
        """ValueError, the same for every kind, if `name` is neither registered nor (when
        paths are accepted) a `module:attribute` path; imports nothing."""
        if name in self._entries or (self.accepts_paths and ":" in name):
            return
        paths = " or a module:attribute path" if self.accepts_paths else ""
        raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self._entries)}"
                         f"{paths}")

    def load(self, name: str) -> T:
        """The implementation registered as `name` (imported now if registered by path), or
        at the path `name`; ValueError if it is unknown or cannot be imported."""
        self.check(name)
        entry = self._entries.get(name, name)
        if not isinstance(entry, str):
            return entry
        module_name, _, attribute = entry.partition(":")
        try:
            return cast(T, getattr(importlib.import_module(module_name), attribute))
        except (ImportError, AttributeError) as error:
            raise ValueError(f"{self.kind} {name!r} ({entry}) cannot be loaded: {error}"
                             ) from error
