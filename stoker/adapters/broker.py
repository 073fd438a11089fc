"""Reading the broker's queues: how deep each one is, over any kombu transport (Redis, RabbitMQ)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kombu.connection import Connection
from kombu.entity import Queue

from stoker.core.queues import CALLBACK_QUEUE, QUEUES, SYNC_QUEUE


def queue_depths(connection: Connection, names: Iterable[str] = QUEUES) -> dict[str, int]:
    """Messages waiting in each queue (not those a worker already holds); a queue never declared counts 0."""
    channel = connection.default_channel
    depths = {}
    for name in names:
        try:
            depths[name] = int(channel.queue_declare(queue=name, passive=True).message_count)  # type: ignore[no-untyped-call]
        except connection.channel_errors:  # not declared yet (RabbitMQ): nothing waits in it
            channel = connection.channel()  # type: ignore[no-untyped-call]
            depths[name] = 0
    return depths


def is_amqp(broker_url: str) -> bool:
    """Whether the broker speaks AMQP (RabbitMQ) rather than Redis."""
    return broker_url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")


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
