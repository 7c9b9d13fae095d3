"""`continuum bench flood`: its flags, and a short run against a real `continuum serve`
subprocess whose attacker runs in a child process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main as cli_main


@pytest.mark.parametrize("args", [["--flood-requests", "0"], ["--attack-s", "0"],
                                  ["--wave-interval-s", "-1"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "flood", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_short_flood_is_answered_and_measured(tmp_path: Path) -> None:
    out = tmp_path / "flood.json"
    code = cli_main(["bench", "flood", "--flood-requests", "60", "--flood-tokens", "8",
                     "--wave", "20", "--wave-interval-s", "0.1", "--baseline-s", "1.5",
                     "--attack-s", "4", "--victim-tokens", "4", "--max-first-token-s", "1000",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    figures = report["figures"]
    statuses = dict(item.split(": ")
                    for item in figures["requests: attacker's statuses"].split(", "))
    assert sum(map(int, statuses.values())) == 60 and int(statuses["200"]) > 0
    baseline, attack = figures["requests: victim tokens baseline / attack"].split(" / ")
    assert int(baseline) > 0 and int(attack) > 0
    assert figures["requests: victim failures"] == 0
    assert code == 0 and report["passed"]
