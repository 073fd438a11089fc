"""The inference queue read straight from its Redis lists (`RedisIntake`), many messages per round trip, held in
kombu's unacked index as kombu holds its own. What it mirrors of kombu (the index, the lists, the envelope, the
scripts that write them) is fenced in `stoker.adapters.kombu_redis`."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kombu.connection import Connection

from stoker.adapters.celery_protocol import task_id, task_kwargs
from stoker.adapters.kombu_redis import (
    HAND_BACK_SCRIPT,
    TAKE_SCRIPT,
    open_envelope,
    plain_client,
    priority_keys,
    unacked_keys,
)

log = logging.getLogger(__name__)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class IntakeMessage:
    """A message `RedisIntake.take` took, held in the unacked index until it is acked or handed back (the
    `Message` seam of the inference consumer)."""

    __slots__ = ("_intake", "_list", "_raw", "_tag", "id", "kwargs")

    def __init__(self, intake: RedisIntake, raw: bytes, from_list: int, tag: str, id: str, kwargs: dict[str, Any]):
        self._intake = intake
        self._raw = raw
        self._list = from_list
        self._tag = tag
        self.id = id
        self.kwargs: dict[str, Any] | None = kwargs

    def acknowledge(self) -> None:
        """Done with: out of the unacked index with the intake's next round trip (`RedisIntake.settle`)."""
        self._intake.settle(self._tag)

    def reject(self, requeue: bool = False) -> None:
        """Handed back to the front of the list it came from (with requeue), or dropped; at once."""
        self._intake.hand_back(self._tag, self._raw if requeue else None, self._list)


