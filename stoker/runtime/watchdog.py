"""The inference watchdog: Celery enforces no time limit on a threads/solo pool, so this one watches the batch.

A batch running past its budget has its jobs failed (`inference_failed`) so their clients hear back; one still
running after a further grace means the device is wedged, and the worker must be replaced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

Verdict = Literal["idle", "running", "overdue", "wedged"]


@dataclass
class RunningBatch:
    """The batch on the device now."""

    id: str
    job_ids: tuple[str, ...]
    started: float
    overdue: bool = False


class BatchWatchdog:
    """Tracks the running batch; `check` (pure, given the clock) says what is due, `watch` acts on it."""

    def __init__(
        self,
        budget_s: float,
        grace_s: float,
        on_overdue: Callable[[RunningBatch], None],
        on_wedged: Callable[[RunningBatch], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget_s = budget_s
        self.grace_s = grace_s
        self.on_overdue = on_overdue
        self.on_wedged = on_wedged
        self.clock = clock
        self._lock = threading.Lock()
        self._batch: RunningBatch | None = None
        self._begun = threading.Event()  # wakes a watch that sleeps while no batch runs

    def begin(self, batch_id: str, job_ids: Sequence[str]) -> None:
        """A batch went onto the device."""
        with self._lock:
            self._batch = RunningBatch(batch_id, tuple(job_ids), self.clock())
        self._begun.set()

    def end(self) -> RunningBatch | None:
        """The batch came back; returns it (its `overdue` says whether its jobs were already failed)."""
        with self._lock:
            batch, self._batch = self._batch, None
        return batch

    def check(self) -> tuple[Verdict, RunningBatch | None]:
        """What the running batch's age calls for; 'overdue' is reported once per batch."""
        with self._lock:
            batch = self._batch
            if batch is None:
                return "idle", None
            age = self.clock() - batch.started
            if age >= self.budget_s + self.grace_s:
                return "wedged", batch
            if age >= self.budget_s and not batch.overdue:
                batch.overdue = True
                return "overdue", batch
            return "running", batch

    def wait_for_batch(self, timeout_s: float | None = None) -> bool:
        """Until a batch begins (one that began since the last wait counts); False if `timeout_s` passed first."""
        begun = self._begun.wait(timeout_s)
        self._begun.clear()
        return begun

    def poll(self) -> Verdict:
        """Check once and act."""
        verdict, batch = self.check()
        if verdict == "overdue" and batch is not None:
            log.error(
                "batch %s ran past its %.1fs budget: failing its %d jobs", batch.id, self.budget_s, len(batch.job_ids)
            )
            self.on_overdue(batch)
        elif verdict == "wedged" and batch is not None:
            log.critical(
                "batch %s still running after %.1fs: the device is wedged", batch.id, self.budget_s + self.grace_s
            )
            self.on_wedged(batch)
        return verdict

    def watch(self, interval_s: float = 0.25) -> threading.Thread:
        """Poll in a daemon thread for the life of the process, every interval while a batch runs; while none
        does, sleep until one begins (an idle device costs no wake-ups)."""

        def loop() -> None:
            while True:
                try:
                    verdict = self.poll()
                except Exception:  # the watchdog must outlive any one failure
                    log.exception("watchdog check failed")
                    verdict = "running"
                if verdict == "idle":
                    self.wait_for_batch()
                time.sleep(interval_s)

        thread = threading.Thread(target=loop, name="batch-watchdog", daemon=True)
        thread.start()
        return thread
