"""`python -m lab bodies`: its flags, and a short run against a real `continuum serve`
subprocess whose attackers run in a child process of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.cli import main as cli_main


@pytest.mark.parametrize("args", [["--attackers", "0"], ["--attack-s", "0"],
                                  ["--max-latency-ratio", "-1"]])
def test_bad_flags_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bodies", *args]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_a_short_chats_attack_is_answered_and_measured(tmp_path: Path) -> None:
    out = tmp_path / "bodies.json"
    cli_main(["bodies", "--attack", "chats", "--attackers", "2",
              "--chat-messages", "300", "--message-chars", "400", "--baseline-s", "1.5",
              "--attack-s", "2", "--victim-tokens", "8", "--max-latency-ratio", "1000",
              "--json", str(out)])
    report = json.loads(out.read_text())
    figures = report["figures"]
    # Each 120 KB chat is longer than the context: the attackers' child process got 400s.
    statuses = dict(item.split(": ") for item in figures["chats: attackers' statuses"].split(", "))
    assert set(statuses) == {"400"} and int(statuses["400"]) >= 2
    baseline, attack = figures["chats: victim tokens baseline / attack"].split(" / ")
    assert int(baseline) > 0 and int(attack) > 0
    assert figures["chats: victim failures"] == 0
    baseline_percent, attack_percent = figures[
        "chats: server process CPU, % of a core (baseline / attack)"].split(" / ")
    assert float(baseline_percent) > 0 and float(attack_percent) > 0
    user_s, system_s = figures["chats: server process CPU in the attack, s (user / system)"
                               ].split(" / ")
    assert float(user_s) > 0 and float(system_s) >= 0
    assert report["checks"][0] == {"name": "chats: the server survived", "passed": True,
                                   "detail": ""}


def test_a_short_held_attack_holds_one_body_and_is_refused_the_rest(tmp_path: Path) -> None:
    """Each tenant may hold one 8 MB body: of six held connections one is held to the end,
    the others (and their reopenings) get 429."""
    out = tmp_path / "held.json"
    serve_args = ("--num-kv-blocks 512 --max-model-len 1024 --no-job-inference "
                  "--tenant victim:victim-key --tenant attacker:attacker-key "
                  "--max-request-body-bytes 8500000 --max-body-bytes-in-flight 17000000")
    cli_main(["bodies", "--attack", "held", "--held-bodies", "6",
              "--held-body-bytes", "8000000", "--reopen-s", "0.5", "--baseline-s", "1.5",
              "--attack-s", "3", "--victim-tokens", "8", "--max-latency-ratio", "1000",
              "--serve-args", serve_args, "--json", str(out)])
    report = json.loads(out.read_text())
    figures = report["figures"]
    statuses = dict(item.split(": ") for item in figures["held: attackers' statuses"].split(", "))
    assert statuses["held to the end"] == "1"
    assert int(statuses["429"]) >= 5
    assert isinstance(figures["held: server process RSS peak growth in the attack, MiB"], float)
    assert figures["held: victim failures"] == 0
    assert report["checks"][0]["passed"]


def test_a_short_retrievals_attack_fetches_the_stored_response(tmp_path: Path) -> None:
    out = tmp_path / "retrievals.json"
    cli_main(["bodies", "--attack", "retrievals", "--attackers", "2",
              "--retrieval-tokens", "200", "--baseline-s", "1.5", "--attack-s", "2",
              "--victim-tokens", "8", "--max-latency-ratio", "1000", "--json", str(out)])
    figures = json.loads(out.read_text())["figures"]
    # 200 tokens with 20 alternatives each: about 0.3 MB of JSON.
    assert 0.1 <= figures["retrievals: stored response, MB"] <= 1.0
    statuses = dict(item.split(": ")
                    for item in figures["retrievals: attackers' statuses"].split(", "))
    assert set(statuses) == {"200"} and int(statuses["200"]) >= 2
    assert figures["retrievals: victim failures"] == 0


def test_a_short_logprobs_attack_is_refused_by_the_bound(tmp_path: Path) -> None:
    """2 prompts x n 2 x 300 echoed tokens x 21 values, over a bound of 10,000: each
    attacker's request is a 400."""
    out = tmp_path / "logprobs.json"
    serve_args = ("--num-kv-blocks 512 --max-model-len 1024 --no-job-inference "
                  "--tenant victim:victim-key --tenant attacker:attacker-key "
                  "--max-response-logprobs 10000")
    cli_main(["bodies", "--attack", "logprobs", "--attackers", "2",
              "--echo-prompts", "2", "--echo-prompt-tokens", "300", "--echo-n", "2",
              "--baseline-s", "1.5", "--attack-s", "2", "--victim-tokens", "8",
              "--max-latency-ratio", "1000", "--serve-args", serve_args, "--json", str(out)])
    report = json.loads(out.read_text())
    statuses = dict(item.split(": ")
                    for item in report["figures"]["logprobs: attackers' statuses"].split(", "))
    assert set(statuses) == {"400"} and int(statuses["400"]) >= 2
    assert report["figures"]["logprobs: victim failures"] == 0
    assert report["checks"][0]["passed"]
