"""The inference watchdog, driven by a hand-moved clock."""

from __future__ import annotations

from stoker.runtime.watchdog import BatchWatchdog, RunningBatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watchdog(clock: Clock) -> tuple[BatchWatchdog, list[str], list[str]]:
    overdue: list[str] = []
    wedged: list[str] = []

    def on_overdue(batch: RunningBatch) -> None:
        overdue.extend(batch.job_ids)

    def on_wedged(batch: RunningBatch) -> None:
        wedged.append(batch.id)

    return BatchWatchdog(10.0, 5.0, on_overdue, on_wedged, clock=clock), overdue, wedged


def test_idle_and_timely_batches_are_left_alone() -> None:
    clock = Clock()
    dog, overdue, wedged = _watchdog(clock)
    assert dog.poll() == "idle"
    dog.begin("b1", ["j1", "j2"])
    clock.now = 9.9
    assert dog.poll() == "running"
    ended = dog.end()
    assert ended is not None
    assert not ended.overdue
    assert (overdue, wedged) == ([], [])


def test_an_overdue_batch_fails_its_jobs_once_then_is_judged_wedged() -> None:
    clock = Clock()
    dog, overdue, wedged = _watchdog(clock)
    dog.begin("b1", ["j1", "j2"])
    clock.now = 10.0
    assert dog.poll() == "overdue"
    clock.now = 12.0
    assert dog.poll() == "running"  # reported once
    assert overdue == ["j1", "j2"]
    clock.now = 15.0
    assert dog.poll() == "wedged"
    assert wedged == ["b1"]


def test_a_late_batch_that_returns_says_it_was_overdue() -> None:
    clock = Clock()
    dog, _, _ = _watchdog(clock)
    dog.begin("b1", ["j1"])
    clock.now = 11.0
    dog.poll()
    ended = dog.end()
    assert ended is not None
    assert ended.overdue
    dog.begin("b2", ["j2"])
    assert dog.poll() == "running"  # the next batch starts with a fresh budget
