"""One task message onto its queue with one command: the hand-off of a job to inference, the hottest publish there
is (every text-only job, and every job whose inputs are cached, is handed over by the API this way).

Celery's `apply_async` costs about 0.3 ms of CPU per message on a Redis broker, against 0.06 ms for the `LPUSH` it
comes down to (docs/bench/log/2026-12-04-cost-celery-machinery.md): the router, a producer taken from the pool and
given back, kombu's retry wrapper around the publish, its declaration cache, an `AsyncResult`, `saferepr` of the
arguments. No Celery or kombu call publishes a prepared message without that machinery, so the message is assembled
here from Celery's and kombu's own parts, as `send_task` assembles it:

- Celery's router picks the queue, and `as_task_v2` builds the message (protocol 2);
- `before_task_publish` and `after_task_publish` are sent around the push (the publish time is stamped there, a
  trace's producer span made);
- kombu serializes the body with the app's serializer, and the channel prepares and pushes it (`prepare_message`,
  `basic_publish`: its body encoding, delivery tag and priority list), over one client that every thread shares
  (`stoker.adapters.broker.RedisChannel`).

The message is the one `apply_async` would have sent, but for its ids and times. Only a plain signature goes this
way (one task on a Redis broker, with no option but its queue, its priority and an ignored result, and no sent
events); anything else is `apply_async`'s, and so is everything on RabbitMQ.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import redis.asyncio as aioredis
from celery import Celery
from celery.canvas import Signature
from celery.signals import after_task_publish, before_task_publish
from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps
from kombu.utils.uuid import uuid

from stoker.adapters.broker import is_amqp

#: The only options a plain signature has: any other (a link, an ETA, an expiry, a time limit, headers…) is Celery's
#: to send.
_PLAIN_OPTIONS = frozenset({"ignore_result", "queue", "priority"})


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
        options = {name for name, value in signature.options.items() if value is not None}
        return type(signature) is Signature and options <= _PLAIN_OPTIONS

    def send(self, signature: Signature) -> str:
        """Publish the signature's message; its task id. Raises what the broker's client raises if it cannot."""
        channel, pushing = self._channel_open()
        task_id, message, queue, sent = self._message(signature, channel)
        with pushing:
            channel.basic_publish(message, "", queue)  # the anonymous exchange: the routing key names the queue
        sent()
        return task_id

    async def send_on(self, signature: Signature, client: aioredis.Redis[bytes]) -> str:
        """`send`, from an asyncio loop: the same message, pushed over `client` (an asyncio client of the broker's
        Redis, `stoker.adapters.store.clients.async_broker_client`) instead of from a pool thread, whose hop costs
        the API more CPU than the push. kombu's channel still decides what is pushed, and where: its publish, given
        a batch (`_publish_batch`, the seam kombu's own bulk publishing uses), queues its commands there instead
        of running them."""
        opened = self._opened
        if opened is None:  # its first opening pings the broker: not on the loop
            opened = await asyncio.to_thread(self._channel_open)
        channel = opened[0]
        task_id, message, queue, sent = self._message(signature, channel)
        batch = _Commands()
        channel.basic_publish(message, "", queue, _publish_batch=batch)
        if not batch.commands:  # a kombu without the seam would have pushed it itself: none would be queued
            raise RuntimeError("kombu's channel queued no command for the message")
        if len(batch.commands) == 1:  # the usual push, one `LPUSH`: a pipeline would only cost its own setup
            command, args = batch.commands[0]
            await getattr(client, command)(*args)
        else:
            async with client.pipeline(transaction=False) as pipe:
                for command, args in batch.commands:
                    getattr(pipe, command)(*args)
                await pipe.execute()
        sent()
        return task_id

    def _message(self, signature: Signature, channel: Any) -> tuple[str, Any, str, Callable[[], None]]:
        """The signature's message as `apply_async` would make it (`before_task_publish` sent), its task id, its
        queue, and what to call once it is pushed (`after_task_publish`)."""
        if not self.plain(signature):
            raise ValueError(f"not a plain signature: {sorted(signature.options)}")
        app, name = self.app, signature.task
        options = dict(signature.options)
        ignore_result = bool(options.pop("ignore_result", False))
        options = app.amqp.router.route(options, name, signature.args, signature.kwargs)
        queue = options["queue"]
        task_id = uuid()
        headers, properties, body, _ = app.amqp.as_task_v2(
            task_id,
            name,
            signature.args,
            signature.kwargs,
            reply_to=app.thread_oid,
            ignore_result=ignore_result,
            argsrepr=_short_repr(signature.args, app.amqp.argsrepr_maxsize),
            kwargsrepr=_short_repr(signature.kwargs, app.amqp.kwargsrepr_maxsize),
        )
        before_task_publish.send(
            sender=name,
            body=body,
            exchange="",
            routing_key=queue.name,
            declare=[queue],
            headers=headers,
            properties=properties,
            retry_policy=None,
        )
        content_type, encoding, payload = dumps(body, serializer=app.conf.task_serializer)  # type: ignore[no-untyped-call]
        mode = queue.exchange.delivery_mode or app.conf.task_default_delivery_mode
        properties["delivery_mode"] = maybe_delivery_mode(mode)  # type: ignore[no-untyped-call]
        message = channel.prepare_message(payload, options.get("priority"), content_type, encoding, headers, properties)

        def sent() -> None:
            after_task_publish.send(sender=name, body=body, headers=headers, exchange="", routing_key=queue.name)

        return task_id, message, queue.name, sent

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


class _Commands:
    """What kombu's Redis channel would run for a publish, queued instead (its `_publish_batch`)."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, tuple[Any, ...]]] = []

    def add(self, command: str, *args: Any) -> None:
        self.commands.append((command, args))


def _short_repr(value: Any, limit: int) -> str | None:
    """`repr(value)` where it is within `limit` (what Celery's `saferepr` gives for the few scalars a plain message
    carries, at a fifth of its cost); None past it, so Celery's `saferepr` shortens it as usual."""
    text = repr(value)
    return text if len(text) <= limit else None
