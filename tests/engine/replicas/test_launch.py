"""`continuum serve --replicas N` refuses bad settings before it starts Ray."""

from __future__ import annotations

import logging

import pytest

from engine.cli import main as cli_main


@pytest.mark.parametrize(("flags", "message"), [
    (["--replicas", "2", "--port", "0"], "needs a fixed --port"),
    (["--replicas", "0", "--port", "8123"], "num_replicas must be >= 1"),
    (["--replicas", "2", "--port", "8123", "--replica-cpus", "-1"], "must be >= 0"),
    (["--replicas", "2", "--port", "8123", "--max-model-len", "0"], "max_model_len"),
    (["--replicas", "2", "--port", "8123", "--route-load-factor", "0.5"], "load_factor"),
    (["--replicas", "2", "--port", "8123", "--route-min-move-load", "-1"], "min_move_load"),
])
def test_bad_settings_exit_with_status_2_and_say_why(
        flags: list[str], message: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert cli_main(["serve", *flags]) == 2
    assert message in caplog.text


def test_an_unknown_router_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--replicas", "2", "--router", "sticky"])
    assert exit_info.value.code == 2
