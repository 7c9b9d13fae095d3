"""The tool a finished turn called, as the policy reads it: for a request that offered tools,
exactly the calls the server returned to its client (the same parser); otherwise the
estimator's reading of formats that clients parse themselves."""

from __future__ import annotations

import pytest

from continuum.retention_rules import _returned_tool_key
from engine.tool_calls import ToolCallFormat
from estimator.parsing import tool_key

OFFERED = ToolCallFormat(parser="auto", tool_names=("search", "fetch"))


@pytest.mark.parametrize(("text", "key"), [
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call><|im_end|>', "search"),
    ('{"name": "fetch", "parameters": {}}; {"name": "search", "parameters": {}}<|eot_id|>',
     "fetch+search"),
    ('<tool_call>{"name": "delete", "arguments": {}}</tool_call>', None),  # not offered
    ('<tool_call>not json</tool_call><tool_call>{"name": "search"}</tool_call>', None),
    ("```bash\nls -la\n```", None),  # the client got text, and no call
])
def test_a_request_that_offered_tools_called_what_the_server_returned(text, key) -> None:
    assert _returned_tool_key(OFFERED, text) == key


def test_one_call_only_when_parallel_calls_are_off() -> None:
    one = ToolCallFormat(parser="hermes", tool_names=("search", "fetch"), parallel=False)
    text = ('<tool_call>{"name": "fetch", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert _returned_tool_key(one, text) == "fetch"
    assert tool_key(text) == "fetch+search"  # a client parsing the text itself sees both
