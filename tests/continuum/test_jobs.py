"""The per-job table: creation, activity order, and the idle timeout."""

from __future__ import annotations

import pytest

from continuum.jobs import JobTable


def test_jobs_idle_past_the_timeout_are_popped_unless_busy() -> None:
    table = JobTable(idle_timeout_s=10.0)
    for index, job_id in enumerate("abcd"):
        table.get_or_add(job_id, arrival_order=index, now_s=float(index))
    table.get("b").num_unfinished_turns = 1
    table.touch(table.get("a"), 5.0)  # a is active later than c
    popped = table.pop_idle(13.5, is_busy=lambda job: job.job_id == "d")
    assert [job.job_id for job in popped] == ["c"]
    assert [job.job_id for job in table] == ["b", "d", "a"]
    assert table.get("b").last_active_s == 1.0  # kept, not made active
    table.get("b").num_unfinished_turns = 0
    popped = table.pop_idle(15.1, is_busy=lambda job: False)
    assert [job.job_id for job in popped] == ["b", "d", "a"] and len(table) == 0


def test_get_or_add_keeps_the_first_arrival() -> None:
    table = JobTable(idle_timeout_s=1.0)
    first = table.get_or_add("j", arrival_order=3, now_s=1.0)
    again = table.get_or_add("j", arrival_order=9, now_s=2.0)
    assert first is again and (again.first_arrival_order, again.first_arrival_s) == (3, 1.0)
    assert table.get(None) is None and table.remove("j") is first and table.remove("j") is None


def test_the_idle_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="idle_timeout_s"):
        JobTable(idle_timeout_s=0.0)
