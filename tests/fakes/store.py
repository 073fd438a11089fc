"""The job store in memory, for unit tests: the store's own repositories, subclassed, with what the runtime calls
on them kept in dicts and lists a test reads and sets.

Each kept method is marked `@override` and typed as the real one, so a store method renamed or re-typed fails
`make typecheck` here rather than leaving a fake that no longer stands for anything. What is not kept reaches a
client that never connects: the test fails with `NotKept` instead of writing to a real Redis or passing over a
silent no-op; a repository the runtime reaches for the first time gets its kept methods here.

It lives under tests/ rather than beside the real store in `stoker/` (where procrastinate ships its in-memory
connector, for the tests of the applications built on it): nothing outside stoker's own tests builds on its store,
and it keeps only what the unit tests reach, not the whole store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import PubSub
from typing_extensions import override

from stoker.adapters.store import Store
from stoker.adapters.store.consumers import ConsumerRegistry
from stoker.adapters.store.jobs import Ending, JobRepository, Pending, Queued
from stoker.adapters.store.stats import StatsRepository
from stoker.adapters.store.watch import Watchlist
from stoker.core.deadlines import JobClock
from stoker.core.jobs import BatchInfo, ErrorInfo, Job, JobStatus, ResultInfo

#: Time to live the real repositories underneath are built with; nothing in memory expires.
_TTL_S = 3600


class NotKept(NotImplementedError):
    """A store command no in-memory repository keeps: give the repository the test reached a kept method for it."""


class _RefusingConnection(redis.Connection):
    """A connection that never opens: the in-memory store's client reaches no server."""

    @override
    def connect(self) -> None:
        raise NotKept("a test reached a store command the in-memory store does not keep (see the traceback)")


def unconnected_client() -> redis.Redis[bytes]:
    """A client whose every command fails with `NotKept`; building pipelines, scripts and subscriptions is free."""
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=_RefusingConnection))


def _run_queued(client: redis.Redis[bytes], also: Sequence[Queued]) -> None:
    """Run what another repository queued onto a round trip of this one's: an in-memory repository keeps it as it is
    called; a real one's commands would be dropped unsent, so they fail the test."""
    with client.pipeline(transaction=False) as pipe:
        for queued in also:
            queued(pipe)
        if len(pipe):
            raise NotKept(f"commands queued by a repository the in-memory store does not keep: {pipe.command_stack}")


class MemoryCancellations(PubSub):
    """The cancellation channel: each job id a test puts on `cancelled` is heard as Redis announces it."""

    def __init__(self, client: redis.Redis[bytes], cancelled: queue.Queue[str]) -> None:
        super().__init__(client.connection_pool)
        self.cancelled = cancelled

    @override
    def get_message(self, ignore_subscribe_messages: bool = False, timeout: float = 0.0) -> dict[str, Any] | None:
        try:
            return {"type": "message", "data": self.cancelled.get(timeout=timeout).encode()}
        except queue.Empty:
            return None


class MemoryJobs(JobRepository):
    """Job records, pending model requests, endings and stamps: as the reaper and the inference consumer use them."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        super().__init__(client, ttl_s=_TTL_S)
        #: Jobs as clients see them (`load_job`).
        self.records: dict[str, Job] = {}
        #: Jobs handed over to inference, and each job's ending once written (first ending wins, as in Redis).
        self.pending: dict[str, Pending] = {}
        self.ended: dict[str, Ending] = {}
        #: The job ids of each `load_pending` call, in order.
        self.loads: list[list[str]] = []
        #: Each job's stamped start (`stamp_many`), and when that stamp was written.
        self.started: dict[str, float] = {}
        self.stamped_at: dict[str, float] = {}
        #: Job ids announced as cancelled, heard through `cancellations`.
        self.cancelled: queue.Queue[str] = queue.Queue()
        self._lock = threading.Lock()

    @override
    def load_job(self, job_id: str) -> Job | None:
        return self.records.get(job_id)

    @override
    def load_pending(self, job_ids: Sequence[str], also: Sequence[Queued] = ()) -> dict[str, Pending | None]:
        _run_queued(self.redis, also)  # before the reads, as the store's one pipeline runs them
        with self._lock:
            self.loads.append(list(job_ids))
            return {j: None if j in self.ended else self.pending.get(j) for j in job_ids}

    @override
    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        result: ResultInfo | None = None,
        error: ErrorInfo | None = None,
        batch: BatchInfo | None = None,
    ) -> bool:
        return self.finish_many([Ending(job_id, "default", status, result=result, error=error, batch=batch)])[0]

    @override
    def finish_many(self, endings: Sequence[Ending], also: Sequence[Queued] = ()) -> list[bool]:
        with self._lock:
            fresh = [e.job_id not in self.ended for e in endings]
            for ending, new in zip(endings, fresh, strict=True):
                if new:
                    self.ended[ending.job_id] = ending
        _run_queued(self.redis, also)  # after the endings, as the store's one pipeline runs them
        return fresh

    @override
    def stamp_many(self, job_ids: Sequence[str], name: str, at: float, also: Sequence[Queued] = ()) -> None:
        for job_id in job_ids:
            self.started[job_id] = at
            self.stamped_at[job_id] = time.time()
        _run_queued(self.redis, also)

    @override
    @contextlib.contextmanager
    def cancellations(self) -> Iterator[PubSub]:
        yield MemoryCancellations(self.redis, self.cancelled)


class MemoryWatch(Watchlist):
    """The reaper's watch list (when it next looks at each job) and each job's clock."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        super().__init__(client)
        self.clocks: dict[str, JobClock] = {}
        #: When the reaper looks at each job next; None once forgotten.
        self.next_at: dict[str, float | None] = {}

    @override
    def due_jobs(self, now: float, limit: int = 200) -> list[str]:
        return [j for j, at in self.next_at.items() if at is not None and at <= now][:limit]

    @override
    def clock(self, job_id: str) -> JobClock:
        return self.clocks[job_id]

    @override
    def watch_next(self, job_id: str, at: float | None) -> None:
        self.next_at[job_id] = at

    @override
    def count_redrive(self, job_id: str) -> None:
        clock = self.clocks[job_id]
        self.clocks[job_id] = dataclasses.replace(clock, redrives=clock.redrives + 1)


