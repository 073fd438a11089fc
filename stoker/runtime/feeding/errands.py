"""Small writes the device thread must not wait for: ending the jobs whose deadline passed before the device was
free, letting go of those cancelled meanwhile, and stamping the start of a batch that runs long."""

from __future__ import annotations

import threading
import time
from functools import partial

from stoker.runtime.batches import BatchItem, expire
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeding.registry import Registry

#: How long a batch runs before its jobs' `infer_start` stamps are written on their own (a shorter one's are written
#: with its results: one round trip less per batch on a fast device).
STAMP_AFTER_S = 0.05


class DeviceTurn:
    """One batch's time on the device, as the errands thread sees it: whether it has ended, and the lock its start
    stamps are written under. The device thread ends the turn under that lock, so a stamp begun before the end is
    written before the batch goes to the writer (whose results would otherwise be overtaken by it)."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.writing = threading.Lock()

    def end(self) -> None:
        """The batch is off the device (waits for a start stamp being written)."""
        with self.writing:
            self.ended.set()


class Errands:
    """The errands thread's work, under a lock of its own: the batch on the device (its items, when it started, its
    turn), whose start is stamped if it runs long; jobs that expired or were cancelled before it started (to end or
    let go of, when it started)."""

    def __init__(self, ctx: WorkerContext, registry: Registry, stopping: threading.Event) -> None:
        self.ctx = ctx
        self.registry = registry
        self._stopping = stopping
        self._errand = threading.Condition()
        self._on_device: tuple[list[BatchItem], float, DeviceTurn] | None = None
        self._unready: list[tuple[list[BatchItem], list[BatchItem], float]] = []
        #: The errands thread sleeps with nothing to wake for: the next batch wakes it (no other does).
        self._idle = False

    def started(self, items: list[BatchItem], at: float, late: list[BatchItem], dropped: list[BatchItem]) -> DeviceTurn:
        """A batch was taken to the device at `at` (`late` and `dropped` left out of it); its turn."""
        turn = DeviceTurn()
        with self._errand:
            self._on_device = (items, at, turn) if items else None
            if late or dropped:
                self._unready.append((late, dropped, at))
            if late or dropped or (items and self._idle):
                self._errand.notify()
        return turn

    def wake(self) -> None:
        """Wake the errands thread (the consumer stops)."""
        with self._errand:
            self._errand.notify()

    def step(self) -> None:
        """End the jobs whose deadline passed before the device was free (never computed), and mark those whose
        batch is still running STAMP_AFTER_S after it started (`ts:infer_start`: the reaper leaves a job on the
        device alone, and readers count the device busy). A batch that ends sooner is stamped with its results.

        Woken by a batch only when it sleeps with nothing to wake for, or for jobs to end: while batches follow
        each other, it wakes when the one on the device is due a stamp, at most every STAMP_AFTER_S, not once
        per batch (a wake-up per batch cost a fast device's consumer two thread switches per job)."""
        with self._errand:
            while True:
                if self._stopping.is_set():
                    return
                unready, self._unready = self._unready, []
                due = self.stamp_due(time.time())
                if unready or due is not None:
                    break
                on_device = self._on_device
                self._idle = on_device is None
                self._errand.wait(None if on_device is None else on_device[1] + STAMP_AFTER_S - time.time())
                self._idle = False
        for late, dropped, at in unready:
            self._end_unready(late, dropped, at)
        if due is not None:
            self._stamp_start(*due)

    def _end_unready(self, late: list[BatchItem], dropped: list[BatchItem], at: float) -> None:
        for item in late:
            expire(self.ctx, item.job_id, at)
            if item.message is not None:
                self.registry.done_with(item.message)
        for item in dropped:  # cancelled: already ended, nothing to write
            if item.message is not None:
                self.registry.done_with(item.message)

    def stamp_due(self, now: float) -> tuple[list[BatchItem], float, DeviceTurn] | None:
        """The batch on the device, once it is due its start stamp (called holding the errands' lock): taken, so
        it is stamped once. One that ended is forgotten: its results carry its stamps."""
        on_device = self._on_device
        if on_device is not None and on_device[2].ended.is_set():
            self._on_device = on_device = None
        if on_device is None or on_device[1] + STAMP_AFTER_S > now:
            return None
        self._on_device = None
        return on_device

    def _stamp_start(self, started: list[BatchItem], at: float, turn: DeviceTurn) -> None:
        """The start of a batch still on the device, in one round trip (unless it ended meanwhile: then its results
        carry the stamps)."""
        with turn.writing:
            if turn.ended.is_set():
                return
            store = self.ctx.store
            first = [i.job_id for i in started if not i.request.generated]  # an answer that goes on started before
            device_started = partial(store.stats.queue_device_started, at=at)
            store.jobs.stamp_many(first, "infer_start", at, also=[device_started])
