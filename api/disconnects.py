"""Knowing at once that a waiting client went away, whatever middleware runs in front of the route.

Once a request's body has been read, the only message its ASGI `receive` can still deliver is `http.disconnect`
(the server sends it when the client closes the connection, or after the response). A background task that awaits
it turns that into an event: a route waiting on a job wakes the moment its client leaves, instead of asking the
server (`Request.is_disconnected`, a receive cancelled at once) whether a disconnect happens to be queued, which a
paused transport or a wrapping middleware may never show.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.types import Receive


class ClientWatch:
    """Set `gone` (and wake whoever waits on `wakes`) when the client's connection closes."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = asyncio.Event()
        self.wakes: set[asyncio.Event] = set()

    async def listen(self) -> None:
        """Until the server says the client is gone (a body already read leaves nothing else to receive)."""
        while (await self._receive())["type"] != "http.disconnect":
            continue
        self.gone.set()
        for event in self.wakes:
            event.set()

    @property
    def left(self) -> bool:
        """Whether the client has gone away."""
        return self.gone.is_set()


@contextlib.asynccontextmanager
async def watching(receive: Receive) -> AsyncIterator[ClientWatch]:
    """Watch the client for the duration of the block (enter it only once the request's body has been read)."""
    watch = ClientWatch(receive)
    task = asyncio.create_task(watch.listen())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
