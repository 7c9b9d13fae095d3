"""The structured-output constraint a request carries (torch-free wire type)."""

from __future__ import annotations

from typing import Literal

import msgspec

StructuredOutputKind = Literal[
    "json_schema", "json_object", "regex", "choice", "grammar", "tool_calls"
]


class StructuredOutputSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A grammar the request's output must match, from its first generated token to its end.

    `grammar` is a grammar in llguidance's Lark dialect (which embeds JSON schemas with
    `%json { ... }`), built and checked by the frontend (`engine.structured_output.grammars`);
    the engine core compiles it once per distinct text and caches it. `kind` says what the
    client asked for and `param` which request field it came from (for stats and errors
    only; neither changes the constraint).
    """

    kind: StructuredOutputKind
    grammar: str
    param: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError("a structured-output grammar must be a non-empty string")
