"""One task message onto its queue with one command: the hand-off of a job to inference, the hottest publish there
is (every text-only job, and every job whose inputs are cached, is handed over by the API this way).

Celery's `apply_async` costs about 0.3 ms of CPU per message on a Redis broker, against 0.06 ms for the `LPUSH` it
comes down to (docs/bench/log/2026-12-04-cost-celery-machinery.md): the router, a producer taken from the pool and
given back, kombu's retry wrapper around the publish, its declaration cache, an `AsyncResult`, `saferepr` of the
arguments. No Celery or kombu call publishes a prepared message without that machinery, so the message is assembled
from Celery's and kombu's own parts, as `send_task` assembles it, in the fences that mirror them:

- `stoker.adapters.celery_protocol.task_message`: Celery's router picks the queue, `as_task_v2` builds the message
  (protocol 2), `before_task_publish` and `after_task_publish` are sent around the push (the publish time is stamped
  there, a trace's producer span made), kombu serializes the body with the app's serializer and the channel
  prepares it;
- kombu's channel pushes it (`basic_publish`: its body encoding, delivery tag and priority list), over one client
  that every thread shares (`stoker.adapters.kombu_redis.RedisChannel`), or, from the API's loop, says what to push
  (`stoker.adapters.kombu_redis.queued_publish`).

The message is the one `apply_async` would have sent, but for its ids and times. Only a plain signature goes this
way (one task on a Redis broker, with no option but its queue, its priority and an ignored result, and no sent
events); anything else is `apply_async`'s, and so is everything on RabbitMQ.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from contextlib import AbstractContextManager
from typing import Any

import redis.asyncio as aioredis
from celery import Celery
from celery.canvas import Signature

from stoker.adapters.broker import is_amqp
from stoker.adapters.celery_protocol import is_plain, task_message
from stoker.adapters.kombu_redis import queued_publish


class DirectPublisher:
    """Publishes plain task signatures of `app` to its Redis broker with one `LPUSH` each (see the module)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._opening = threading.Lock()
        #: The channel pushed through, and the bound on pushes at once: as many as its connection pool holds
        #: connections (redis-py's pool refuses one more, MaxConnectionsError, instead of waiting for one, and the
        #: API pushes from every thread of its pool). None until the first push, and after `close`.
        self._opened: tuple[Any, AbstractContextManager[Any]] | None = None

    @staticmethod
    def serves(app: Celery) -> bool:
        """Whether `app`'s messages can go this way: a Redis broker, and no `task-sent` events to send."""
        return not is_amqp(app.conf.broker_url or "") and not app.conf.task_send_sent_event

    @staticmethod
    def plain(signature: Signature) -> bool:
        """Whether the signature is one this publisher sends as Celery would: one task (not a canvas) with no
        option but its queue, its priority and whether its result is ignored."""
        return is_plain(signature)

    def send(self, signature: Signature) -> str:
        """Publish the signature's message; its task id. Raises what the broker's client raises if it cannot."""
        channel, pushing = self._channel_open()
        built = task_message(self.app, signature, channel)
        with pushing:
            channel.basic_publish(built.message, "", built.queue)  # the anonymous exchange: the key names the queue
        built.sent()
        return built.task_id

    async def send_on(self, signature: Signature, client: aioredis.Redis[bytes]) -> str:
        """`send`, from an asyncio loop: the same message, pushed over `client` (an asyncio client of the broker's
        Redis, `stoker.adapters.store.clients.async_broker_client`) instead of from a pool thread, whose hop costs
        the API more CPU than the push. kombu's channel still decides what is pushed, and where (`queued_publish`)."""
        opened = self._opened
        if opened is None:  # its first opening pings the broker: not on the loop
            opened = await asyncio.to_thread(self._channel_open)
        channel = opened[0]
        built = task_message(self.app, signature, channel)
        commands = queued_publish(channel, built.message, built.queue)
        if len(commands) == 1:  # the usual push, one `LPUSH`: a pipeline would only cost its own setup
            command, args = commands[0]
            await getattr(client, command)(*args)
        else:
            async with client.pipeline(transaction=False) as pipe:
                for command, args in commands:
                    getattr(pipe, command)(*args)
                await pipe.execute()
        built.sent()
        return built.task_id

    def _channel_open(self) -> tuple[Any, AbstractContextManager[Any]]:
        """The channel messages are pushed through, opened on first use (kombu's channel on the app's broker
        connection; its client is shared between threads), and the bound on pushes at once."""
        with self._opening:
            if self._opened is None:
                channel = self.app.connection_for_write().default_channel
                limit = channel.max_connections  # None: a pool without a bound
                self._opened = (channel, threading.BoundedSemaphore(limit) if limit else contextlib.nullcontext())
            return self._opened

    def close(self) -> None:
        """Close the channel's connection, if one was opened."""
        with self._opening:
            opened, self._opened = self._opened, None
        if opened is not None:
            opened[0].connection.client.release()
