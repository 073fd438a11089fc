"""One listener per API process for every request that waits on a job (long-polls, chat completions).

A pub/sub connection per waiting request would exhaust the Redis pool under load (the 101st wait a 500); here one
pattern subscription hears every job's announcements (ended, a piece of a streamed answer) and wakes, in memory,
whoever waits on that job. A job's end comes with its ended record, which its waiters answer from. A waiter
re-reads the job at least every `POLL_S` as well, so a lost connection (a Redis restart, a partition) costs
latency, never an answer; the listener reconnects on its own.

The process's stop is announced to every waiter too (`stop`): each wait then ends within the stop's grace, and
answers with its job as it stands, so the server can exit with every response sent instead of being killed under
requests that wait longer than it may (a client cut off mid-POST cannot tell whether its job was made).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import redis.asyncio as aioredis

from stoker.adapters.store.jobs import ended_job
from stoker.adapters.store.keys import ANNOUNCEMENT_PATTERNS, ENDED, announced_event, announced_job
from stoker.core.jobs import Job

log = logging.getLogger(__name__)

#: A waiter looks at its job at least this often, announced or not.
POLL_S = 1.0
#: Pause before the listener reconnects after losing its connection.
RECONNECT_S = 1.0


def _cancelling() -> bool:
    """Whether this task has been asked to stop: then a failure on the way out ends it, never reconnects it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Announcements:
    """Fans the store's job announcements out to the requests of this process that wait on them, and the process's
    stop (`stop`), which ends every wait within `stop_grace_s`."""

    def __init__(self, stop_grace_s: float) -> None:
        #: How long waits go on once the process is asked to stop.
        self.stop_grace_s = stop_grace_s
        #: When every wait ends (monotonic), once the process is asked to stop; None until then.
        self.stop_by: float | None = None
        #: Per job, each waiter's event and the one announcement it waits for (None: any).
        self._waiters: dict[str, dict[asyncio.Event, str | None]] = {}
        #: Per job waited on here, its ended record as announced (kept while anyone here waits on it).
        self._ended: dict[str, bytes] = {}
        self.listening = False

    async def run(self, client: aioredis.Redis[bytes]) -> None:
        """Listen over `client` until cancelled, reconnecting after any failure."""
        while True:
            try:
                await self._listen(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if _cancelling():  # a cancel that surfaced as a connection error (the client's read, or its close)
                    raise asyncio.CancelledError from exc
                log.warning("announcement listener lost its connection (%r); reconnecting", exc)
            finally:
                self.listening = False
                self._wake_all()  # whoever waits looks again now rather than at its next poll
            await asyncio.sleep(RECONNECT_S)

    async def _listen(self, client: aioredis.Redis[bytes]) -> None:
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.psubscribe(*ANNOUNCEMENT_PATTERNS)
            self.listening = True
            async for message in pubsub.listen():
                channel = message["channel"]
                self._wake(channel.decode() if isinstance(channel, bytes) else str(channel), message["data"])
        finally:
            await pubsub.aclose()  # type: ignore[attr-defined]  # redis>=5 has it; the stubs lag

    def _wake(self, channel: str, data: bytes) -> None:
        """Wake whoever waits on the announcing job for this announcement (or for any); an end's record is kept
        for them (`ended`) while they wait."""
        announced, job_id = announced_event(channel), announced_job(channel)
        waiters = self._waiters.get(job_id)
        if not waiters:
            return
        if announced == ENDED and data:
            self._ended[job_id] = data
        for event, only in waiters.items():
            if only is None or only == announced:
                event.set()

    def ended(self, job_id: str) -> Job | None:
        """The job as the announcement of its end carried it, if that was heard while someone here waits on it:
        a waiter woken by the end answers from it without reading the job again."""
        announced = self._ended.get(job_id)
        return ended_job(job_id, announced) if announced is not None else None

    def stop(self) -> None:
        """The process is asked to stop: every wait ends within the stop's grace (`until`), and is woken now to
        learn it."""
        if self.stop_by is None:
            self.stop_by = time.monotonic() + self.stop_grace_s
            self._wake_all()

    def until(self, until: float) -> float:
        """When a wait that would end at `until` ends: then, or by the stop's grace once the process stops."""
        return until if self.stop_by is None else min(until, self.stop_by)

    def stopped_before(self, until: float) -> bool:
        """Whether the stop ended a wait before `until`, its own end."""
        return self.stop_by is not None and self.stop_by < until and time.monotonic() >= self.stop_by

    def _wake_all(self) -> None:
        for events in self._waiters.values():
            for event in events:
                event.set()

    @contextlib.contextmanager
    def watch(self, job_id: str, only: str | None = None) -> Iterator[asyncio.Event]:
        """An event set whenever the job announces something (with `only`, that one announcement, e.g. `ENDED`:
        a long-poll is not woken by the steps before the end), for the duration of the block. Enter it before
        reading the job: an announcement made after that read is then never missed."""
        event = asyncio.Event()
        self._waiters.setdefault(job_id, {})[event] = only
        try:
            yield event
        finally:
            events = self._waiters.get(job_id)
            if events is not None:
                events.pop(event, None)
                if not events:
                    del self._waiters[job_id]
                    self._ended.pop(job_id, None)

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> None:
        """Until the event is set or min(timeout_s, POLL_S) passes; the event is cleared for the next wait."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(min(timeout_s, POLL_S), 0.0))
        event.clear()

    @property
    def waiting(self) -> int:
        """Requests of this process waiting now."""
        return sum(len(events) for events in self._waiters.values())
