"""What the consumer reads from a broker message (its job, its class, its size and deadline), and how messages are
taken from a source and handed back."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from queue import Empty, Queue

from stoker.core.batching import Waiting
from stoker.runtime.batches import BatchItem
from stoker.runtime.seams import LineSource, Message

log = logging.getLogger(__name__)


def as_waiting(request: Message, now: float) -> Waiting:
    """What the policy needs to know of a request: its size and deadline travel in the message."""
    kwargs = request.kwargs or {}
    tokens, deadline = kwargs.get("prompt_tokens"), kwargs.get("deadline")
    return Waiting(request.id, int(tokens or 0), now, float(deadline) if deadline else None, is_batch_line(request))


def is_batch_line(request: Message) -> bool:
    """Whether the message is a batch line's (background work), not an interactive request's."""
    return (request.kwargs or {}).get("job_class") == "batch"


def job_of(request: Message) -> str:
    """The job a message is for."""
    return str((request.kwargs or {}).get("job_id"))


def hand_back(items: Sequence[BatchItem]) -> None:
    """The items' messages go back to their queue."""
    hand_back_messages([item.message for item in items if item.message is not None])


def hand_back_messages(messages: Sequence[Message]) -> None:
    """The messages go back to their queue."""
    for message in messages:
        message.reject(requeue=True)


def take_lines(lines: LineSource, limit: int) -> list[Message]:
    """Up to `limit` batch lines waiting in their queue."""
    taken: list[Message] = []
    while len(taken) < limit:
        message = lines.take()
        if message is None:
            break
        taken.append(message)
    return taken


def take_arrived(buffer: Queue[Message], limit: int) -> list[Message]:
    """Up to `limit` messages a receiver has buffered, without waiting."""
    items: list[Message] = []
    while len(items) < limit:
        try:
            items.append(buffer.get_nowait())
        except Empty:
            break
    return items


def bring_in(
    what: str,
    take: Callable[[], Sequence[Message]],
    add: Callable[[Sequence[Message]], None],
    stopping: threading.Event,
) -> Sequence[Message]:
    """What `take` brings from the broker, handed over as arrivals (`add`); nothing while the broker is away (after a
    pause, so that a thread does not spin on it)."""
    try:
        taken = take()
    except Exception as exc:  # the broker is away: look again shortly
        log.warning("cannot take %s: %s", what, exc)
        stopping.wait(1.0)
        return []
    if taken:
        add(taken)
    return taken
