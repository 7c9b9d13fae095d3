"""Tool-call parsing on text: Hermes tags, Llama-3 JSON, garbage, and streaming splits."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.entrypoints.openai.tool_call_stream import StreamingToolCallSplitter
from engine.tool_calls import (
    AutoToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    OfferedToolsParser,
    ParsedOutput,
    ParsedToolCall,
    make_tool_parser,
)

LS = ParsedToolCall("bash", json.dumps({"command": "ls"}))
READ = ParsedToolCall("read_file", json.dumps({"path": "a.py", "lines": [1, 2]}))

HERMES_CASES = [
    ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', None, [LS]),
    ('Let me check.\n<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>',
     "Let me check.", [LS]),
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>\n<tool_call>'
     '{"name": "read_file", "arguments": {"path": "a.py", "lines": [1, 2]}}</tool_call>',
     None, [LS, READ]),
    # Arguments as a JSON string, and an unterminated last block.
    ('<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}', None, [LS]),
    ("just text", "just text", []),
    ('<tool_call>{"name": "bash", "arguments": {"command": </tool_call>',
     '<tool_call>{"name": "bash", "arguments": {"command": </tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>["bash"]</tool_call>', '<tool_call>["bash"]</tool_call>', []),
    # Whitespace before a call is not content; without a call the text is kept as it is.
    ('Let me check. \n\n<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>',
     "Let me check.", [LS]),
    (' \n<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>', None, [LS]),
    ("  spaced out \n", "  spaced out \n", []),
]

LLAMA3_CASES = [
    ('{"name": "bash", "parameters": {"command": "ls"}}', None, [LS]),
    ('<|python_tag|>{"name": "bash", "arguments": {"command": "ls"}}', None, [LS]),
    ('{"name": "bash", "parameters": {"command": "ls"}}; {"name": "read_file", "parameters": '
     '{"path": "a.py", "lines": [1, 2]}}', None, [LS, READ]),
    ('{"name": "bash"}', None, [ParsedToolCall("bash", "{}")]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "bash", "parameters": {"command": "ls"}} trailing words',
     '{"name": "bash", "parameters": {"command": "ls"}} trailing words', []),
    ("The answer is 42.", "The answer is 42.", []),
    ("   ", "   ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes(text, content, calls):
    parsed = HermesToolParser().parse(text)
    assert parsed.content == content
    assert list(parsed.tool_calls) == calls


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_CASES)
def test_llama3_json(text, content, calls):
    parsed = Llama3JsonToolParser().parse(text)
    assert parsed.content == content
    assert list(parsed.tool_calls) == calls


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES + LLAMA3_CASES)
def test_auto_understands_both(text, content, calls):
    parsed = AutoToolParser().parse(text)
    assert list(parsed.tool_calls) == calls


def test_calls_of_tools_not_offered_are_content():
    parser = OfferedToolsParser(make_tool_parser("auto"), frozenset({"bash"}))
    answer = '{"name": "Alice", "age": 30}'
    assert parser.parse(answer).tool_calls == ()
    assert parser.parse(answer).content == answer
    assert parser.parse('{"name": "bash", "arguments": {"command": "ls"}}').tool_calls == (LS,)


def test_without_parallel_calls_only_the_first_is_kept():
    text = ('{"name": "bash", "parameters": {"command": "ls"}}; '
            '{"name": "bash", "parameters": {"command": "pwd"}}')
    parallel = OfferedToolsParser(make_tool_parser("llama3_json"), frozenset({"bash"}))
    single = OfferedToolsParser(make_tool_parser("llama3_json"), frozenset({"bash"}),
                                parallel=False)
    assert len(parallel.parse(text).tool_calls) == 2
    assert single.parse(text).tool_calls == (LS,)


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_tool_parser("xml")


def _stream(parser_name: str, text: str, cut_points: list[int], *, cut: bool = False):
    splitter = StreamingToolCallSplitter(make_tool_parser(parser_name))
    pieces, start = [], 0
    for point in [*sorted(cut_points), len(text)]:
        pieces.append(splitter.push(text[start:point]))
        start = point
    rest, parsed = splitter.finish(cut=cut)
    return "".join(pieces) + rest, pieces, parsed.tool_calls


@pytest.mark.parametrize("parser_name", ["auto", "hermes", "llama3_json"])
@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES + LLAMA3_CASES)
@settings(max_examples=40)
@given(data=st.data())
def test_streaming_agrees_with_the_whole_parse(parser_name, text, content, calls, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    streamed, _, streamed_calls = _stream(parser_name, text, cuts)
    parsed = make_tool_parser(parser_name).parse(text)
    assert streamed_calls == parsed.tool_calls
    assert streamed == (parsed.content or "")
    if not parsed.tool_calls:
        assert streamed == text


def test_streaming_sends_content_before_the_call_and_never_the_tags():
    text = 'Checking now.<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    streamed, pieces, calls = _stream("hermes", text, list(range(len(text))))
    assert streamed == "Checking now."
    assert "".join(pieces[:14]) == "Checking now."  # sent as it came, before the call ended
    assert calls == (LS,)


CALL_HEAD = '<tool_call>\n{"name": "bash", "arguments": '
CUT_CASES = [
    # Cut inside the arguments, before them, before the name is whole, or at the marker.
    (f'Let me check.\n{CALL_HEAD}{{"command": "l', "Let me check.", [],
     ParsedToolCall("bash", '{"command": "l')),
    ('<tool_call>\n{"name": "bash"', None, [], ParsedToolCall("bash", "")),
    ('Let me check. <tool_call>\n{"name": "ba', "Let me check.", [], None),
    ("<tool_call>\n", None, [], None),
    # A whole call, then one cut off; and a cut text whose last call is whole.
    (f'{CALL_HEAD}{{"command": "ls"}}}}</tool_call>{CALL_HEAD}{{"comm', None, [LS],
     ParsedToolCall("bash", '{"comm')),
    (f'{CALL_HEAD}{{"command": "ls"}}}}', None, [LS], None),
    ('{"name": "bash", "parameters": {"command": "l', None, [],
     ParsedToolCall("bash", '{"command": "l')),
    # A cut JSON answer that names no function is content, as is a broken call before the
    # cut one.
    ('{"answer": 4', '{"answer": 4', [], None),
    ('{"name": "Alice", "age": 3', '{"name": "Alice", "age": 3', [], None),
    (f'<tool_call>{{"oops"}}</tool_call>{CALL_HEAD}{{"comm',
     f'<tool_call>{{"oops"}}</tool_call>{CALL_HEAD}{{"comm', [], None),
    # A marker in prose begins no call; a call cut in its end tag is whole; arguments whole
    # before the cut are exactly their JSON; calls before a cut whose name is not whole.
    ("Wrap it in a <tool_call> tag, then", "Wrap it in a <tool_call> tag, then", [], None),
    (f'{CALL_HEAD}{{"command": "ls"}}}}\n</tool_call', None, [LS], None),
    (f'{CALL_HEAD}{{"command": "ls"}}, "id": "x', None, [],
     ParsedToolCall("bash", '{"command": "ls"}')),
    ('{"name": "bash", "parameters": {"command": "ls"}}; {"na', None, [LS], None),
    ('{"name": "bash", "parameters": {"command": "ls"}} and',
     '{"name": "bash", "parameters": {"command": "ls"}} and', [], None),
    # A JSON answer naming an offered tool, then another field: not a call.
    ('{"name": "bash", "age": 3', '{"name": "bash", "age": 3', [], None),
]


@pytest.mark.parametrize(("text", "content", "calls", "cut_call"), CUT_CASES)
def test_a_cut_text_gives_its_calls_and_the_one_it_was_cut_in(text, content, calls, cut_call):
    offered = OfferedToolsParser(make_tool_parser("auto"), frozenset({"bash"}))
    parsed = offered.parse(text, cut=True)
    assert (parsed.content, list(parsed.tool_calls), parsed.cut_call) == (
        content, calls, cut_call)
    assert offered.parse(text).cut_call is None  # a whole text has no cut call


def test_a_cut_call_of_a_tool_not_offered_reads_as_whole_text():
    text = f'{CALL_HEAD.replace("bash", "python")}{{"code": "1'
    parsed = OfferedToolsParser(make_tool_parser("hermes"), frozenset({"bash"})).parse(
        text, cut=True)
    assert (parsed.content, parsed.tool_calls, parsed.cut_call) == (text, (), None)
    single = OfferedToolsParser(make_tool_parser("hermes"), frozenset({"bash"}),
                                parallel=False)
    two = f'{CALL_HEAD}{{"command": "ls"}}}}</tool_call>{CALL_HEAD}{{"comm'
    assert single.parse(two, cut=True) == ParsedOutput(None, (LS,))  # the first call only


@pytest.mark.parametrize(("text", "content", "calls", "cut_call"), CUT_CASES)
@settings(max_examples=20)
@given(data=st.data())
def test_a_cut_stream_sends_the_cut_parses_content(text, content, calls, cut_call, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    streamed, _, streamed_calls = _stream("auto", text, cuts, cut=True)
    parsed = AutoToolParser().parse(text, cut=True)
    assert streamed == (parsed.content or "")
    assert streamed_calls == parsed.tool_calls


HUGE_INTEGER = "9" * 5_000  # more digits than Python converts (sys.get_int_max_str_digits)
DEEP = "[" * 100_000
HOSTILE_OUTPUTS = [
    f'<tool_call>{{"name": "t", "arguments": {{"x": {HUGE_INTEGER}}}}}</tool_call>',
    f'<tool_call>{{"name": "t", "arguments": {{"x": {HUGE_INTEGER}',
    f'<tool_call>{{"name": "t", "arguments": "{{\\"x\\": {HUGE_INTEGER}}}"}}</tool_call>',
    f'{{"name": "t", "parameters": {{"x": {HUGE_INTEGER}}}}}',
    f'<|python_tag|>{{"name": "t", "parameters": {{"x": -{HUGE_INTEGER}}}}}',
    f'<tool_call>{{"name": "t", "arguments": {DEEP}',
    f'{{"name": "t", "parameters": {DEEP}',
    '<tool_call>{"name": "t", "arguments": {"x": 1e999999}}</tool_call>',
    '<tool_call>{"name": "t", "arguments": {"x": "\udc80"}}</tool_call>',
]


@pytest.mark.parametrize("parser_name", ["auto", "hermes", "llama3_json"])
@pytest.mark.parametrize("text", HOSTILE_OUTPUTS, ids=range(len(HOSTILE_OUTPUTS)))
def test_hostile_output_parses_to_content_or_calls_never_raises(parser_name, text) -> None:
    for parser in (make_tool_parser(parser_name),
                   OfferedToolsParser(make_tool_parser(parser_name), frozenset({"t"}))):
        parsed = parser.parse(text)
        assert parsed.content == text or parsed.tool_calls
        for call in parsed.tool_calls:
            json.loads(call.arguments)  # what the server returns is JSON it can read back
        cut = parser.parse(text, cut=True)
        assert cut.cut_call is None or cut.cut_call.name == "t"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.sampled_from(['<tool_call>', '</tool_call>', '{"name": "t", "arguments": ', '{', '}',
                     '[', ']', '"', ':', ',', HUGE_INTEGER, "1e999", "-", "\\u", "\udc80",
                     '<|python_tag|>', ';']),
    st.text(max_size=6)), max_size=30).map("".join))
def test_any_text_parses_without_raising(text: str) -> None:
    for name in ("auto", "hermes", "llama3_json"):
        for cut in (False, True):
            parsed = make_tool_parser(name).parse(text, cut=cut)
            for call in parsed.tool_calls:
                json.loads(call.arguments)
