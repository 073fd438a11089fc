"""The broker: its queues' declarations, priorities and depths over any kombu transport (Redis, RabbitMQ), and
a queue read a message at a time. What stoker mirrors of kombu's Redis transport (its unacked index, its priority
lists, the transport every stoker process's Celery app uses on a Redis broker) is fenced in
`stoker.adapters.kombu_redis`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from kombu.connection import Connection
from kombu.entity import Queue
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from stoker.adapters.celery_protocol import TASK_ID_HEADER, task_kwargs
from stoker.adapters.kombu_redis import BATCH_PRIORITY, PRIORITY_STEPS, REDIS_TRANSPORT, redis_depths

# Re-exported for the worker's context, which still imports it from here; its home is `stoker.adapters.redis_intake`.
from stoker.adapters.redis_intake import RedisIntake as RedisIntake
from stoker.core.costs import SMALL, SizeClass
from stoker.core.jobs import JobClass
from stoker.core.queues import CALLBACK_QUEUE, QUEUES, SYNC_QUEUE

log = logging.getLogger(__name__)


def queue_depths(connection: Connection, names: Iterable[str] = QUEUES) -> dict[str, int]:
    """Messages waiting in each queue (not those a worker already holds); a queue never declared counts 0.

    Opens no connection that outlives the call: on Redis the connection's default channel is reused, and every
    queue's priority lists are read in one pipelined round trip; on another virtual transport, by passive declares
    on that channel (a failed one leaves a virtual channel usable); on AMQP the broker closes a channel whose passive
    declare fails, so the depths are read on a channel of their own, replaced after each such failure and closed
    after.
    """
    if isinstance(connection.transport, kombu_redis.Transport):
        return redis_depths(connection.default_channel, list(names))
    if isinstance(connection.transport, virtual.Transport):
        channel = connection.default_channel
        return {name: _depth(channel, name, connection.channel_errors) or 0 for name in names}
    return _amqp_depths(connection, names)


def _depth(channel: Any, name: str, missing: tuple[type[BaseException], ...]) -> int | None:
    """One queue's depth; None when the queue was never declared."""
    try:
        return int(channel.queue_declare(queue=name, passive=True).message_count)
    except missing:
        return None


def _amqp_depths(connection: Connection, names: Iterable[str]) -> dict[str, int]:
    channel = connection.channel()  # type: ignore[no-untyped-call]
    depths = {}
    try:
        for name in names:
            depth = _depth(channel, name, connection.channel_errors)
            if depth is None:  # the broker closed this channel: close our side of it and take a new one
                _close_quietly(channel)
                channel = connection.channel()  # type: ignore[no-untyped-call]
            depths[name] = depth or 0
    finally:
        _close_quietly(channel)
    return depths


def _close_quietly(channel: Any) -> None:
    try:
        channel.close()
    except Exception:  # already closed by the broker, or the connection is gone: nothing left to release
        log.debug("closing a depth channel failed", exc_info=True)


def redis_transport(broker_url: str) -> str | None:
    """The Celery app's `broker_transport` for this broker: stoker's on plain Redis, kombu's choice otherwise."""
    return REDIS_TRANSPORT if broker_url.split("://", 1)[0] in ("redis", "rediss") else None


def is_amqp(broker_url: str) -> bool:
    """Whether the broker speaks AMQP (RabbitMQ) rather than Redis."""
    return broker_url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")


def class_priority(broker_url: str, job_class: JobClass) -> int:
    """The broker priority of a job class's messages, so a worker takes an interactive job's before any batch
    line's on the same queue. Redis (kombu's priority steps, one list per step): 0 is taken first. RabbitMQ's quorum
    queues: two levels, above 4 taken first."""
    first = job_class == "interactive"
    if is_amqp(broker_url):
        return 9 if first else 0
    return SMALL if first else BATCH_PRIORITY


def stage_priority(broker_url: str, job_class: JobClass, size: SizeClass) -> int:
    """The broker priority of an input's stage messages: on Redis an interactive input's size class, so small
    inputs are taken before large ones (`promote_aged` bounds a large one's wait); a batch line's class priority.
    RabbitMQ's quorum queues have two levels only: the class."""
    if job_class != "interactive" or is_amqp(broker_url):
        return class_priority(broker_url, job_class)
    return size


def declare_queues(broker_url: str) -> list[Queue]:
    """The stage queues. On RabbitMQ they are quorum queues (replicated, durable, poison-aware); on Redis, lists."""
    return [stage_queue(broker_url, name) for name in (*QUEUES, SYNC_QUEUE, CALLBACK_QUEUE)]


