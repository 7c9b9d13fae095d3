"""The documentation stays runnable: every `continuum ...` command in the README, `docs/` and
the decision records parses with the real command line; each decision record is one page with
its four sections; and no file of the repository points outside it."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from engine.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DECISIONS = sorted((REPO / "docs" / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md"))
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "docs" / "decisions").glob("*.md"))]
# The sections of a decision record, in this order, and its length in lines at most.
RECORD_SECTIONS = ("## Context", "## What was measured", "## Figures", "## Decision")
MAX_RECORD_LINES = 80
# Spelled in two parts, so that this file does not mention what it looks for.
OUTSIDE = "../" + "shared"


def _code_lines(text: str) -> list[str]:
    """Lines of fenced code blocks, backslash continuations joined, and inline code spans
    that give flags (a bare `continuum bench sim` in prose names a command, it is not one
    to run)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL)
    lines = []
    for block in blocks:
        lines += block.replace("\\\n", " ").splitlines()
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    return lines + [span for span in spans if " --" in span]


def _is_template(command: str) -> bool:
    """Whether the command shows a form rather than a command: placeholders in capitals
    (`N`, `FILE`, `KEY=VALUE`), alternatives (`a|b`), elisions, or a request for help."""
    return ("..." in command or "|" in command or "--help" in command
            or re.search(r"(^|[\s=])[A-Z][A-Z_]*(\s|$|=)", command) is not None)


def documented_commands() -> list[tuple[str, str]]:
    """(document name, command line) of each `continuum` command the documents show."""
    found = []
    for document in DOCUMENTS:
        for line in _code_lines(document.read_text()):
            command = line.split(" #", 1)[0].strip()
            match = re.match(r"(?:\.venv/bin/)?continuum (bench|serve|trace)\b", command)
            if match and not _is_template(command):
                found.append((document.name, command))
    return found


COMMANDS = documented_commands()


def test_the_documents_show_commands():
    assert len(COMMANDS) >= 15
    assert {name for name, _ in COMMANDS} >= {"operations.md", "benchmarks.md"}


@pytest.mark.parametrize(("document", "command"), COMMANDS)
def test_each_documented_command_parses(document, command):
    argv = shlex.split(command)[1:]
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"{document}: `{command}` does not parse (exit {exit_.code})")


def test_there_are_decision_records():
    assert len(DECISIONS) >= 11
    assert (REPO / "docs" / "decisions" / "README.md").is_file()


@pytest.mark.parametrize("record", DECISIONS, ids=lambda path: path.name)
def test_each_decision_record_is_one_page_with_its_four_sections(record):
    lines = record.read_text().splitlines()
    assert len(lines) <= MAX_RECORD_LINES, f"{record.name}: {len(lines)} lines"
    assert lines[0].startswith("# "), f"{record.name}: no title"
    headings = [line.strip() for line in lines if line.startswith("## ")]
    assert headings == list(RECORD_SECTIONS), f"{record.name}: sections {headings}"


def test_the_decision_index_names_every_record():
    index = (REPO / "docs" / "decisions" / "README.md").read_text()
    missing = [record.name for record in DECISIONS if f"({record.name})" not in index]
    assert missing == []


def test_no_file_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout.decode().split("\0")
    offenders = []
    for name in filter(None, tracked):
        path = REPO / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if OUTSIDE in text:
            offenders.append(name)
    assert offenders == []
