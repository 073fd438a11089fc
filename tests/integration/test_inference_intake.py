"""The inference queue read straight from Redis (`RedisIntake`): messages as Celery and the API publish them, in
kombu's order, held in kombu's own unacked index (so kombu's sweep restores a dead reader's), acked and handed
back; against a real Redis."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from kombu.connection import Connection

from stoker.adapters.broker import redis_transport, transport_options
from stoker.adapters.redis_intake import IntakeMessage, RedisIntake
from stoker.core.queues import INFER_QUEUE
from stoker.settings import ApiSettings
from tasks.app import make_app
from tasks.pipeline import infer_signature
from tasks.publish import DirectPublisher
from tests.fleet import Fleet
from workers.procs import wait_for

#: A database no other test uses: the queue and the index here are this module's alone.
INTAKE_DB = 3


@pytest.fixture
def broker_url() -> Iterator[str]:
    url = f"{os.environ['STOKER_TEST_REDIS']}/{INTAKE_DB}"
    redis.Redis.from_url(url).flushdb()
    yield url
    redis.Redis.from_url(url).flushdb()


@pytest.fixture
def broker(broker_url: str) -> Iterator[redis.Redis[bytes]]:
    client = redis.Redis.from_url(broker_url)
    yield client
    client.close()


def _intake(url: str, visibility_timeout_s: int = 3600) -> RedisIntake:
    return RedisIntake(
        url, INFER_QUEUE, transport=redis_transport(url), transport_options=transport_options(url, visibility_timeout_s)
    )


def _send(url: str, *job_ids: str, direct: bool = False) -> None:
    app = make_app(ApiSettings(broker_url=url))
    publisher = DirectPublisher(app) if direct else None
    try:
        for job_id in job_ids:
            signature = infer_signature(job_id=job_id, prompt_tokens=3, deadline=None, app=app)
            if publisher is not None:
                publisher.send(signature)
            else:
                signature.apply_async()
    finally:
        if publisher is not None:
            publisher.close()


def _jobs(messages: list[IntakeMessage]) -> list[str]:
    return [_job_id(m) for m in messages]


def _job_id(message: IntakeMessage) -> str:
    assert message.kwargs is not None, message.id
    job_id: str = message.kwargs["job_id"]
    return job_id


def test_what_waits_is_taken_oldest_first_up_to_the_room_and_held_in_kombu_s_unacked_index(
    broker_url: str, broker: redis.Redis[bytes]
) -> None:
    _send(broker_url, "a", "b")
    _send(broker_url, "c", "d", direct=True)  # the API's own publisher: the same messages
    intake = _intake(broker_url)
    try:
        taken = intake.take(3, block_s=1.0)
        assert _jobs(taken) == ["a", "b", "c"]
        assert intake.held == 3
        assert broker.llen(INFER_QUEUE) == 1
        entries = {tag.decode(): json.loads(raw) for tag, raw in broker.hgetall("unacked").items()}
        assert sorted(entries) == sorted(m._tag for m in taken)
        for message in taken:  # kombu's own entry: [the message, its exchange, its routing key]
            envelope, exchange, routing_key = entries[message._tag]
            assert (envelope["headers"]["id"], exchange, routing_key) == (message.id, "", INFER_QUEUE)
        scores = [score for _, score in broker.zrange("unacked_index", 0, -1, withscores=True)]
        assert len(scores) == 3
        assert all(abs(score - time.time()) < 60 for score in scores)
        assert _jobs(intake.take(5, block_s=1.0)) == ["d"]
    finally:
        intake.close()


def test_an_ack_leaves_the_index_with_the_next_round_trip_and_a_message_handed_back_is_taken_first(
    broker_url: str, broker: redis.Redis[bytes]
) -> None:
    _send(broker_url, "a", "b", "c")
    intake = _intake(broker_url)
    try:
        a, b = intake.take(2, block_s=1.0)
        a.acknowledge()
        assert broker.zcard("unacked_index") == 2  # gathered: written with the next round trip
        b.reject(requeue=True)  # at once, to the front of the queue
        assert broker.zcard("unacked_index") == 1
        assert intake.held == 0
        again = intake.take(5, block_s=1.0)
        assert _jobs(again) == ["b", "c"]
        assert broker.zcard("unacked_index") == 2  # a's ack went with the take
        assert a._tag.encode() not in broker.hkeys("unacked")
        for message in again:
            message.acknowledge()
    finally:
        intake.close()  # writes the acks gathered since
    assert broker.zcard("unacked_index") == 0
    assert broker.hlen("unacked") == 0


def test_a_dead_reader_s_messages_are_restored_by_kombu_s_own_sweep(
    broker_url: str, broker: redis.Redis[bytes]
) -> None:
    _send(broker_url, "a", "b")
    dead = _intake(broker_url)
    assert _jobs(dead.take(5, block_s=1.0)) == ["a", "b"]
    assert broker.llen(INFER_QUEUE) == 0
    # Another worker's kombu channel sweeps the index for messages held past the visibility timeout (0 s here).
    options = transport_options(broker_url, visibility_timeout_s=0)
    with Connection(  # type: ignore[no-untyped-call]  # kombu is unannotated
        broker_url, transport=redis_transport(broker_url), transport_options=options
    ) as connection:
        connection.default_channel.qos.restore_visible(num=10)
    assert broker.zcard("unacked_index") == 0
    living = _intake(broker_url)
    try:
        assert sorted(_jobs(living.take(5, block_s=1.0))) == ["a", "b"]
    finally:
        living.close()


def test_an_empty_queue_is_waited_on_and_the_first_message_to_come_is_taken_and_held(
    broker_url: str, broker: redis.Redis[bytes]
) -> None:
    intake = _intake(broker_url)
    taken: list[IntakeMessage] = []
    reader = threading.Thread(target=lambda: taken.extend(intake.take(5, block_s=30.0)))
    reader.start()
    try:
        wait_for(lambda: any(c["cmd"] == "brpop" for c in broker.client_list()), 10, "the intake to wait", [])
        _send(broker_url, "late")
        reader.join(10)
        assert _jobs(taken) == ["late"]
        assert broker.zcard("unacked_index") == 1
    finally:
        reader.join(30)
        intake.close()


def test_a_message_that_is_no_task_message_is_dropped_alone(broker_url: str, broker: redis.Redis[bytes]) -> None:
    broker.lpush(INFER_QUEUE, b"not json")
    broker.lpush(INFER_QUEUE, json.dumps({"properties": {"delivery_tag": "t1"}, "content-type": "text/plain"}))
    _send(broker_url, "good")
    intake = _intake(broker_url)
    try:
        assert _jobs(intake.take(5, block_s=1.0)) == ["good"]
        assert broker.llen(INFER_QUEUE) == 0
        assert broker.zcard("unacked_index") == 1  # the good one's alone
        assert intake.held == 1
    finally:
        intake.close()


def test_the_intake_waits_for_room_and_wakes_when_an_ack_frees_it(broker_url: str) -> None:
    _send(broker_url, "a", "b")
    intake = _intake(broker_url)
    try:
        a, b = intake.take(2, block_s=1.0)
        assert intake.wait_below(2, timeout_s=0.05) == 2  # full: it gave up waiting
        freed = threading.Timer(0.05, a.acknowledge)
        freed.start()
        assert intake.wait_below(2, timeout_s=30.0) == 1
        freed.join()
        b.acknowledge()
    finally:
        intake.close()


def test_the_inference_worker_s_celery_consumer_leaves_its_queue_to_the_intake(one_at_a_time: Fleet) -> None:
    crew = one_at_a_time
    job_id = crew.client.post("/v1/jobs", data={"prompt": "Through the intake."}).json()["id"]
    assert crew.client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()["status"] == "succeeded"
    infer = next(name for reply in crew.app.control.ping(timeout=2) for name in reply if name.startswith("infer@"))
    inspect = crew.app.control.inspect(destination=[infer], timeout=5)
    assert inspect.active_queues()[infer] == []  # Celery consumes nothing there: the job came through the intake
    assert "stoker.infer" not in inspect.stats()[infer]["total"]


class FailsOnce:
    """The intake's script, failing once as a broker that goes away would."""

    def __init__(self, script: Callable[..., object]) -> None:
        self.script = script
        self.failed = False

    def __call__(self, **kwargs: object) -> object:
        if not self.failed:
            self.failed = True
            raise redis.ConnectionError("the broker went away")
        return self.script(**kwargs)


def _popped_when_the_script_failed(url: str) -> RedisIntake:
    """An intake whose first round trip popped "a" and then failed to hold it."""
    _send(url, "a")
    intake = _intake(url)
    intake._take = FailsOnce(intake._take)
    with pytest.raises(redis.ConnectionError):
        intake.take(5, block_s=1.0)
    return intake


def test_a_message_popped_when_the_broker_failed_the_script_is_held_by_the_next_round_trip(
    broker_url: str, broker: redis.Redis[bytes]
) -> None:
    intake = _popped_when_the_script_failed(broker_url)
    try:
        assert broker.llen(INFER_QUEUE) == 0  # popped, and only in this process now
        assert _jobs(intake.take(5, block_s=1.0)) == ["a"]
        assert broker.zcard("unacked_index") == 1
    finally:
        intake.close()


def test_a_message_popped_and_never_held_goes_back_to_its_queue_when_the_intake_closes(
    broker_url: str, broker: redis.Redis[bytes]
) -> None:
    intake = _popped_when_the_script_failed(broker_url)
    intake.close()
    assert broker.llen(INFER_QUEUE) == 1
    assert broker.zcard("unacked_index") == 0
