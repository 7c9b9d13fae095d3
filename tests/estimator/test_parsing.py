"""Tool-call parsing of agent turns: every format, their precedence, garbage, and fuzzing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tool_calls import AutoToolParser, HermesToolParser
from estimator.parsing import MAX_KEY_NAMES, ParsedToolCalls, parse_tool_calls, tool_key


def openai_call(name: str, arguments: str = "{}") -> dict[str, object]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def fenced(language: str, body: str) -> str:
    return f"```{language}\n{body}\n```"


def parsed(text: str | None, **kwargs: object) -> tuple[tuple[str, ...], str] | None:
    result = parse_tool_calls(text, **kwargs)  # type: ignore[arg-type]
    return None if result is None else (result.names, result.source)


HERMES_CASES = [
    ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', ("search",)),
    ('Let me look.\n<tool_call>\n  {"name": "get_weather",\n "arguments": {}}\n</tool_call>\n',
     ("get_weather",)),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "fetch", "arguments": {}}</tool_call>', ("search", "fetch")),
    ('<tool_call>{"name": "search"}</tool_call><tool_call>{"name": "search"}</tool_call>',
     ("search", "search")),
    ('<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "cut", "arguments": {}}',
     ("a", "cut")),
    ('<tool_call>{"name": "cut", "arguments": {"q": 1}}', ("cut",)),
    ('<tool_call>{"name": "  padded  "}</tool_call>', ("padded",)),
]

# Blocks the server does not return as calls (one block does not parse): no calls either.
HERMES_REFUSED = [
    '<tool_call>not json</tool_call><tool_call>{"name": "ok"}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call>'
    '<tool_call>{"name": "ok"}</tool_call>',
    '<tool_call>{"name": "lost"<tool_call>{"name": "kept"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
]

JSON_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', ("get_weather",)),
    ('  \n{"name": "search", "parameters": {}}\n', ("search",)),
    (fenced("json", '{"name": "search", "parameters": {"q": "x"}}'), ("search",)),
    (fenced("", '{"name": "search"}'), ("search",)),
    ('[{"name": "search", "parameters": {}}, {"name": "fetch", "parameters": {}}]',
     ("search", "fetch")),
    ('[{"name": "search"}, {"name": "search"}]', ("search", "search")),
    ('{"name": "search", "parameters": {}}; {"name": "fetch", "parameters": {}}',
     ("search", "fetch")),
    ('<|python_tag|>{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}',
     ("a", "b")),
]

CALL_CASES = [
    ('get_weather(city="Paris")', ("get_weather",)),
    ("math.sqrt(x=4)", ("math.sqrt",)),
    ("  noargs()  ", ("noargs",)),
    ('[search(q="x"), fetch(url="y")]', ("search", "fetch")),
    ('[search(q="a"), search(q="b")]', ("search", "search")),
    ('search(q="(unbalanced in a string")\nfetch(url=\'y)\')', ("search", "fetch")),
    ('a(x=[1, {"k": (2, 3)}]); b(y="\\"quoted\\"")', ("a", "b")),
]

BASH_CASES = [
    (fenced("bash", "ls -la"), ("ls",)),
    ("THOUGHT: I should look for the bug.\n\n" + fenced("bash", "cd /repo && grep -rn foo .")
     + "\nThat should find it.", ("grep",)),
    (fenced("bash", "cd a && cd b && python x.py"), ("python",)),
    (fenced("bash", "cd a; python3 -m pytest -q"), ("python3",)),
    (fenced("bash", 'cd "my dir" && FOO=1 BAR="x y" make test'), ("make",)),
    (fenced("bash", "/usr/bin/grep -n x file"), ("grep",)),
    (fenced("sh", "cat <<'EOF' > a.py\nprint(1)\nEOF"), ("cat",)),
    (fenced("shell", "sudo timeout 30 pytest"), ("pytest",)),
    (fenced("bash", "# inspect first\ncd /repo\nsed -n 1,20p a.py"), ("sed",)),
    (fenced("bash", "export PAGER=cat && git diff"), ("git",)),
    ("Look at this:\n" + fenced("python", "x = 1") + "\nnow\n" + fenced("bash", "nl a.py"),
     ("nl",)),
    (fenced("bash", "cd /repo"), ("cd",)),
]


@pytest.mark.parametrize(("text", "names"), HERMES_CASES)
def test_hermes(text: str, names: tuple[str, ...]) -> None:
    assert parsed(text) == (names, "hermes")


@pytest.mark.parametrize("text", HERMES_REFUSED)
def test_hermes_blocks_the_server_refuses_are_no_calls(text: str) -> None:
    assert HermesToolParser().parse(text).tool_calls == ()
    assert parsed(text) is None


@pytest.mark.parametrize("text", [text for text, _ in HERMES_CASES + JSON_CASES] + HERMES_REFUSED)
def test_hermes_and_llama3_text_is_read_as_the_server_reads_it(text: str) -> None:
    unfenced = text.strip().removeprefix("<|python_tag|>").removeprefix("```json")
    unfenced = unfenced.removeprefix("```").removesuffix("```")
    if unfenced.lstrip().startswith("["):
        unfenced = ";".join(json.dumps(call) for call in json.loads(unfenced))
    server = tuple(call.name.strip() for call in AutoToolParser().parse(unfenced).tool_calls)
    assert (parsed(text) or ((), None))[0] == server


@pytest.mark.parametrize(("text", "names"), JSON_CASES)
def test_bare_json(text: str, names: tuple[str, ...]) -> None:
    assert parsed(text) == (names, "json")


@pytest.mark.parametrize(("text", "names"), CALL_CASES)
def test_call_syntax(text: str, names: tuple[str, ...]) -> None:
    assert parsed(text) == (names, "call")


@pytest.mark.parametrize(("text", "names"), BASH_CASES)
def test_bash_block(text: str, names: tuple[str, ...]) -> None:
    assert parsed(text) == (names, "bash")


@pytest.mark.parametrize(
    ("text", "client", "names"),
    [
        ("", "search", ("search",)),
        (None, "  fetch ", ("fetch",)),
        ('<tool_call>{"name": "other"}</tool_call>', "search", ("search",)),
    ],
)
def test_client_name(text: str | None, client: str, names: tuple[str, ...]) -> None:
    assert parsed(text, client_tool_name=client) == (names, "client")


@pytest.mark.parametrize(
    ("tool_calls", "names"),
    [
        ([openai_call("search")], ("search",)),
        ([openai_call("search"), openai_call("fetch")], ("search", "fetch")),
        ([{"name": "search"}, {"name": "search"}], ("search", "search")),
        ([openai_call(""), {"function": None, "name": "ok"}, 5, "str"], ("ok",)),
    ],
)
def test_openai_argument(tool_calls: list[object], names: tuple[str, ...]) -> None:
    assert parsed(None, tool_calls=tool_calls) == (names, "openai")


@pytest.mark.parametrize(
    ("message", "names"),
    [
        ({"role": "assistant", "content": None, "tool_calls": [openai_call("search")]},
         ("search",)),
        ({"tool_calls": [openai_call("search"), openai_call("fetch", '{"url": "y"}')]},
         ("search", "fetch")),
        ({"tool_calls": [{"name": "a"}, {"name": "b"}, {"name": "a"}]}, ("a", "b", "a")),
    ],
)
def test_openai_message_text(message: dict[str, object], names: tuple[str, ...]) -> None:
    assert parsed(json.dumps(message, indent=2)) == (names, "openai")


@pytest.mark.parametrize(
    ("text", "kwargs", "expected"),
    [
        # The client's name beats everything in the text and in `tool_calls`.
        (fenced("bash", "ls"), {"client_tool_name": "x", "tool_calls": [openai_call("y")]},
         (("x",), "client")),
        # A blank client name is no name.
        ("noargs()", {"client_tool_name": "   "}, (("noargs",), "call")),
        # The `tool_calls` argument beats the text.
        ('<tool_call>{"name": "h"}</tool_call>', {"tool_calls": [openai_call("o")]},
         (("o",), "openai")),
        # An empty `tool_calls` falls through to the text.
        ('<tool_call>{"name": "h"}</tool_call>', {"tool_calls": []}, (("h",), "hermes")),
        # A message with `tool_calls` beats the Hermes blocks in its content.
        (json.dumps({"content": '<tool_call>{"name": "h"}</tool_call>',
                     "tool_calls": [openai_call("o")]}), {}, (("o",), "openai")),
        # Hermes beats a bash block.
        ('<tool_call>{"name": "h"}</tool_call>\n' + fenced("bash", "ls"), {},
         (("h",), "hermes")),
        # A message with `tool_calls` beats its own `name` (bare JSON).
        (json.dumps({"name": "j", "tool_calls": [{"name": "o"}]}), {}, (("o",), "openai")),
    ],
)
def test_precedence(
    text: str, kwargs: dict[str, object], expected: tuple[tuple[str, ...], str]
) -> None:
    assert parsed(text, **kwargs) == expected


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "   \n\t ",
        "I looked at the file and everything seems fine.",
        "Let me call get_weather(city='Paris') to check.",
        "get_weather(city='Paris') is what I will call",
        "get_weather(city='Paris'",
        "get_weather(city='Paris)",
        "search(q=1))",
        "[1, 2, 3]",
        "{not json",
        '{"name": 5}',
        '{"name": "   "}',
        '{"tool": "search"}',
        "[]",
        "{}",
        '{"tool_calls": []}',
        '{"tool_calls": "search"}',
        "<tool_call>not json</tool_call>",
        "<tool_call></tool_call>",
        '<tool_call>{"name": "x"</tool_call>',
        "<tool_call>",
        fenced("bash", "ls") + "\n" + fenced("bash", "pwd"),
        fenced("bash", "ls") + "\n" + fenced("sh", "pwd"),
        fenced("python", "print(1)"),
        "```bash\nls -la",
        fenced("bash", ""),
        fenced("bash", "cd a && "),
        fenced("json", '{"name": "x"}') + "\n" + fenced("json", '{"name": "y"}'),
        '{"name": "' + "n" * 129 + '"}',
        "n" * 129 + "()",
    ],
)
def test_garbage_is_none(text: str | None) -> None:
    assert parse_tool_calls(text) is None
    assert tool_key(text) is None


def test_long_names_are_ignored_per_call() -> None:
    text = json.dumps([{"name": "n" * 129}, {"name": "ok"}, {"name": "m" * 128}])
    assert parsed(text) == (("ok", "m" * 128), "json")
    assert parse_tool_calls("", client_tool_name="c" * 129) is None


@pytest.mark.parametrize(
    ("names", "key"),
    [(("search",), "search"), (("search", "fetch"), "search+fetch"),
     (("search", "search"), "search+search")],
)
def test_key_joins_names_in_order(names: tuple[str, ...], key: str) -> None:
    assert ParsedToolCalls(names, "json").key == key


def test_tool_key() -> None:
    assert tool_key('[search(q="x"), fetch(url="y")]') == "search+fetch"
    assert tool_key(fenced("bash", "cd x && grep -r y")) == "grep"
    assert tool_key("prose", client_tool_name="search") == "search"
    assert tool_key("prose") is None


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" * 20_000,
        "<tool_call>{" * 20_000 + "</tool_call>",
        "[" * 100_000,
        "{" * 100_000,
        '{"tool_calls": ' + "[" * 100_000,
        "a(" * 50_000,
        "a()" * 50_000,
        "'" * 100_000,
        "```bash\n" + "cd a && " * 20_000 + "ls\n```",
        "```bash\n" + "A=" + '"' * 50_000 + "\n```",
        "```\n" * 50_000,
        " " * 100_000 + "x",
    ],
)
def test_pathological_inputs_do_not_raise(text: str) -> None:
    parse_tool_calls(text)


FRAGMENTS = st.sampled_from([
    "<tool_call>", "</tool_call>", "```", "```bash\n", "```json\n", "\n", " ", "{", "}", "[",
    "]", "(", ")", '"', "'", "\\", ",", ";", "&&", "cd ", "=", '"name": ', '"tool_calls": ',
    "search", "/usr/bin/", "sudo ", "timeout 5 ", "#", '{"name": "x"}',
])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(FRAGMENTS, st.text(max_size=8)), max_size=40).map("".join))
def test_never_raises_on_structured_noise(text: str) -> None:
    result = parse_tool_calls(text)
    assert result is None or (result.names and all(0 < len(n) <= 128 for n in result.names))


@settings(max_examples=300, deadline=None)
@given(st.text(), st.one_of(st.none(), st.text()))
def test_never_raises_on_any_text(text: str, client: str | None) -> None:
    result = parse_tool_calls(text, client_tool_name=client)
    assert result is None or result.key == "+".join(result.names)


@pytest.mark.parametrize("text, expected", [
    ('{"name": "lookup", "parameters": {}}<|eot_id|>', "lookup"),
    ('<|python_tag|>{"name": "web_search", "parameters": {"q": "x"}}<|eom_id|>', "web_search"),
    ('get_weather(city="Paris")</s>', "get_weather"),
    ('<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call><|im_end|>', "bash"),
])
def test_control_tokens_a_decoder_keeps_do_not_hide_the_call(text, expected) -> None:
    assert tool_key(text) == expected


def test_keys_of_runaway_outputs_are_bounded() -> None:
    parsed = parse_tool_calls("f()" * 5000)
    assert parsed is not None and len(parsed.names) == 5000
    assert parsed.key == "+".join(["f"] * MAX_KEY_NAMES)


def test_deep_json_that_the_encoder_cannot_rewrite_reads_as_no_call_and_never_raises():
    deep = "[" * 995 + "]" * 995
    for text in (f'{{"name": "a", "parameters": {{"x": {deep}}}}}',
                 f'[{{"name": "a", "parameters": {{"x": {deep}}}}}]'):
        parse_tool_calls(text)


@pytest.mark.parametrize("text", [
    '{"type": "function", "function": {"name": "lookup"}}',  # OpenAI's shape, bare
    '[{"type": "function", "function": {"name": "lookup"}}]',
    '{"name": "f", "parameters": null}',
    '[{"name": "f"}, 3]',
])
def test_json_the_server_would_not_return_as_calls_is_no_call(text: str) -> None:
    assert AutoToolParser().parse(text).tool_calls == ()
    assert parsed(text) is None
