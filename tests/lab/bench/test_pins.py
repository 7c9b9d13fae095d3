"""`python -m lab pins`: its flags, and a short run against a real `continuum serve`
subprocess, whose pinned blocks stay within the attacker's share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.cli import main as cli_main


@pytest.mark.parametrize("args", [["--jobs", "0"], ["--attack-s", "0"], ["--tool-s", "-1"],
                                  ["--runs", "0"], ["--grow-tokens", "0"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["pins", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_short_pinning_attack_is_measured_and_capped(tmp_path: Path) -> None:
    out = tmp_path / "pins.json"
    cli_main(["pins", "--attack", "pins", "--jobs", "3", "--job-tokens", "800",
              "--tool-s", "0.5", "--victim-prompt-tokens", "300", "--baseline-s", "3",
              "--attack-s", "5", "--max-ratio", "1000", "--json", str(out)])
    report = json.loads(out.read_text())
    figures = report["figures"]
    statuses = dict(item.split(": ") for item in figures["pins: attacker's statuses"].split(", "))
    assert int(statuses["200"]) > 0 and set(statuses) == {"200"}
    baseline, attack = figures["pins: victim requests baseline / attack"].split(" / ")
    assert int(baseline) > 0 and int(attack) > 0
    _median, most = figures["pins: pinned blocks in the attack, median / most (pool 1024)"
                           ].split(" / ")
    assert 0 < int(most) <= 512  # the attacker pinned, within its share
    assert report["passed"], report["checks"]
