"""The jobs cancelled anywhere lately, heard as the store announces them, so the device thread can drop one it holds
without asking the store (no round trip before a batch)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from stoker.runtime.context import WorkerContext

log = logging.getLogger(__name__)

#: Cancelled job ids kept in memory before the oldest are forgotten, and for how long at least.
CANCELLED_KEPT = 4096
CANCELLED_TTL_S = 600.0


class Cancellations:
    """Cancelled job ids (id → when heard), under a lock of their own."""

    def __init__(self, ctx: WorkerContext, stopping: threading.Event) -> None:
        self.ctx = ctx
        self._stopping = stopping
        self._lock = threading.Lock()
        self._cancelled: dict[str, float] = {}

    def step(self) -> None:
        """Hear every cancelled job as it is announced. A message missed while the store is away costs only compute:
        the batch runs and its answer is not written."""
        try:
            with self.ctx.store.jobs.cancellations() as feed:
                while not self._stopping.is_set():
                    message = feed.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None:
                        self.heard(message["data"].decode(), time.time())
        except Exception as exc:  # the store is away: listen again shortly
            log.warning("cannot hear cancellations: %s", exc)
            self._stopping.wait(1.0)

    def heard(self, job_id: str, now: float) -> None:
        """A job was cancelled."""
        with self._lock:
            self._cancelled[job_id] = now
            if len(self._cancelled) > CANCELLED_KEPT:  # forget those heard long ago: long gone from any batch
                self._cancelled = {j: t for j, t in self._cancelled.items() if now - t < CANCELLED_TTL_S}

    def holds(self, job_id: str) -> bool:
        """Whether the job was heard cancelled (asked by a call on the device between its steps)."""
        with self._lock:
            return job_id in self._cancelled

    def among(self, job_ids: Sequence[str]) -> set[str]:
        """Those of the jobs heard cancelled."""
        with self._lock:
            return {j for j in job_ids if j in self._cancelled}
