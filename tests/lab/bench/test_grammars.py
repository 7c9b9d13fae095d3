"""`python -m lab grammars --attack rejected`: hostile patterns of growing size, and a quick
run against a real `continuum serve` subprocess whose engine core refuses each with a 400 and
keeps its memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench.grammars import GrammarAttackSettings, schema_chat_body
from lab.cli import main as cli_main


def test_the_rejected_attacks_defaults_are_thirty_patterns_from_500_to_1950() -> None:
    settings = GrammarAttackSettings()
    repeats = [settings.rejected_repeat_base + index * settings.rejected_repeat_step
               for index in range(settings.rejected_grammars)]
    assert repeats[0] == 500 and repeats[-1] == 1950 and len(repeats) == 30
    body = schema_chat_body("tiny", "^(a{1000}){500}$")
    assert body["response_format"]["json_schema"]["schema"] == {
        "type": "string", "pattern": "^(a{1000}){500}$"}


@pytest.mark.parametrize("args", [["--rejected-grammars", "0"], ["--settle-s", "-1"],
                                  ["--max-settled-ratio", "0.5"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["grammars", "--attack", "rejected", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_quick_run_refuses_every_hostile_grammar_and_keeps_the_cores_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    report = tmp_path / "grammars.json"
    assert cli_main(["grammars", "--attack", "rejected", "--quick",
                     "--json", str(report)]) == 0
    document = json.loads(report.read_text())
    assert document["passed"] and document["settings"]["rejected_grammars"] == 4
    figures = document["figures"]
    assert figures["rejected: statuses, baseline / attack"] == "200: 4 / 400: 4"
    assert "the grammar is too large: compiling it takes more than the limit of 64 MiB" in (
        figures["rejected: an attacker's answer"])
    assert "rejected: core RSS 3 s after the attack, MiB" in figures
    assert "PASS" in capsys.readouterr().out
