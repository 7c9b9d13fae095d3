"""The server the reduced load and soak runs share (`test_load.py`, `test_soak.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab.server_process import ServerProcess, ServerSpec, read_rss_mib

SERVE_ARGS = ("--num-kv-blocks", "256", "--max-model-len", "1024",
              "--policy-option", "estimator=fixed-2s",
              "--debug-check-invariants", "--no-job-inference")  # as bench load's defaults


@pytest.fixture(scope="package")
def server() -> Iterator[ServerProcess]:
    """One server for the reduced load and soak runs, its core checking invariants after
    every step. Stopping it must end the engine core too, cleanly."""
    running = ServerProcess(ServerSpec(serve_args=SERVE_ARGS)).start()
    pids = running.process_ids()
    assert len(pids) >= 2  # the engine core is a child process
    yield running
    assert running.stop() == 0 and not running.is_running()
    assert all(read_rss_mib(pid) is None for pid in pids)
