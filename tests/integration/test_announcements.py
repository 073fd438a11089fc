"""The API's one announcement listener, over the real store: who is woken by what a job announces."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from api.announcements import Announcements
from stoker.adapters.store.keys import ENDED, done_channel, handed_off_channel


async def _heard(only: str | None) -> list[tuple[str, bool]]:
    """Publish a job's hand-off, then its end; whether a waiter (for `only`, or anything) was woken by each."""
    job_id = uuid.uuid4().hex
    client: aioredis.Redis[bytes] = aioredis.Redis.from_url(os.environ["STOKER_RESULT_URL"])
    announcements = Announcements(stop_grace_s=30.0)
    listener = asyncio.create_task(announcements.run(client))
    heard: list[tuple[str, bool]] = []
    try:
        while not announcements.listening:
            await asyncio.sleep(0.01)
        with announcements.watch(job_id, only=only) as event:
            for name, channel in (("handed", handed_off_channel(job_id)), (ENDED, done_channel(job_id))):
                await client.publish(channel, "")
                # A marker on a channel nobody here watches, announced after: once the listener has passed it,
                # it has passed the announcement before it too.
                marker = uuid.uuid4().hex
                with announcements.watch(marker) as passed:
                    await client.publish(done_channel(marker), "")
                    await asyncio.wait_for(passed.wait(), 10)
                heard.append((name, event.is_set()))
                event.clear()
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await client.aclose()  # type: ignore[attr-defined]  # redis>=5 has it; the stubs lag
    return heard


def test_a_long_poll_is_woken_by_its_jobs_end_not_by_the_steps_before(store_redis: object) -> None:
    assert asyncio.run(_heard(ENDED)) == [("handed", False), (ENDED, True)]
    # A waiter for anything (a chat waiting for its inputs to settle) hears both
    assert asyncio.run(_heard(None)) == [("handed", True), (ENDED, True)]


def test_a_cancel_that_surfaces_as_a_connection_error_stops_the_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancelled listener whose read turns the cancel into a connection error (as the Redis client can while it
    reads, or as its client closes) stops; it does not reconnect and outlive the app that cancelled it."""

    async def listen_until_cancelled(self: Announcements, client: object) -> None:
        try:
            await asyncio.sleep(60)  # listening
        except asyncio.CancelledError:
            raise redis.ConnectionError("Connection closed by server.") from None

    monkeypatch.setattr(Announcements, "_listen", listen_until_cancelled)

    async def cancel_it() -> bool:
        task = asyncio.create_task(Announcements(stop_grace_s=30.0).run(client=None))  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)  # without the check it sleeps, reconnects, listens again
        return task in done and task.cancelled()

    loop = asyncio.new_event_loop()
    try:
        stopped = loop.run_until_complete(cancel_it())
    finally:
        loop.close()  # a listener that outlived its cancel is left behind here: waiting on it never ends
    assert stopped


def test_a_stop_wakes_every_waiter_and_ends_each_wait_within_its_grace() -> None:
    announcements = Announcements(stop_grace_s=2.0)
    near, far = time.monotonic() + 1.0, time.monotonic() + 60.0
    with announcements.watch("a") as a, announcements.watch("b", only=ENDED) as b:
        assert announcements.until(far) == far  # before the stop, a wait ends at its own end
        announcements.stop()
        assert a.is_set()  # woken now, whatever each waits for, to learn its new end
        assert b.is_set()
    assert announcements.until(far) <= time.monotonic() + 2.0  # brought forward to the grace
    assert announcements.until(near) == near  # one that ends sooner is left alone
    assert not announcements.stopped_before(far)  # the grace has not passed: the wait is not over yet
    stopped = Announcements(stop_grace_s=0.0)
    stopped.stop()
    assert stopped.stopped_before(far)  # ended by the stop, not by its own end
    assert not stopped.stopped_before(time.monotonic() - 1.0)  # one whose own end came first was not
