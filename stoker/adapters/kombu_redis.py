"""Fence: kombu's Redis transport, where stoker mirrors what kombu keeps private. The one module that knows it.

Mirrors kombu 5.7 (`KOMBU_VERSIONS`; written against 5.7.0). `tests/unit/test_fence_kombu.py` and
`tests/integration/test_fence_kombu.py` check each thing below against the installed kombu and fail, naming it, on a
release that changes it:

- the unacked index: a message taken is held as `QoS.append` holds it (`ZADD` of its delivery tag at the time
  taken into `Channel.unacked_index_key`, `HSET` of `[message, exchange, routing key]` under the tag into
  `Channel.unacked_key`) and let go of as `QoS._remove_from_indices` lets go (`ZREM`, `HDEL`); kombu's sweep
  restores from there whatever outlives the visibility timeout, and `QoS.restore_by_tag` puts it back on the front
  of its list (`RPUSH`). The scripts `_GATHERED`, `TAKE_SCRIPT` and `HAND_BACK_SCRIPT` write it so, and `RedisQoS`
  overrides `append`, `ack` and `restore_by_tag` to gather what kombu writes one message at a time;
- the priority lists: one list per step of `priority_steps`, named `queue + Channel.sep + step` (step 0: the queue's
  own name), a message pushed by `LPUSH` and taken by `BRPOP`/`RPOP` from the right, every queue's first step before
  any queue's next (`priority_keys`, `redis_depths`, `promote_aged`, and the inference intake's scripts);
- the envelope on a list: kombu's JSON with `properties.delivery_tag`, `properties.delivery_info` (`exchange`,
  `routing_key`), `properties.body_encoding` and the body (read by `TAKE_SCRIPT` and `open_envelope`);
- the channel's client, pool and QoS (`Channel._create_client`, `Channel.pool`, `Channel._qos`) and the transport's
  event-loop hook (`Transport.register_with_event_loop`, the hub's `on_tick`), which `RedisChannel` and
  `RedisTransport` override;
- the channel's one `BRPOP` in flight (`Channel._in_poll`, cleared by `_brpop_read`), which `unread_brpop` reads;
- the publish seam `_publish_batch` of `Channel._put`, whose commands `queued_publish` collects.
"""

from __future__ import annotations

import base64
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from kombu.connection import Connection
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from stoker.core.costs import LARGE, MEDIUM, SMALL

log = logging.getLogger(__name__)

#: The kombu releases this module mirrors: a release outside them fails `tests/unit/test_fence_kombu.py` until
#: every check there passes on it and this range is widened.
KOMBU_VERSIONS = ">=5.7,<5.8"
#: The Celery app's `broker_transport` on a Redis broker (`celeryconfig.connection`).
REDIS_TRANSPORT = "stoker.adapters.kombu_redis:RedisTransport"

#: kombu's priority steps on Redis (a list per step and queue; a worker's BRPOP takes every queue's step 0 before
#: any queue's step 1): an interactive input's size class (0 small, 1 medium, 2 large), then batch lines.
SIZE_STEPS = [SMALL, MEDIUM, LARGE]
BATCH_PRIORITY = 9
PRIORITY_STEPS = [*SIZE_STEPS, BATCH_PRIORITY]


class RedisQoS(kombu_redis.QoS):
    """kombu's Redis QoS, whose messages taken and acked on the consumer's event loop enter and leave the unacked
    index together, once per round of the loop.

    kombu puts each message it takes into the unacked index (`ZADD` + `HSET`) and takes each acked one out (`ZREM` +
    `HDEL`), each in a transaction of its own: two round trips per message, and kombu has no ack of many on this
    transport (the virtual channel ignores `multiple`). Celery takes messages and acks them on its event loop (a
    task's ack is a callback the loop runs), so what one round of the loop takes and acks is gathered here and
    written at the end of that round (`RedisTransport`'s tick), in one script (`_GATHERED`): the takes first, then
    each ack's removal. (The inference consumer reads its queue itself on Redis:
    `stoker.adapters.redis_intake.RedisIntake`.)

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


def redis_depths(channel: Any, names: list[str]) -> dict[str, int]:
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


def unacked_keys(channel: Any) -> list[str]:
    """The channel's unacked index and unacked hash, the keys the scripts here take as KEYS[1] and KEYS[2]."""
    return [channel.unacked_index_key, channel.unacked_key]


def plain_client(channel: Any) -> Any:
    """A redis-py client over the channel's connection pool (one every thread shares, on `RedisChannel`)."""
    return channel._create_client()


def open_envelope(raw: bytes) -> tuple[dict[str, Any], Any]:
    """kombu's envelope of a message on a Redis list (JSON, the body base64 where its properties say so): its
    headers and its body, decoded from JSON. Raises on anything else."""
    envelope = json.loads(raw)
    if envelope.get("content-type") != "application/json":
        raise ValueError(f"content type {envelope.get('content-type')!r}")
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    return envelope["headers"], json.loads(body)


# The inference intake's round trip (`stoker.adapters.redis_intake.RedisIntake`): a message a BRPOP already took
# (if any) and then up to `most` more, oldest first from the queue's priority lists in order, each put into kombu's
# unacked index as kombu's `append` puts it (`ZADD` of its delivery tag, now; `HSET` of [message, exchange, routing
# key] under the tag); then the acks gathered since the last round trip, out of the index as kombu's
# `_remove_from_indices` takes them. A message whose envelope is not
# JSON is returned unindexed, under an empty tag, for the reader to drop.
# KEYS: the unacked index, the unacked hash, the queue's lists. ARGV: now, most, carried (0 or 1), [list index,
# message], acked tags… Returns list index, tag, message for each message taken.
TAKE_SCRIPT = (
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
HAND_BACK_SCRIPT = (
    _UNACKED
    + """
let_go(ARGV[1])
if ARGV[2] then redis.call('RPUSH', KEYS[3], ARGV[2]) end
return 1
"""
)


def unread_brpop(consumer: Any, queue: str) -> socket.socket | None:
    """The socket of a `BRPOP` the consumer sent for `queue` and has not read the reply of (None: none).

    A kombu Redis channel has at most one `BRPOP` out, for its `active_queues`, and keeps the connection it went out
    on in `_in_poll` until the event loop reads its reply (`_brpop_read`)."""
    transport = getattr(getattr(consumer, "connection", None), "transport", None)
    if not isinstance(transport, kombu_redis.Transport):
        return None
    for channel in transport.channels:
        connection = channel._in_poll
        if connection and queue in channel.active_queues:
            sock: socket.socket | None = connection._sock
            return sock
    return None


def reply_waits(sock: socket.socket) -> bool:
    """Whether a reply waits on the socket, left unread (the event loop reads it when it sees it readable)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class _Commands:
    """What kombu's Redis channel would run for a publish, queued instead (its `_publish_batch`)."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, tuple[Any, ...]]] = []

    def add(self, command: str, *args: Any) -> None:
        self.commands.append((command, args))


def queued_publish(channel: Any, message: Any, queue: str) -> list[tuple[str, tuple[Any, ...]]]:
    """The Redis commands kombu's channel runs to publish a prepared message to `queue` (by the anonymous
    exchange), queued instead of run: kombu's channel still decides what is pushed, and where. Its publish, given a
    batch (`_publish_batch`, the seam kombu's own bulk publishing uses), queues its commands there."""
    batch = _Commands()
    channel.basic_publish(message, "", queue, _publish_batch=batch)
    if not batch.commands:  # a kombu without the seam would have pushed it itself: none would be queued
        raise RuntimeError("kombu's channel queued no command for the message")
    return batch.commands
