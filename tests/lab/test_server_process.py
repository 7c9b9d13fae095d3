"""`continuum serve` as a subprocess: memory and descendants read from `/proc`, `/metrics`
parsed, the host and port owned by the handle, and a server that cannot start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lab.server_process import (
    ServerProcess,
    ServerSpec,
    descendant_pids,
    parse_prometheus,
    read_cpu_s,
    read_rss_mib,
)


def test_rss_of_a_process_and_of_a_missing_one(tmp_path: Path) -> None:
    assert 1.0 < (read_rss_mib(os.getpid()) or 0.0) < 100_000.0
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text("Name:\tx\nVmPeak:\t 9 kB\nVmRSS:\t  3072 kB\n")
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "status").write_text("Name:\tzombie\nState:\tZ\n")
    assert read_rss_mib(42, tmp_path) == 3.0
    assert read_rss_mib(43, tmp_path) is None  # a zombie has no memory line
    assert read_rss_mib(44, tmp_path) is None


def test_cpu_of_a_process_with_an_odd_name_and_of_a_missing_one(tmp_path: Path) -> None:
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    (tmp_path / "42").mkdir()
    fields = ["S", "1", "42", "42", "0", "-1", "0", "0", "0", "0", "0",
              str(3 * ticks_per_s), str(ticks_per_s), "0", "0"]
    (tmp_path / "42" / "stat").write_text(f"42 (a) b (c) {' '.join(fields)}\n")
    assert read_cpu_s(42, tmp_path) == (3.0, 1.0)
    assert read_cpu_s(43, tmp_path) is None
    user_s, system_s = read_cpu_s(os.getpid()) or (-1.0, -1.0)
    assert user_s > 0 and system_s >= 0


def test_descendants_are_found_through_odd_command_names(tmp_path: Path) -> None:
    parents = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1}
    for pid, parent in parents.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (odd) name (x) S {parent} 1 1 0\n")
    (tmp_path / "self").mkdir()
    assert descendant_pids(10, tmp_path) == [11, 13, 12]
    assert descendant_pids(20, tmp_path) == []


def test_prometheus_samples_are_summed_over_labels() -> None:
    text = ("# HELP continuum:num_pins Live pins.\n# TYPE continuum:num_pins gauge\n"
            'continuum:num_pins{model_name="tiny"} 2.0\n'
            'continuum:pins_released_total{model_name="tiny",reason="reused"} 3.0\n'
            'continuum:pins_released_total{model_name="tiny",reason="expired"} 4.0\n'
            "plain_metric 1e3\nnot a sample\n")
    assert parse_prometheus(text) == {"continuum:num_pins": 2.0,
                                      "continuum:pins_released_total": 7.0,
                                      "plain_metric": 1000.0}


def test_server_spec_owns_host_and_port() -> None:
    with pytest.raises(ValueError, match="--port"):
        ServerSpec(serve_args=("--port", "8000"))
    with pytest.raises(ValueError, match="--host"):
        ServerSpec(serve_args=("--host=0.0.0.0",))


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    spec = ServerSpec(serve_args=("--max-model-len", "999999", "--num-kv-blocks", "4"))
    with pytest.raises(RuntimeError, match="exited") as error:
        ServerProcess(spec, tmp_path / "serve.log").start()
    assert "cannot start" in str(error.value)
