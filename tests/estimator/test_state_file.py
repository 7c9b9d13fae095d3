"""State files: atomic saves, reads bounded in size and kind, cold starts on anything bad."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from estimator.eq2 import Eq2Estimator
from estimator.state_file import (
    DEFAULT_MAX_STATE_BYTES,
    load_state_or_cold_start,
    read_state,
    save_state,
)
from estimator.ttl_estimator import ConstantTTLEstimator, ToolCall


def learned_estimator() -> Eq2Estimator:
    estimator = Eq2Estimator()
    estimator.observe_tool_call(ToolCall("j", "cat", 0.0, 100, 0))
    estimator.observe_next_turn("j", 0.25)
    estimator.observe_queueing_delay(1.5)
    return estimator


def test_a_saved_state_loads_and_no_temporary_file_is_left(tmp_path) -> None:
    path = tmp_path / "state.json"
    saved = learned_estimator()
    assert save_state(saved, path) is True
    assert read_state(path) == saved.state()
    restored = Eq2Estimator()
    assert load_state_or_cold_start(restored, path) is True
    assert restored.state() == saved.state()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_an_estimator_without_state_writes_nothing(tmp_path) -> None:
    path = tmp_path / "state.json"
    assert save_state(ConstantTTLEstimator(1.0), path) is False
    assert not path.exists()
    with pytest.raises(ValueError, match="does not exist"):
        save_state(learned_estimator(), tmp_path / "missing-dir" / "state.json")


def test_a_missing_file_is_a_quiet_cold_start(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="estimator.state_file"):
        assert load_state_or_cold_start(Eq2Estimator(), tmp_path / "none.json") is False
    assert caplog.text == ""


def test_an_oversized_file_is_refused_before_it_is_parsed(tmp_path, caplog) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(learned_estimator().state()))
    size = path.stat().st_size
    assert read_state(path, max_bytes=size) is not None
    with pytest.raises(ValueError, match="larger than"):
        read_state(path, max_bytes=size - 1)
    estimator = Eq2Estimator()
    with caplog.at_level(logging.WARNING, logger="estimator.state_file"):
        assert load_state_or_cold_start(estimator, path, max_bytes=size - 1) is False
    assert "larger than" in caplog.text and "starting cold" in caplog.text
    assert estimator.state() == Eq2Estimator().state()
    assert DEFAULT_MAX_STATE_BYTES == 64 * 1024 * 1024


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_an_endless_device_starts_cold_at_once(tmp_path, caplog) -> None:
    link = tmp_path / "state.json"
    link.symlink_to("/dev/zero")
    for path in (Path("/dev/zero"), link):
        started_s = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="estimator.state_file"):
            assert load_state_or_cold_start(Eq2Estimator(), path) is False
        assert time.monotonic() - started_s < 1.0  # nothing was read
        assert "not a regular file" in caplog.text


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_without_a_writer_does_not_block(tmp_path) -> None:
    path = tmp_path / "state.fifo"
    os.mkfifo(path)
    with pytest.raises(ValueError, match="not a regular file"):
        read_state(path)


def test_directories_and_non_json_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a regular file"):
        read_state(tmp_path)
    path = tmp_path / "state.json"
    path.write_bytes(b"\xff\xfe not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_state(path)