def stage_queue(broker_url: str, name: str) -> Queue:
    """One stage queue, declared as `declare_queues` declares it."""
    arguments = {"x-queue-type": "quorum"} if is_amqp(broker_url) else None
    return Queue(name, routing_key=name, durable=True, queue_arguments=arguments)  # type: ignore[no-untyped-call]


def transport_options(broker_url: str, visibility_timeout_s: int, timeout_s: float | None = None) -> dict[str, Any]:
    """Broker transport options: publisher confirms on RabbitMQ; on Redis, redelivery of a dead worker's messages,
    and with `timeout_s` (the API's) a bound on connecting and on every answer, so a hung broker is an error."""
    if is_amqp(broker_url):
        return {"confirm_publish": True}
    bounded = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s} if timeout_s else {}
    return {
        "visibility_timeout": visibility_timeout_s,
        "priority_steps": PRIORITY_STEPS,
        # kombu sweeps for expired unacked messages only every interval × throttle seconds (100 by default) and
        # holds its sweep mutex up to 300 s if a sweeper died: sweep every 5 s, recover a dead sweeper's mutex in 30.
        "unacked_restore_interval": 5,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 30,
        **bounded,
    }


class PulledMessage:
    """A message taken from a queue by `PulledQueue.take`, held until it is acked or handed back (the `Message`
    seam of the inference consumer, as a Celery request is)."""

    def __init__(self, message: Any, lock: threading.Lock) -> None:
        self._message = message
        self._lock = lock
        self.kwargs: dict[str, Any] | None = task_kwargs(message.decode())
        self.id: str = str(message.headers.get(TASK_ID_HEADER))

    def acknowledge(self) -> None:
        """Done with: the broker forgets it (a connection lost meanwhile leaves it to the broker's redelivery)."""
        with self._lock:
            self._quietly(self._message.ack)

    def reject(self, requeue: bool = False) -> None:
        """Handed back: to its queue again, with requeue (else dropped)."""
        with self._lock:
            self._quietly(lambda: self._message.reject(requeue=requeue))

    def _quietly(self, settle: Callable[[], object]) -> None:
        try:
            settle()
        except Exception as exc:  # the channel is gone: the broker redelivers the message (visibility timeout)
            log.warning("could not settle message %s: %s", self.id, exc)


class PulledQueue:
    """One queue read a message at a time, when the reader has room, instead of consumed with a prefetch.

    Celery's consumer takes messages from every queue it consumes as long as its prefetch has room: a queue of
    low-priority work would fill that room and leave none for a higher-priority message published a moment later.
    Reading this queue directly (kombu's `Queue.get`, a `basic_get` on any transport) keeps its messages in the
    broker until the reader wants one. Taken messages are held unacked like a consumer's (redelivered if this
    process dies). One lock serialises the channel: a kombu channel is not safe across threads, and messages are
    settled from other threads than the one that took them.
    """

    def __init__(self, url: str, queue: Queue, **connection_options: Any) -> None:
        self.url = url
        self.queue = queue
        self.options = connection_options
        self._lock = threading.Lock()
        self._connection: Connection | None = None
        self._bound: Any = None

    def take(self) -> PulledMessage | None:
        """The next message waiting, or None when the queue is empty; raises while the broker does not answer.
        A message that is not a task message is dropped (rejected, never requeued) with an error logged."""
        while True:
            with self._lock:
                try:
                    message = self._open().get(no_ack=False, accept=["json"])
                except Exception:
                    self._drop()
                    raise
            if message is None:
                return None
            try:
                return PulledMessage(message, self._lock)
            except Exception:
                log.exception("dropping a message on %s that is not a task message", self.queue.name)
                with self._lock:
                    message.reject(requeue=False)

    def close(self) -> None:
        """Drop the connection (messages taken and not settled go back to the queue, as a consumer's would)."""
        with self._lock:
            self._drop()

    def _open(self) -> Any:
        """The queue bound to a channel of this reader's own connection (kombu's `Queue.get` turns what the
        transport hands over into a kombu message on any transport)."""
        if self._bound is None:
            self._connection = Connection(self.url, **self.options)  # type: ignore[no-untyped-call]
            self._bound = self.queue.bind(self._connection.channel())  # type: ignore[no-untyped-call]
            self._bound.declare()
        return self._bound

    def _drop(self) -> None:
        connection, self._connection, self._bound = self._connection, None, None
        if connection is not None:
            try:
                connection.release()  # type: ignore[no-untyped-call]
            except Exception:  # already broken: nothing left to release
                log.debug("releasing a pulled queue's connection failed", exc_info=True)
