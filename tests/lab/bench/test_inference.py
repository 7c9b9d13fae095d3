"""`python -m lab inference`: its flags, a lookup's cost among many turns of one prompt, and
a short run against a real `continuum serve` subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.scheduler.job_inference import MAX_TURNS_PER_KEY
from lab.bench.inference import lookup_ms
from lab.cli import main as cli_main


@pytest.mark.parametrize("args", [["--turns", "0"], ["--attack-s", "0"],
                                  ["--max-lookup-ms", "-1"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["inference", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_lookup_among_many_turns_of_one_prompt_checks_a_bounded_number() -> None:
    # Timings are figures, not checks: 2,000 turns of one prompt cost no more than the few
    # the table keeps under it, within a wide margin for a busy machine.
    few, many = lookup_ms(MAX_TURNS_PER_KEY), lookup_ms(2_000)
    assert many < 10 * few + 1.0


def test_a_short_inference_attack_is_measured(tmp_path: Path) -> None:
    out = tmp_path / "inference.json"
    cli_main(["inference", "--turns", "64", "--concurrency", "4", "--baseline-s",
              "3", "--attack-s", "3", "--max-ratio", "1000", "--max-lookup-ms", "1000",
              "--json", str(out)])
    report = json.loads(out.read_text())
    filed, baseline, attack = report["figures"][
        "inference: attacker's statuses, filing / baseline / attack"].split(" / ")
    assert filed == "200: 64" and baseline.startswith("200: ") and attack.startswith("200: ")
    assert report["passed"], report["checks"]