class MemoryConsumers(ConsumerRegistry):
    """Which jobs the inference consumer holds, its beats, and whether it left."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        super().__init__(client)
        self.held: set[str] = set()
        #: Each write that named jobs as held: the jobs, and whether it rode on another round trip (a pipeline).
        self.hold_writes: list[tuple[list[str], bool]] = []
        self.left = False
        #: Each beat's time to live.
        self.beats: list[float] = []

    @override
    def hold(self, consumer: str, job_ids: Collection[str]) -> None:
        self.hold_writes.append((list(job_ids), False))
        self.held |= set(job_ids)

    @override
    def queue_hold(self, pipe: redis.Redis[bytes], consumer: str, job_ids: Collection[str]) -> None:
        self.hold_writes.append((list(job_ids), True))
        self.held |= set(job_ids)

    @override
    def release(self, consumer: str, job_ids: Collection[str]) -> None:
        self.held -= set(job_ids)

    @override
    def queue_release(self, pipe: redis.Redis[bytes], consumer: str, job_ids: Collection[str]) -> None:
        self.held -= set(job_ids)

    @override
    def beat(self, consumer: str, ttl_s: float) -> None:
        self.beats.append(ttl_s)

    @override
    def leave(self, consumer: str) -> None:
        self.left = True


class MemoryStats(StatsRepository):
    """The counters the inference consumer writes."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        super().__init__(client)
        #: Messages drained (taken off a queue and done with), per queue.
        self.drained_by_queue: dict[str, int] = {}
        #: Each batch written: its size and its backend calls.
        self.batches: list[tuple[int, int]] = []
        #: When each batch went onto the device.
        self.device_started: list[float] = []

    @override
    def count_drained(self, queue: str, n: int = 1) -> None:
        self.drained_by_queue[queue] = self.drained_by_queue.get(queue, 0) + n

    @override
    def drained(self) -> dict[str, int]:
        return dict(self.drained_by_queue)

    @override
    def queue_device_started(self, pipe: redis.Redis[bytes], at: float) -> None:
        self.device_started.append(at)

    @override
    def queue_batch(
        self, pipe: redis.Redis[bytes], queue: str, size: int, busy_s: float, gap_s: float | None, calls: int = 1
    ) -> None:
        self.batches.append((size, calls))


@dataclass(frozen=True)
class MemoryStore(Store):
    """The job store with its jobs, watch list, consumers and counters in memory; its other repositories over a
    client that never connects."""

    jobs: MemoryJobs
    watch: MemoryWatch
    consumers: MemoryConsumers
    stats: MemoryStats

    @classmethod
    def empty(cls) -> MemoryStore:
        """A store holding nothing."""
        client = unconnected_client()
        real = Store.over(client, blob_ttl_s=_TTL_S, job_ttl_s=_TTL_S)
        # Every repository of the real store, so one added there is here too (unconnected) without naming it.
        others: dict[str, Any] = {f.name: getattr(real, f.name) for f in dataclasses.fields(real)}
        kept = {
            "jobs": MemoryJobs(client),
            "watch": MemoryWatch(client),
            "consumers": MemoryConsumers(client),
            "stats": MemoryStats(client),
        }
        return cls(**{**others, **kept})
