"""`python -m lab flood`: its flags, and a short run against a real `continuum serve`
subprocess whose attacker runs in a child process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.cli import main as cli_main


@pytest.mark.parametrize("args", [["--flood-requests", "0"], ["--attack-s", "0"],
                                  ["--wave-interval-s", "-1"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["flood", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_short_flood_is_answered_and_measured(tmp_path: Path) -> None:
    out = tmp_path / "flood.json"
    code = cli_main(["flood", "--attack", "requests", "--flood-requests", "60",
                     "--flood-tokens", "8", "--wave", "20", "--wave-interval-s", "0.1",
                     "--baseline-s", "1.5",
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


def test_a_short_fanout_meets_the_tenants_cap(tmp_path: Path) -> None:
    """Calls of 4 prompts x n 2 against a cap of 8 engine requests in flight (a share of 2
    of max_num_seqs 4, 6 waiting): one call at a time is taken, the others get 429."""
    out = tmp_path / "fanout.json"
    serve_args = ("--num-kv-blocks 512 --max-model-len 1024 --no-job-inference "
                  "--tenant victim:victim-key --tenant attacker:attacker-key "
                  "--max-num-seqs 4 --max-waiting-requests-per-tenant 6")
    code = cli_main(["flood", "--attack", "fanout", "--fanout-callers", "3",
                     "--fanout-prompts", "4", "--fanout-n", "2", "--fanout-tokens", "64",
                     "--baseline-s", "1.5", "--attack-s", "3", "--victim-tokens", "4",
                     "--max-latency-ratio", "1000", "--serve-args", serve_args,
                     "--json", str(out)])
    report = json.loads(out.read_text())
    figures = report["figures"]
    baseline = _statuses(figures["fanout: attacker's statuses, baseline"])
    attack = _statuses(figures["fanout: attacker's statuses, attack"])
    assert set(baseline) <= {"200"} and attack["429"] >= 1
    peaks = figures["fanout: engine requests waiting, peak (baseline / attack)"].split(" / ")
    assert all(int(peak) <= 8 for peak in peaks)
    assert figures["fanout: victim failures"] == 0
    assert code == 0 and report["passed"]


def _statuses(text: str) -> dict[str, int]:
    """A figure's counts ("200: 3, 429: 7") by status; an empty text has none."""
    return {status: int(count) for status, count in
            (item.split(": ") for item in text.split(", ") if item)}
