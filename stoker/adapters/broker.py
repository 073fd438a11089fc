"""Reading the broker's queues: how deep each one is, over any kombu transport (Redis, RabbitMQ)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kombu.connection import Connection
from kombu.entity import Queue
from kombu.transport import virtual

from stoker.core.jobs import JobClass
from stoker.core.queues import CALLBACK_QUEUE, QUEUES, SYNC_QUEUE

log = logging.getLogger(__name__)


def queue_depths(connection: Connection, names: Iterable[str] = QUEUES) -> dict[str, int]:
    """Messages waiting in each queue (not those a worker already holds); a queue never declared counts 0.

    Opens no connection that outlives the call: on Redis the connection's default channel is reused (a failed
    passive declare leaves a virtual channel usable); on AMQP the broker closes a channel whose passive declare
    fails, so the depths are read on a channel of their own, replaced after each such failure and closed after.
    """
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
    return 0 if first else 9


def declare_queues(broker_url: str) -> list[Queue]:
    """The stage queues. On RabbitMQ they are quorum queues (replicated, durable, poison-aware); on Redis, lists."""
    arguments = {"x-queue-type": "quorum"} if is_amqp(broker_url) else None
    return [
        Queue(name, routing_key=name, durable=True, queue_arguments=arguments)  # type: ignore[no-untyped-call]
        for name in (*QUEUES, SYNC_QUEUE, CALLBACK_QUEUE)
    ]


def transport_options(broker_url: str, visibility_timeout_s: int, timeout_s: float | None = None) -> dict[str, Any]:
    """Broker transport options: publisher confirms on RabbitMQ; on Redis, redelivery of a dead worker's messages,
    and with `timeout_s` (the API's) a bound on connecting and on every answer, so a hung broker is an error."""
    if is_amqp(broker_url):
        return {"confirm_publish": True}
    bounded = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s} if timeout_s else {}
    return {
        "visibility_timeout": visibility_timeout_s,
        # kombu sweeps for expired unacked messages only every interval × throttle seconds (100 by default) and
        # holds its sweep mutex up to 300 s if a sweeper died: sweep every 5 s, recover a dead sweeper's mutex in 30.
        "unacked_restore_interval": 5,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 30,
        **bounded,
    }