class RedisIntake:
    """The inference queue read straight from its Redis lists: every message waiting, up to the reader's room, in
    one round trip, instead of one message per round of Celery's event loop.

    Through Celery, each inference message cost the consumer a `BRPOP` registered anew on every round of kombu's
    event loop, kombu's and Celery's message objects, a task strategy and a script into the unacked index of its
    own: about half of the inference worker's CPU per job on a fast device. Here one script (`TAKE_SCRIPT`) takes what
    waits (the queue's priority lists in kombu's order) and puts each message into kombu's unacked index as kombu
    itself does (the same keys and entries: kombu's sweep in any worker restores a dead reader's messages after the
    visibility timeout, as it would its own); acks gathered since the last round trip leave the index in the same
    script. While nothing waits, a `BRPOP` blocks for the next message, which the following script indexes: between
    the two, as between kombu's own `BRPOP` and its index write, a death loses it (the reaper sends its job again);
    a broker that fails the script leaves it in this process, held by the next call's script.

    An ack is written with the next take, or within `block_s` when no message comes: until then a death restores
    an acked message after the visibility timeout, whose job, already ended, is skipped. A message handed back goes
    to the front of its list at once. Redis only: kombu has no batched read on any transport, and RabbitMQ brokers
    keep Celery's consumer (`tasks.inference.Feed`)."""

    def __init__(self, url: str, queue: str, **connection_options: Any) -> None:
        self._connection = Connection(url, **connection_options)  # type: ignore[no-untyped-call]
        channel = self._connection.default_channel
        self._client: Any = plain_client(channel)
        self._keys = unacked_keys(channel)
        self._lists = priority_keys(queue)
        self._take = self._client.register_script(TAKE_SCRIPT)
        self._back = self._client.register_script(HAND_BACK_SCRIPT)
        self._settling = threading.Condition()
        self._acked: list[str] = []
        self._held: set[str] = set()
        self._more = False  # the last round took all it had room for: look again before blocking
        #: A message the last `BRPOP` popped, until a script holds it: [its list's index, the message] or [].
        self._carried: list[Any] = []

    @property
    def held(self) -> int:
        """Messages taken and neither acked nor handed back."""
        with self._settling:
            return len(self._held)

    def wait_below(self, most: int, timeout_s: float) -> int:
        """Wait until fewer than `most` messages are held (at most `timeout_s`); how many are held."""
        with self._settling:
            self._settling.wait_for(lambda: len(self._held) < most, timeout_s)
            return len(self._held)

    def take(self, most: int, block_s: float) -> list[IntakeMessage]:
        """Up to `most` messages, waiting up to `block_s` for the first; [] when none came. Raises while the broker
        does not answer (what was gathered to ack stays gathered; a message popped and not yet held is held by
        the next call, not lost with this one)."""
        if most < 1:
            return []
        if not self._more and not self._carried:  # the last round emptied the queue: wait for the next message
            popped = self._client.brpop(self._lists, timeout=max(block_s, 0.001))
            self._carried = [] if popped is None else [self._lists.index(_text(popped[0])), popped[1]]
        carried = self._carried
        with self._settling:
            acked, self._acked = self._acked, []
        if not carried and not acked and not self._more:
            return []
        try:
            found = self._round(most - len(carried) // 2, carried, acked)
        except Exception:
            with self._settling:
                self._acked[:0] = acked
            raise
        self._carried = []
        self._more = len(found) // 3 >= most  # it filled the room: more may wait
        return self._messages(found)

    def settle(self, tag: str) -> None:
        """An ack: the message leaves the unacked index with the next round trip."""
        with self._settling:
            if tag in self._held:
                self._held.discard(tag)
                self._acked.append(tag)
                self._settling.notify_all()

    def hand_back(self, tag: str, raw: bytes | None, from_list: int) -> None:
        """Out of the unacked index, and back to the front of its list unless `raw` is None (dropped)."""
        with self._settling:
            if tag not in self._held:
                return
            self._held.discard(tag)
            self._settling.notify_all()
        self._let_go(tag, from_list, raw)

    def close(self) -> None:
        """Write the acks gathered so far, and let go of the broker."""
        with self._settling:
            acked, self._acked = self._acked, []
        try:
            if self._carried:  # popped, never held: back to the front of its list
                from_list, raw = self._carried
                self._client.rpush(self._lists[from_list], raw)
                self._carried = []
            if acked:
                self._round(0, [], acked)
        except Exception as exc:  # acks left in the index: restored after the visibility timeout, and skipped
            log.warning("could not write %d acks or hand a message back: %s", len(acked), exc)
        finally:
            self._connection.release()  # type: ignore[no-untyped-call]

    def _round(self, most: int, carried: list[Any], acked: list[str]) -> list[Any]:
        """One `TAKE_SCRIPT`: the carried message (if any) and up to `most` more held, the acked let go."""
        args = [repr(time.time()), most, len(carried) // 2, *carried, *acked]
        return list(self._take(keys=[*self._keys, *self._lists], args=args))

    def _messages(self, found: list[Any]) -> list[IntakeMessage]:
        """The script's answer (list index, tag, raw message, …) as messages; one that is no task message is
        dropped with an error logged."""
        messages = []
        for at in range(0, len(found), 3):
            from_list, tag, raw = int(found[at]), _text(found[at + 1]), found[at + 2]
            try:
                if not tag:
                    raise ValueError("no delivery tag")
                message = self._message(raw, from_list, tag)
            except Exception:
                log.exception("dropping a message on %s that is not a task message", self._lists[0])
                if tag:  # indexed: out of the index, not back to the queue
                    self._let_go(tag, from_list, None)
                continue
            with self._settling:
                self._held.add(tag)
            messages.append(message)
        return messages

    def _let_go(self, tag: str, from_list: int, raw: bytes | None) -> None:
        """`HAND_BACK_SCRIPT`: out of the unacked index, and back to the front of its list unless `raw` is None."""
        pushed = [] if raw is None else [raw]
        try:
            self._back(keys=[*self._keys, self._lists[from_list]], args=[tag, *pushed])
        except Exception as exc:  # the index still holds it: kombu's sweep restores it after the visibility timeout
            log.warning("could not let go of message %s: %s", tag, exc)

    def _message(self, raw: bytes, from_list: int, tag: str) -> IntakeMessage:
        """kombu's envelope (`open_envelope`) around a Celery task message as the API and Celery publish it."""
        headers, body = open_envelope(raw)
        return IntakeMessage(self, raw, from_list, tag, task_id(headers), task_kwargs(body))
