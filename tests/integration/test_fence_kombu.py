"""The kombu fence (`stoker.adapters.kombu_redis`) against the installed kombu on a real Redis: what stoker writes
into kombu's unacked index is what kombu writes there for the same message, and what it pushes for a publish is
what kombu's channel pushes. A kombu release that changes either fails here, naming what changed."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu.connection import Connection
from kombu.transport import redis as kombu_redis

from stoker.adapters.broker import transport_options
from stoker.adapters.kombu_redis import RedisTransport, priority_keys, queued_publish, unacked_keys
from stoker.adapters.redis_intake import RedisIntake

#: A database no other test uses: the lists and the index here are this module's alone.
FENCE_DB = 12
QUEUE = "fence"
#: A protocol-2 body, as the intake reads one.
BODY = '[[], {"job_id": "j"}, {}]'


@pytest.fixture
def broker_url() -> Iterator[str]:
    url = f"{os.environ['STOKER_TEST_REDIS']}/{FENCE_DB}"
    redis.Redis.from_url(url).flushdb()
    yield url
    redis.Redis.from_url(url).flushdb()


def _message(channel: Any, tag: str, priority: int = 0) -> Any:
    """A message as kombu's consumer would hold it: its envelope, delivery info and tag."""
    payload = channel.prepare_message(BODY, priority, "application/json", "utf-8", {"id": tag})
    payload["properties"].update(delivery_tag=tag, delivery_info={"exchange": "", "routing_key": QUEUE})
    return channel.message_to_python(payload)


def _index(client: redis.Redis[bytes], keys: list[str], tag: str) -> tuple[bool, Any]:
    """Whether the tag is in kombu's unacked index, and its entry in the unacked hash (parsed)."""
    entry = client.hget(keys[1], tag)
    return client.zscore(keys[0], tag) is not None, None if entry is None else json.loads(entry)


def test_the_gathered_takes_and_acks_write_the_index_as_kombu_does(broker_url: str) -> None:
    client = redis.Redis.from_url(broker_url)
    with Connection(broker_url) as plain, Connection(broker_url, transport=RedisTransport) as ours:  # type: ignore[no-untyped-call]
        kombus, mine = plain.default_channel, ours.default_channel
        assert type(kombus.qos) is kombu_redis.QoS
        keys = unacked_keys(mine)
        assert keys == unacked_keys(kombus)
        kombus.qos.append(_message(kombus, "by-kombu"), "by-kombu")  # type: ignore[no-untyped-call]  # kombu is unannotated
        ours.transport.loop_thread = threading.get_ident()  # as if on the consumer's loop: gathered, then written
        mine.qos.append(_message(mine, "by-stoker"), "by-stoker")
        assert _index(client, keys, "by-stoker") == (False, None)  # gathered, not written yet
        mine.write_gathered()
        held_by_kombu, entry_by_kombu = _index(client, keys, "by-kombu")
        held, entry = _index(client, keys, "by-stoker")
        assert (held_by_kombu, held) == (True, True), "kombu's QoS.append no longer indexes a message by its tag"
        entry_by_kombu[0]["properties"]["delivery_tag"] = entry[0]["properties"]["delivery_tag"]
        entry_by_kombu[0]["headers"]["id"] = entry[0]["headers"]["id"]
        assert entry == entry_by_kombu, "kombu's QoS.append now writes another entry into the unacked hash"
        kombus.qos.ack("by-kombu")  # type: ignore[no-untyped-call]  # kombu is unannotated
        mine.qos.ack("by-stoker")
        mine.write_gathered()
        assert _index(client, keys, "by-kombu") == _index(client, keys, "by-stoker") == (False, None)


def test_the_intake_holds_a_message_as_kombus_append_does(broker_url: str) -> None:
    client = redis.Redis.from_url(broker_url)
    with Connection(broker_url) as plain:  # type: ignore[no-untyped-call]
        channel = plain.default_channel
        message = _message(channel, "intake-tag")
        channel.qos.append(message, "by-kombu")
        client.lpush(priority_keys(QUEUE)[0], json.dumps(message._raw))
        intake = RedisIntake(broker_url, QUEUE, transport_options=transport_options(broker_url, 3600))
        try:
            taken = intake.take(1, block_s=1.0)
        finally:
            intake.close()
        keys = unacked_keys(channel)
        assert [m.id for m in taken] == ["intake-tag"]
        assert _index(client, keys, "intake-tag") == _index(client, keys, "by-kombu")


def test_a_queued_publish_is_what_kombus_channel_pushes(broker_url: str) -> None:
    client = redis.Redis.from_url(broker_url)
    options = transport_options(broker_url, 3600)
    with Connection(broker_url, transport=RedisTransport, transport_options=options) as connection:  # type: ignore[no-untyped-call]
        channel = connection.default_channel
        payload = channel.prepare_message(BODY, 2, "application/json", "utf-8", {"id": "x"})
        commands = queued_publish(channel, payload, QUEUE)
        assert [(command, args[0]) for command, args in commands] == [("lpush", priority_keys(QUEUE)[2])]
        assert client.keys("*") == []  # queued, not run
        channel.basic_publish(channel.prepare_message(BODY, 2, "application/json", "utf-8", {"id": "x"}), "", QUEUE)
        pushed = client.lrange(priority_keys(QUEUE)[2], 0, -1)
    queued, published = json.loads(commands[0][1][1]), json.loads(pushed[0])
    assert len(pushed) == 1
    queued["properties"].pop("delivery_tag")
    published["properties"].pop("delivery_tag")
    assert queued == published, "kombu's channel now pushes another message for a publish"
