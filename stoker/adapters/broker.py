"""The broker: its queues' declarations and depths over any kombu transport (Redis, RabbitMQ), and the Redis
transport every stoker process's Celery app uses on a Redis broker."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kombu.connection import Connection
from kombu.entity import Queue
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from stoker.core.costs import LARGE, MEDIUM, SMALL, SizeClass
from stoker.core.jobs import JobClass
from stoker.core.queues import CALLBACK_QUEUE, QUEUES, SYNC_QUEUE

log = logging.getLogger(__name__)
#: The Celery app's `broker_transport` on a Redis broker (`celeryconfig.connection`).
REDIS_TRANSPORT = "stoker.adapters.broker:RedisTransport"


class RedisQoS(kombu_redis.QoS):
    """kombu's Redis QoS, whose messages taken and acked on the consumer's event loop enter and leave the unacked
    index together, once per round of the loop.

    kombu puts each message it takes into the unacked index (`ZADD` + `HSET`) and takes each acked one out (`ZREM` +
    `HDEL`), each in a transaction of its own: two round trips per message, and kombu has no ack of many on this
    transport (the virtual channel ignores `multiple`). Celery takes messages and acks them on its event loop (a
    task's ack is a callback the loop runs), so what one round of the loop takes and acks is gathered here and
    written at the end of that round (`RedisTransport`'s tick), in one script (`_GATHERED`): the takes first, then
    each ack's removal. (The inference consumer reads its queue itself on Redis: `RedisIntake`.)

    - Until its round ends, a message just taken is in this process only, as it is in kombu between its `BRPOP` and
      its `ZADD`: a death then loses it either way. The round is one pass of the loop, a few hundred microseconds.
    - Until its round ends, an acked message is settled in this process but still in the index: a death then
      restores it after the visibility timeout, as a death just before its ack would, and its job, already ended,
      is skipped.
    - A message is restored (a reject that requeues it, the channel's close) only after what was gathered is
      written, since kombu restores from the index.
    - A take or an ack on any other thread is kombu's own, at once.
    - What is gathered is written under a lock, so a restore from another thread (a message handed back by the
      feeder) waits for a write the loop has begun."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._taken: list[tuple[Any, Any]] = []
        self._acked: list[Any] = []
        self._gathering = threading.Lock()
        self._gathered: Any = None  # the script that writes them (`_GATHERED`), registered on first use

    def _on_loop(self) -> bool:
        return threading.get_ident() == getattr(self.channel.connection, "loop_thread", None)

    def append(self, message: Any, delivery_tag: Any) -> None:
        if not self._on_loop():
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
            return
        with self._gathering:
            self._taken.append((message, delivery_tag))
        virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]  # kombu's, less its write

    def ack(self, delivery_tag: Any) -> None:
        if not self._on_loop():
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
            return
        with self._gathering:
            self._acked.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # kombu's Redis QoS, after its removal

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        self.write_gathered()  # kombu restores a message from the index: it must be there first
        super().restore_by_tag(tag, client, leftmost)  # type: ignore[no-untyped-call]

    def write_gathered(self) -> None:
        """Write what was taken and acked this round to the unacked index, in one round trip (on the loop's thread).

        A take is written as kombu's `append` writes it; kombu has no step that queues it onto a given pipeline."""
        with self._gathering:
            taken, self._taken = self._taken, []
            acked, self._acked = self._acked, []
            self._write(taken, acked)

    def _write(self, taken: list[tuple[Any, Any]], acked: list[Any]) -> None:
        if not taken and not acked:
            return
        args: list[Any] = [repr(time.time()), len(taken)]
        for message, tag in taken:
            route = (message.delivery_info["exchange"], message.delivery_info["routing_key"])
            args += [tag, dumps([message._raw, *route])]  # type: ignore[no-untyped-call]
        args += acked
        try:
            client = self.channel._create_client()  # the channel's one client over its current pool
            if self._gathered is None:
                self._gathered = client.register_script(_GATHERED)
            self._gathered(keys=[self.unacked_index_key, self.unacked_key], args=args, client=client)
        except Exception as exc:  # takes unwritten: lost only if this process dies before they end; acks: below
            log.warning("could not write %d takes and %d acks to the unacked index: %s", len(taken), len(acked), exc)


# kombu's unacked index, as the scripts below write it (KEYS[1] the index, KEYS[2] the hash): a message held as
# kombu's `append` holds it (`ZADD` of its tag, when; `HSET` of [message, exchange, routing key] under the tag), and
# let go of as kombu's `_remove_from_indices` lets go (`ZREM`, `HDEL`).
_UNACKED = """
local function hold_tag(tag, at, entry)
  redis.call('ZADD', KEYS[1], at, tag)
  redis.call('HSET', KEYS[2], tag, entry)
end
local function let_go(tag)
  redis.call('ZREM', KEYS[1], tag)
  redis.call('HDEL', KEYS[2], tag)
end
"""

# A round's takes into kombu's unacked index and its acks out of it, in one step. One command where a transaction
# of four had each command's answer read and parsed on its own: a Celery worker's event loop writes this once per
# round. KEYS: the unacked index, the unacked hash. ARGV: now, takes (n), n × (tag, entry), acked tags…
_GATHERED = (
    _UNACKED
    + """
local n = tonumber(ARGV[2])
for i = 3, 1 + 2 * n, 2 do hold_tag(ARGV[i], ARGV[1], ARGV[i + 1]) end
for i = 3 + 2 * n, #ARGV do let_go(ARGV[i]) end
return 1
"""
)


class RedisChannel(kombu_redis.Channel):
    """kombu's Redis channel, with one client per connection pool instead of a new one for every command.

    kombu builds a fresh `redis.Redis` (whose constructor fills a table of a few hundred response callbacks) for
    each publish, each message's place in the unacked index, each ack: with redis-py 5+ that was the largest single
    CPU cost of the inference worker per job, and a part of every publish of the API. A client over a pool is safe
    to share between threads (each command takes a connection from the pool), so one per pool serves them all;
    when kombu replaces its pool (after a connection error), a new client is made for the new pool. Acks made on
    the event loop go to the broker together (`RedisQoS`)."""

    QoS = RedisQoS

    def close(self) -> None:
        """Write the takes and acks gathered so far to the unacked index, then close as kombu does."""
        self.write_gathered()
        super().close()  # type: ignore[no-untyped-call]

    def write_gathered(self) -> None:
        """The gathered takes and acks to the unacked index (`RedisQoS`), if this channel's QoS was ever made."""
        qos = self.__dict__.get("_qos")  # kombu makes it on first use: not made here for nothing
        if isinstance(qos, RedisQoS):
            qos.write_gathered()

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[no-untyped-call]
        pool = self.pool
        client = self.__dict__.get("_shared_client")
        if client is None or client.connection_pool is not pool:
            client = self.__dict__["_shared_client"] = super()._create_client()  # type: ignore[no-untyped-call]
        return client


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport over `RedisChannel`; on an event loop, the takes and acks of each round go out
    together."""

    Channel = RedisChannel
    #: The thread of the event loop this transport consumes on (None: none), whose takes and acks are gathered.
    loop_thread: int | None = None

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)  # type: ignore[no-untyped-call]

        def at_each_round() -> None:  # a hub's tick runs on its loop's thread, after the round's callbacks
            self.loop_thread = threading.get_ident()
            for channel in list(self.channels):
                channel.write_gathered()

        loop.on_tick.add(at_each_round)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def queue_depths(connection: Connection, names: Iterable[str] = QUEUES) -> dict[str, int]:
    """Messages waiting in each queue (not those a worker already holds); a queue never declared counts 0.

    Opens no connection that outlives the call: on Redis the connection's default channel is reused, and every
    queue's priority lists are read in one pipelined round trip; on another virtual transport, by passive declares
    on that channel (a failed one leaves a virtual channel usable); on AMQP the broker closes a channel whose passive
    declare fails, so the depths are read on a channel of their own, replaced after each such failure and closed
    after.
    """
    if isinstance(connection.transport, kombu_redis.Transport):
        return _redis_depths(connection.default_channel, list(names))
    if isinstance(connection.transport, virtual.Transport):
        channel = connection.default_channel
        return {name: _depth(channel, name, connection.channel_errors) or 0 for name in names}
    return _amqp_depths(connection, names)


def _redis_depths(channel: Any, names: list[str]) -> dict[str, int]:
    """Every queue's depth in one round trip: the lengths of its priority lists, summed (kombu's passive declare
    reads the same lists, but two round trips per queue; the API, the batch feeder and the inference worker each
    sample every queue twice a second under load, and every few seconds while idle)."""
    lists = {name: priority_keys(name) for name in names}
    with channel.conn_or_acquire() as client:
        pipe = client.pipeline(transaction=False)
        for keys in lists.values():
            for key in keys:
                pipe.llen(key)
        lengths = iter(pipe.execute())
    return {name: sum(next(lengths) for _ in keys) for name, keys in lists.items()}


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


#: kombu's priority steps on Redis (a list per step and queue; a worker's BRPOP takes every queue's step 0 before
#: any queue's step 1): an interactive input's size class (0 small, 1 medium, 2 large), then batch lines.
SIZE_STEPS = [SMALL, MEDIUM, LARGE]
BATCH_PRIORITY = 9
PRIORITY_STEPS = [*SIZE_STEPS, BATCH_PRIORITY]


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


#: The age bound of small-before-large, as one script so no worker takes a message halfway through its move. KEYS
#: come in threes, one per queue: its first list (the one a worker's BRPOP takes from first), then its medium and
#: large inputs' lists. While the oldest message of a medium or large list has waited `bound` seconds since it was
#: sent (its stoker_sent header), it goes to the front of the first list, oldest first. kombu has no such thing:
#: its priorities are strict, so a steady flow of small inputs would hold a large one back for as long as it lasts.
_PROMOTE_AGED = """
local now, bound, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local moved = 0
for q = 1, #KEYS, 3 do
  local aged = {}
  for i = q + 1, q + 2 do
    while #aged < most do
      local raw = redis.call('LINDEX', KEYS[i], -1)
      if not raw then break end
      local ok, message = pcall(cjson.decode, raw)
      local sent = ok and type(message) == 'table' and type(message.headers) == 'table'
        and tonumber(message.headers.stoker_sent)
      if not sent or now - sent < bound then break end
      table.insert(aged, redis.call('RPOP', KEYS[i]))
    end
  end
  for i = #aged, 1, -1 do redis.call('RPUSH', KEYS[q], aged[i]) end
  moved = moved + #aged
end
return moved
"""


def promote_aged(connection: Connection, queues: Iterable[str], max_age_s: float, now: float, most: int = 100) -> int:
    """Move medium and large inputs' stage messages that waited `max_age_s` to the front of their queues, in one
    round trip (Redis; RabbitMQ's quorum queues carry no size classes, so nothing waits behind one there). How many
    moved."""
    if not isinstance(connection.transport, kombu_redis.Transport):
        return 0
    keys = [key for queue in queues for key in priority_keys(queue)[: len(SIZE_STEPS)]]
    # EVALSHA (redis-py loads the script once): the deployment's ACL allows no plain EVAL.
    script = connection.default_channel.client.register_script(_PROMOTE_AGED)  # type: ignore[attr-defined]
    return int(script(keys=keys, args=[now, max_age_s, most]))


def priority_keys(queue: str) -> list[str]:
    """A queue's Redis lists, one per priority step in `PRIORITY_STEPS`' order (kombu's names: the first is the
    queue's own name); its depth is their lengths together."""
    return [f"{queue}{kombu_redis.Channel.sep}{step}" if step else queue for step in PRIORITY_STEPS]


class PulledMessage:
    """A message taken from a queue by `PulledQueue.take`, held until it is acked or handed back (the `Message`
    seam of the inference consumer, as a Celery request is)."""

    def __init__(self, message: Any, lock: threading.Lock) -> None:
        self._message = message
        self._lock = lock
        _, kwargs, _ = message.decode()  # Celery's message protocol 2: [args, kwargs, embed]
        self.kwargs: dict[str, Any] | None = kwargs
        self.id: str = str(message.headers.get("id"))

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
    own: about half of the inference worker's CPU per job on a fast device. Here one script (`_TAKE`) takes what
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
        self._client: Any = channel._create_client()  # type: ignore[attr-defined]  # a plain one, over its pool
        self._keys = [channel.unacked_index_key, channel.unacked_key]  # type: ignore[attr-defined]
        self._lists = priority_keys(queue)
        self._take = self._client.register_script(_TAKE)
        self._back = self._client.register_script(_HAND_BACK)
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
        """One `_TAKE`: the carried message (if any) and up to `most` more held, the acked let go."""
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
        """`_HAND_BACK`: out of the unacked index, and back to the front of its list unless `raw` is None."""
        pushed = [] if raw is None else [raw]
        try:
            self._back(keys=[*self._keys, self._lists[from_list]], args=[tag, *pushed])
        except Exception as exc:  # the index still holds it: kombu's sweep restores it after the visibility timeout
            log.warning("could not let go of message %s: %s", tag, exc)

    def _message(self, raw: bytes, from_list: int, tag: str) -> IntakeMessage:
        """Celery's message protocol 2 as the API and Celery publish it: a JSON envelope whose body, base64, is
        [args, kwargs, embed]."""
        envelope = json.loads(raw)
        if envelope.get("content-type") != "application/json":
            raise ValueError(f"content type {envelope.get('content-type')!r}")
        body = envelope["body"]
        if envelope["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        _, kwargs, _ = json.loads(body)
        return IntakeMessage(self, raw, from_list, tag, str(envelope["headers"]["id"]), kwargs)


# The intake's round trip: a message a BRPOP already took (if any) and then up to `most` more, oldest first from
# the queue's priority lists in order, each put into kombu's unacked index as kombu's `append` puts it (`ZADD` of
# its delivery tag, now; `HSET` of [message, exchange, routing key] under the tag); then the acks gathered since the
# last round trip, out of the index as kombu's `_remove_from_indices` takes them. A message whose envelope is not
# JSON is returned unindexed, under an empty tag, for the reader to drop.
# KEYS: the unacked index, the unacked hash, the queue's lists. ARGV: now, most, carried (0 or 1), [list index,
# message], acked tags… Returns list index, tag, message for each message taken.
_TAKE = (
    _UNACKED
    + """
local now, most, carried = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local taken = {}
local function hold(list, raw)
  local ok, m = pcall(cjson.decode, raw)
  local tag = ok and type(m) == 'table' and type(m.properties) == 'table' and m.properties.delivery_tag
  if type(tag) == 'string' then
    local info = m.properties.delivery_info or {}
    hold_tag(tag, now,
      '[' .. raw .. ',' .. cjson.encode(info.exchange or '') .. ',' .. cjson.encode(info.routing_key or '') .. ']')
  else
    tag = ''
  end
  table.insert(taken, list); table.insert(taken, tag); table.insert(taken, raw)
end
if carried == 1 then hold(tonumber(ARGV[4]), ARGV[5]) end
local left = most
for i = 3, #KEYS do
  while left > 0 do
    local raw = redis.call('RPOP', KEYS[i])
    if not raw then break end
    hold(i - 3, raw)
    left = left - 1
  end
end
for i = 4 + 2 * carried, #ARGV do let_go(ARGV[i]) end
return taken
"""
)

# A message handed back: out of kombu's unacked index, and (with ARGV[2]) to the front of its list (the end a
# reader pops next), as kombu's `restore_by_tag` puts it. KEYS: the unacked index, the unacked hash, the list.
# ARGV: tag, [message].
_HAND_BACK = (
    _UNACKED
    + """
let_go(ARGV[1])
if ARGV[2] then redis.call('RPUSH', KEYS[3], ARGV[2]) end
return 1
"""
)
