"""Deadlines and the reaper's verdicts, at chosen instants."""

from __future__ import annotations

import pytest

from stoker.core.deadlines import JobClock, ReapPolicy, Verdict, deadline_for, decide

POLICY = ReapPolicy(redrive_after_s=30.0, max_redrives=2, batch_timeout_s=60.0, recheck_s=5.0)


def test_preprocessing_keeps_the_inference_reserve_back() -> None:
    d = deadline_for(1000.0, deadline_ms=60_000, infer_reserve_ms=5_000)
    assert d.at == 1060.0
    assert d.preprocess_by == 1055.0


def test_the_reserve_never_takes_more_than_half_the_deadline() -> None:
    d = deadline_for(1000.0, deadline_ms=2_000, infer_reserve_ms=5_000)
    assert d.at == 1002.0
    assert d.preprocess_by == 1001.0


def _clock(**fields: float | int | str | None) -> JobClock:
    base: dict[str, float | int | str | None] = {"status": "preprocessing", "deadline": 100.0, "preprocess_by": 90.0}
    return JobClock(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [None, "succeeded", "degraded", "failed"])
def test_finished_or_vanished_jobs_are_forgotten(status: str | None) -> None:
    assert decide(_clock(status=status), 500.0, POLICY).action == "forget"


def test_preprocessing_waits_for_its_budget_then_is_cut_off() -> None:
    assert decide(_clock(), 50.0, POLICY).action == "wait"
    assert decide(_clock(), 50.0, POLICY).next_at == 90.0
    verdict = decide(_clock(), 90.0, POLICY)
    assert verdict.action == "cutoff"
    assert verdict.next_at == 95.0  # looked at again in case the hand-over did not happen


def test_a_job_still_preprocessing_at_its_deadline_expires() -> None:
    assert decide(_clock(), 100.0, POLICY).action == "expire"


def test_a_job_waiting_for_the_model_expires_at_its_deadline() -> None:
    waiting = _clock(status="inferring", preprocessed=80.0)
    assert decide(waiting, 99.0, POLICY).action == "wait"
    assert decide(waiting, 100.0, POLICY).action == "expire"


def test_a_job_that_never_started_is_redriven_a_bounded_number_of_times() -> None:
    clock = _clock(status="inferring", preprocessed=0.0, deadline=1000.0, preprocess_by=900.0)
    first = decide(clock, 29.0, POLICY)
    assert (first.action, first.next_at) == ("wait", 30.0)
    assert decide(clock, 30.0, POLICY).action == "redrive"
    again = _clock(status="inferring", preprocessed=0.0, deadline=1000.0, preprocess_by=900.0, redrives=1)
    assert decide(again, 45.0, POLICY).action == "wait"
    assert decide(again, 60.0, POLICY).action == "redrive"
    spent = _clock(status="inferring", preprocessed=0.0, deadline=1000.0, preprocess_by=900.0, redrives=2)
    verdict = decide(spent, 500.0, POLICY)
    assert (verdict.action, verdict.next_at) == ("wait", 1000.0)


def test_a_batch_that_never_reports_is_abandoned() -> None:
    running = _clock(status="inferring", preprocessed=10.0, infer_start=20.0)
    assert decide(running, 105.0, POLICY).action == "wait"  # past the deadline, but on the device: let it finish
    assert decide(running, 20.0 + 60.0 + 30.0, POLICY).action == "abandon"


def test_a_job_no_stage_started_is_restarted_a_bounded_number_of_times() -> None:
    queued = _clock(status="queued", deadline=1000.0, preprocess_by=900.0, accepted=0.0)
    assert decide(queued, 10.0, POLICY) == Verdict("wait", 30.0)  # looked at again when it is due
    assert decide(queued, 30.0, POLICY) == Verdict("restart", 60.0)
    again = _clock(status="queued", deadline=1000.0, preprocess_by=900.0, accepted=0.0, redrives=1)
    assert decide(again, 45.0, POLICY) == Verdict("wait", 60.0)  # the next try waits twice as long
    spent = _clock(status="queued", deadline=1000.0, preprocess_by=900.0, accepted=0.0, redrives=2)
    assert decide(spent, 500.0, POLICY) == Verdict("wait", 900.0)  # then only the cut-off is left
    started = _clock(status="preprocessing", deadline=1000.0, preprocess_by=900.0, accepted=0.0, started=400.0)
    # A stage has it: not sent again before its messages could have come back (visibility timeout 300 + 30).
    assert decide(started, 500.0, POLICY) == Verdict("wait", 730.0)


#: The reaper's patience with a started job: the visibility timeout (10) plus redrive_after_s (30) per try.
STALL = ReapPolicy(redrive_after_s=30.0, max_redrives=2, batch_timeout_s=60.0, recheck_s=5.0, visibility_timeout_s=10.0)


def _started(**fields: float | int | str | None) -> JobClock:
    """A job a stage started at 0 (accepted just before), with a long budget."""
    base = {"deadline": 1000.0, "preprocess_by": 900.0, "accepted": -1.0, "started": 0.0}
    return _clock(**{**base, **fields})


def test_a_started_job_that_stopped_moving_is_restarted_past_the_visibility_timeout() -> None:
    assert decide(_started(), 39.0, STALL) == Verdict("wait", 40.0)  # any live message may still come back
    assert decide(_started(), 40.0, STALL) == Verdict("restart", 70.0)


def test_a_started_job_restarts_from_its_last_progress() -> None:
    moved = _started(progressed=25.0)  # a stage wrote a record at 25
    assert decide(moved, 40.0, STALL) == Verdict("wait", 65.0)
    assert decide(moved, 65.0, STALL).action == "restart"


def test_a_started_job_is_restarted_a_bounded_number_of_times() -> None:
    again = _started(redrives=1)
    assert decide(again, 60.0, STALL) == Verdict("wait", 80.0)  # the next try waits twice as long
    assert decide(again, 80.0, STALL).action == "restart"
    spent = _started(redrives=2)
    assert decide(spent, 500.0, STALL) == Verdict("wait", 900.0)  # then only the cut-off is left


def test_a_started_job_is_cut_off_not_restarted_once_its_budget_is_spent() -> None:
    assert decide(_started(preprocess_by=30.0), 35.0, STALL).action == "cutoff"
    assert decide(_started(preprocess_by=35.0), 20.0, STALL) == Verdict("wait", 35.0)


def test_a_job_handed_to_inference_is_never_restarted() -> None:
    handed = _started(status="inferring", preprocessed=5.0, redrives=2)
    assert decide(handed, 500.0, STALL) == Verdict("wait", 1000.0)


def test_the_last_progress_is_the_latest_of_accepted_started_and_written() -> None:
    assert _started(progressed=7.0).last_progress == 7.0
    assert _started().last_progress == 0.0
    assert JobClock(status="queued", deadline=1.0, preprocess_by=1.0).last_progress is None
