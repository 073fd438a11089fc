"""Reading the broker's queues: how deep each one is, over any kombu transport (Redis, RabbitMQ)."""

from __future__ import annotations

from collections.abc import Iterable

from kombu.connection import Connection

#: Every queue stoker's workers consume, in pipeline order (celeryconfig routes tasks onto them).
QUEUES = ("decode", "ocr", "asr", "tokenize", "infer")
CPU_QUEUES = ("decode", "ocr", "asr", "tokenize")


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
