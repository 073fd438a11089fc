"""The API's view of queue pressure: sampled in the background, read by admission control and /v1/stats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kombu.connection import Connection
from starlette.concurrency import run_in_threadpool

from stoker.adapters.broker import queue_depths, transport_options
from stoker.adapters.store import Store
from stoker.core.pacing import Pace
from stoker.core.pressure import (
    DrainMeter,
    QueueState,
    Refusal,
    StoreMemory,
    drain_rate,
    queue_refusal,
    room_to_enqueue,
)
from stoker.core.queues import INFER_BATCH_QUEUE, INFER_QUEUES, QUEUES
from stoker.settings import ApiSettings

log = logging.getLogger(__name__)
#: How often the store's memory is read (INFO costs more than the depth reads, and memory moves slowly).
MEMORY_EVERY_S = 2.0


@dataclass(frozen=True)
class Snapshot:
    """Every queue at one moment."""

    at: float
    queues: list[QueueState]
    #: Interactive jobs were held for the inference queue's watermarks (`HandoffHold`; read only while the
    #: inference queue stood above its low watermark).
    held: bool = False


class QueueMonitor:
    """Samples queue depths (from the broker) and drain counters (from the store) every `interval_s`; while every
    queue stays empty and no job is submitted, less and less often (up to `idle_max_wait_s`, well within `stale_s`),
    until a submission (`touch`) or a queue that moves brings it back to `interval_s`."""

    def __init__(
        self,
        settings: ApiSettings,
        store: Store,
        interval_s: float = 0.5,
        stale_s: float = 5.0,
        queues: Sequence[str] = QUEUES,
    ) -> None:
        self.settings = settings
        self.store = store
        self.interval_s = interval_s
        self.stale_s = stale_s
        self.meter = DrainMeter(window_s=10.0)
        self.latest: Snapshot | None = None
        self.memory: StoreMemory | None = None
        self._connection: Connection | None = None
        self._lock = threading.Lock()  # the background loop and /v1/stats may sample at once
        self.pace = Pace(interval_s, min(settings.idle_max_wait_s, stale_s / 2))
        self._wake: asyncio.Event | None = None  # made in the serving loop, by `run`
        self._touched = False  # a job was submitted since the last round
        #: The queues new jobs land in and wait behind (the submitter's: the synchronous baseline's adds its one).
        self.queues = tuple(queues)

    def limit(self, queue: str) -> int:
        """The admission limit of a queue: the inference queues' own, the CPU one for every queue before them (the
        stages', and the synchronous baseline's of whole jobs)."""
        return self.settings.infer_queue_limit if queue in INFER_QUEUES else self.settings.cpu_queue_limit

    def sample(self) -> Snapshot:
        """Read every queue's depth and drain counter now (blocking)."""
        with self._lock:
            return self._sample()

    def _sample(self) -> Snapshot:
        if self._connection is None:
            url = self.settings.broker_url
            ssl = self.settings.redis_tls(url) or False  # never kombu's unverified default for rediss://
            # Bounded like every other Redis call of the API: a hung broker fails a sample instead of holding a thread.
            timeout = self.settings.store_timeout_s
            options = transport_options(url, self.settings.visibility_timeout_s, timeout)
            self._connection = Connection(  # type: ignore[no-untyped-call]
                url, connect_timeout=timeout, ssl=ssl, transport_options=options
            )
        try:
            depths = queue_depths(self._connection, self.queues)
        except Exception:
            self.close()
            raise
        now = time.time()
        self.meter.add(now, self.store.stats.drained(), depths)
        rates = {q: self.meter.rate(q) for q in self.queues}
        states = [QueueState(q, depths[q], self.limit(q), round(drain_rate(q, rates), 3)) for q in self.queues]
        held = self.store.handoff_hold.held_at(depths.get("infer", 0), self.settings.infer_low_watermark)
        self.latest = Snapshot(now, states, held)
        self._sample_memory(now)
        return self.latest

    def _sample_memory(self, now: float) -> None:
        if self.memory is not None and now - self.memory.at < MEMORY_EVERY_S:
            return
        try:
            info = self.store.client.info("memory")
        except Exception as exc:  # the queue sample stands; the memory view just ages (and then counts as unknown)
            log.warning("cannot read the store's memory: %s", exc)
            return
        self.memory = StoreMemory(now, int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)))

    async def run(self) -> None:
        """Sample forever; a failed sample leaves no snapshot (admission then lets the broker decide)."""
        self._wake = wake = asyncio.Event()
        while True:
            before = self.latest
            try:
                after: Snapshot | None = await run_in_threadpool(self.sample)
            except Exception as exc:
                if self.latest is not None:
                    log.warning("cannot sample the queues: %s", exc)
                self.latest = after = None
            touched, self._touched = self._touched, False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.pace.next_wait(_moving(before, after) or touched))
            wake.clear()

    def touch(self) -> None:
        """A job is being submitted (on the serving loop): the monitor keeps its own pace, and one that had slowed
        down samples now (once: under load it is at its pace already, and a submission wakes nothing)."""
        self._touched = True
        if self.pace.slowed:
            self.pace.reset()
            if self._wake is not None:
                self._wake.set()

    def fresh(self) -> Snapshot | None:
        """The latest snapshot, if recent enough to act on."""
        latest = self.latest
        return latest if latest and time.time() - latest.at <= self.stale_s else None

    def room_for_inference(self) -> bool:
        """Whether a job may go straight to the inference queue: it is at or under its high watermark, the rule
        tokenize's hand-off follows (`room_to_enqueue`), and no job is held for it (as last seen). Otherwise jobs
        take the tokenize queue, whose stage holds them until it drains to its low watermark (backpressure), behind
        those held before them."""
        snapshot = self.fresh()
        if snapshot is None or snapshot.held:
            return False
        depth = next((q.depth for q in snapshot.queues if q.name == "infer"), 0)
        s = self.settings
        return room_to_enqueue(depth, s.infer_high_watermark, s.infer_low_watermark, held=False)

    def refusal(self) -> Refusal | None:
        """Why a new job must be refused now, if it must."""
        snapshot = self.fresh()
        if snapshot is None:
            return None
        # Batch lines are fed only into the room the queues leave: their own queue never turns a client away.
        queues = [q for q in snapshot.queues if q.name != INFER_BATCH_QUEUE]
        return queue_refusal(queues, self.settings.admission_resume_ratio)

    def store_full(self) -> StoreMemory | None:
        """The store's memory, when it is too full for new jobs (as last seen)."""
        memory = self.memory
        if memory is None or time.time() - memory.at > self.stale_s:
            return None
        return memory if memory.nearly_full(self.settings.store_memory_high_ratio) else None

    def close(self) -> None:
        """Drop the broker connection."""
        if self._connection is not None:
            self._connection.release()  # type: ignore[no-untyped-call]
            self._connection = None


def _moving(before: Snapshot | None, after: Snapshot | None) -> bool:
    """Whether the queues show work: anything waiting, or depths that changed between two samples (a failed sample
    counts as work: the monitor keeps trying at its own pace)."""
    if before is None or after is None:
        return True
    depths = [q.depth for q in after.queues]
    return any(depths) or depths != [q.depth for q in before.queues]
