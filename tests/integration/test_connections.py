"""Sampling the broker costs no connection: an idle API's Redis client count stays flat however long it runs."""

# kombu is unannotated: the calls into it here are untyped ones.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from celery.canvas import Signature
from fastapi.testclient import TestClient
from kombu.asynchronous import Hub
from kombu.connection import Connection
from kombu.entity import Queue as KombuQueue
from kombu.messaging import Producer

from api.app import create_app
from api.pressure import QueueMonitor
from stoker.adapters.broker import declare_queues, queue_depths, stage_queue
from stoker.adapters.kombu_redis import RedisChannel, RedisTransport, promote_aged
from stoker.adapters.store import Store
from stoker.adapters.store.clients import async_broker_client
from stoker.core.jobs import InputRecord, JobClass
from stoker.core.queues import INFER_BATCH_QUEUE, INFER_QUEUES, SENT_HEADER
from stoker.runtime.context import WorkerContext
from stoker.settings import ApiSettings, WorkerSettings
from tasks.app import make_app
from tasks.pipeline import CeleryOutbox, CelerySubmitter, infer_signature, preprocessing_branches
from tasks.publish import DirectPublisher
from tests.conftest import missing
from tests.integration.conftest import SpySubmitter
from tests.integration.test_rabbitmq import AMQP_URL, _rabbit_answers
from workers.broker import start_embedded
from workers.procs import stop, wait_for

#: A database no other test uses: every client on it is one this module opened.
SAMPLED_DB = 9


def _clients(server: redis.Redis[bytes], db: int) -> int:
    """Connections the server holds on one database."""
    return sum(1 for client in server.client_list() if int(client.get("db", -1)) == db)


@pytest.fixture
def broker_url(store_redis: redis.Redis[bytes]) -> str:
    """An empty broker database: every stage queue is missing, the case that used to open a connection per queue."""
    url = f"{os.environ['STOKER_TEST_REDIS']}/{SAMPLED_DB}"
    redis.Redis.from_url(url).flushdb()
    return url


def test_sampling_queue_depths_over_and_over_opens_no_connection(
    store_redis: redis.Redis[bytes], broker_url: str
) -> None:
    store = Store.over(store_redis, blob_ttl_s=60, job_ttl_s=60)
    monitor = QueueMonitor(ApiSettings(broker_url=broker_url), store)
    try:
        monitor.sample()
        before = _clients(store_redis, SAMPLED_DB)
        for _ in range(120):  # a minute of the API's sampling
            snapshot = monitor.sample()
        assert _clients(store_redis, SAMPLED_DB) == before
        assert {q.name: q.depth for q in snapshot.queues} == dict.fromkeys(monitor.queues, 0)
    finally:
        monitor.close()


def test_readiness_probes_open_no_connection(store_redis: redis.Redis[bytes], broker_url: str) -> None:
    settings = ApiSettings(broker_url=broker_url)
    with TestClient(create_app(settings, submitter=SpySubmitter(forward=False))) as client:
        assert client.get("/readyz").status_code == 200
        before = _clients(store_redis, SAMPLED_DB)
        answers = [client.get("/readyz").status_code for _ in range(200)]
        after = _clients(store_redis, SAMPLED_DB)
    assert answers == [200] * 200
    assert after == before


def test_depths_over_amqp_leave_no_channel_open() -> None:
    if not _rabbit_answers():
        missing(f"no RabbitMQ answers at {AMQP_URL}")
    never = [f"never-declared-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    with Connection(AMQP_URL, connect_timeout=3) as connection:
        connection.ensure_connection(max_retries=1)
        queue_depths(connection, never)
        before = len(connection.connection.channels)
        for _ in range(30):
            depths = queue_depths(connection, never)
        assert len(connection.connection.channels) == before
    assert depths == dict.fromkeys(never, 0)


def test_the_celery_app_publishes_over_one_redis_client_per_pool(broker_url: str) -> None:
    app = make_app(ApiSettings(broker_url=broker_url))
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        assert isinstance(channel, RedisChannel)
        client = channel._create_client()
        for n in range(3):
            app.send_task("stoker.infer", kwargs={"job_id": f"j{n}"}, connection=connection)
        assert channel._create_client() is client  # not a new redis.Redis per command
        assert redis.Redis.from_url(broker_url).llen("infer") == 3
        channel._pool = None  # what kombu does after a connection error: a new pool, and a client over it
        assert channel._create_client() is not client
        assert channel._create_client().connection_pool is channel.pool


def _comparable(raw: bytes) -> dict[str, object]:
    """A message on a Redis list as kombu wrote it, less what differs between any two sends (ids, times)."""
    message: dict[str, Any] = json.loads(raw)
    for name in ("id", "root_id", SENT_HEADER):
        message["headers"].pop(name)
    for name in ("correlation_id", "delivery_tag"):
        message["properties"].pop(name)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


def _sent_on_loop(direct: DirectPublisher, signature: Signature, settings: ApiSettings) -> str:
    """`send_on`, over an asyncio client of the broker as the API's loop has."""

    async def send() -> str:
        client = async_broker_client(settings)
        assert client is not None
        try:
            return await direct.send_on(signature, client)
        finally:
            await client.aclose(close_connection_pool=True)  # type: ignore[attr-defined]  # redis>=5 has it; the stubs lag

    return asyncio.run(send())


@pytest.mark.parametrize("on_loop", [False, True], ids=["thread", "loop"])
def test_a_plain_signature_published_directly_is_the_message_celery_sends(
    store_redis: redis.Redis[bytes], broker_url: str, on_loop: bool
) -> None:
    """The API's hand-off to inference skips Celery's producer machinery; the worker must not see a difference,
    whether it was pushed from a thread or from the API's loop."""
    settings = ApiSettings(broker_url=broker_url)
    app = make_app(settings)
    broker = redis.Redis.from_url(broker_url)
    direct = DirectPublisher(app)
    for job_class in ("interactive", "batch"):
        kwargs = {"job_id": f"j-{job_class}", "prompt_tokens": 12, "deadline": 5.0, "app": app, "job_class": job_class}
        infer_signature(**kwargs).apply_async()
        signature = infer_signature(**kwargs)
        task_id = _sent_on_loop(direct, signature, settings) if on_loop else direct.send(signature)
        lists = [key for key in broker.keys("infer*") if broker.llen(key) == 2]
        assert len(lists) == 1, broker.keys("*")  # both on the same list: queue and priority as Celery's
        celerys, directs = (broker.rpop(lists[0]) for _ in range(2))
        assert json.loads(directs)["headers"]["id"] == task_id
        assert json.loads(directs)["headers"][SENT_HEADER] > 0  # the signal ran
        assert _comparable(directs) == _comparable(celerys)
    opened = _clients(store_redis, SAMPLED_DB)
    direct.close()  # its channel's connections (the API's lifespan closes it), not Celery's
    wait_for(lambda: _clients(store_redis, SAMPLED_DB) < opened, 5, "the publisher's connections to close", [])
    assert _clients(store_redis, SAMPLED_DB) > 0  # Celery's pooled connection stays


def test_more_threads_than_the_brokers_pool_has_connections_publish_directly_without_a_refusal(broker_url: str) -> None:
    # The API publishes from every thread of its pool; redis-py's pool refuses a connection past its bound
    # (MaxConnectionsError, a 503 for the job) instead of waiting for one, so the publisher waits for one itself.
    app = make_app(ApiSettings(broker_url=broker_url))
    app.conf.broker_transport_options = {**app.conf.broker_transport_options, "max_connections": 2}
    direct = DirectPublisher(app)
    try:
        with ThreadPoolExecutor(16) as pool:
            sent = list(pool.map(lambda n: direct.send(infer_signature(f"j{n}", 1, None, app)), range(400)))
        assert len(set(sent)) == 400
        assert redis.Redis.from_url(broker_url).llen("infer") == 400
    finally:
        direct.close()


def test_only_a_plain_signature_is_published_directly(broker_url: str) -> None:
    app = make_app(ApiSettings(broker_url=broker_url))
    plain = infer_signature("j", 3, None, app)
    assert DirectPublisher.serves(app)
    assert DirectPublisher.plain(plain)
    assert not DirectPublisher.plain(plain.clone(link=app.signature("stoker.rescue")))
    assert not DirectPublisher.plain(plain.clone(countdown=3))
    assert not DirectPublisher.plain(plain.clone(soft_time_limit=3))  # an option it would not carry
    assert DirectPublisher.plain(infer_signature("j", 3, None, app, "batch"))  # its own queue and priority
    branches = preprocessing_branches("j", [InputRecord(index=0, kind="image", content_hash="h", size_bytes=1)], app)
    assert not DirectPublisher.plain(branches[0])  # a chain
    with pytest.raises(ValueError, match="not a plain signature"):
        DirectPublisher(app).send(plain.clone(countdown=3))
    assert not DirectPublisher.serves(make_app(ApiSettings(broker_url=AMQP_URL)))


@pytest.fixture(params=["redis", "amqp"])
def lines_broker(request: pytest.FixtureRequest, broker_url: str) -> Iterator[str]:
    """A broker whose inference queues are empty: the module's Redis database, or RabbitMQ's queues purged."""
    if request.param == "redis":
        yield broker_url
        return
    if not _rabbit_answers():
        missing(f"no RabbitMQ answers at {AMQP_URL}")
    with Connection(AMQP_URL) as connection:
        channel = connection.channel()
        for queue in declare_queues(AMQP_URL):
            if queue.name in INFER_QUEUES:
                bound = queue(channel)
                bound.declare()
                bound.purge()
    yield AMQP_URL


def test_batch_lines_wait_in_their_own_queue_until_taken_one_at_a_time(lines_broker: str) -> None:
    settings = WorkerSettings(broker_url=lines_broker)
    app = make_app(settings)
    lines = WorkerContext(settings, CeleryOutbox(app)).batch_lines
    try:
        for job_id in ("line-1", "line-2"):
            infer_signature(job_id, 3, None, app, "batch").apply_async()
        infer_signature("chat-1", 3, None, app).apply_async()
        with app.connection_for_read() as connection:

            def depths() -> dict[str, int]:
                return queue_depths(connection, INFER_QUEUES)

            assert depths() == {"infer": 1, INFER_BATCH_QUEUE: 2}
            first = lines.take()
            assert first is not None
            assert first.kwargs == {"job_id": "line-1", "prompt_tokens": 3, "deadline": None, "job_class": "batch"}
            first.reject(requeue=True)  # handed back: it waits in the queue again
            taken = [lines.take(), lines.take()]
            assert sorted(m.kwargs["job_id"] for m in taken if m is not None and m.kwargs) == ["line-1", "line-2"]
            assert lines.take() is None  # the interactive job's message is not a line
            assert depths() == {"infer": 1, INFER_BATCH_QUEUE: 0}
            kept = next(m for m in taken if m is not None and m.kwargs and m.kwargs["job_id"] == "line-2")
            kept.acknowledge()
            lines.close()  # a consumer that lets go without settling: its line goes back, as a worker's would
            wait_for(lambda: depths()[INFER_BATCH_QUEUE] == 1, 10, "the unsettled line back in its queue", [])
            back = lines.take()
            assert back is not None
            assert back.kwargs is not None
            assert back.kwargs["job_id"] == "line-1"
            back.acknowledge()
            assert depths() == {"infer": 1, INFER_BATCH_QUEUE: 0}
    finally:
        lines.close()


def test_a_message_on_the_lines_queue_that_is_no_task_is_dropped_not_handed_back(lines_broker: str) -> None:
    settings = WorkerSettings(broker_url=lines_broker)
    app = make_app(settings)
    lines = WorkerContext(settings, CeleryOutbox(app)).batch_lines
    try:
        with app.connection_for_write() as connection:
            connection.Producer().publish({"not": "a task"}, routing_key=INFER_BATCH_QUEUE, serializer="json")
            infer_signature("line-3", 3, None, app, "batch").apply_async()
            assert queue_depths(connection, [INFER_BATCH_QUEUE]) == {INFER_BATCH_QUEUE: 2}
            taken = lines.take()
            assert taken is not None
            assert taken.kwargs is not None
            assert taken.kwargs["job_id"] == "line-3"
            taken.acknowledge()
            lines.close()  # nothing unsettled is left to go back
            assert queue_depths(connection, [INFER_BATCH_QUEUE]) == {INFER_BATCH_QUEUE: 0}
    finally:
        lines.close()


def test_a_burst_of_media_jobs_publishes_through_a_small_producer_pool(broker_url: str) -> None:
    settings = ApiSettings(broker_url=broker_url)
    app = make_app(settings)
    app.conf.broker_pool_limit = 2  # one job's chord holds two producers at once (its group's, its chains')
    submitter = CelerySubmitter(app)
    pictures = [InputRecord(index=n, kind="image", content_hash=f"{n:02x}" * 32, size_bytes=10) for n in range(2)]
    published: list[str] = []

    def submit(n: int) -> None:
        submitter.submit(f"job-{n}", pictures)
        published.append(f"job-{n}")

    threads = [threading.Thread(target=submit, args=(n,), daemon=True) for n in range(12)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(published) == len(threads), 30, "every job published", [])
    with app.connection_for_read() as connection:
        assert queue_depths(connection, ["decode"]) == {"decode": 2 * len(threads)}


def test_small_inputs_are_taken_before_large_ones_and_a_large_one_past_the_age_bound_goes_first(
    broker_url: str,
) -> None:
    app = make_app(WorkerSettings(broker_url=broker_url))
    now = time.time()

    def send(job_id: str, size: int, sent: float, job_class: JobClass = "interactive") -> None:
        page = InputRecord(index=0, kind="image", content_hash=job_id, size_bytes=1, size_class=size)
        for branch in preprocessing_branches(job_id, [page], app, job_class=job_class):
            branch.apply_async(headers={SENT_HEADER: sent})

    send("line-old", 0, now - 10, "batch")  # a batch line's stays behind every interactive input, however old
    send("large-old", 2, now - 10)  # a large page that has waited ten seconds behind smaller ones
    send("large-new", 2, now)
    send("medium", 1, now)
    send("small-1", 0, now)
    send("small-2", 0, now)
    with app.connection_for_read() as connection:
        assert promote_aged(connection, ["decode"], 5.0, now) == 1
        assert promote_aged(connection, ["decode"], 5.0, now) == 0  # nothing else is that old
        decode = stage_queue(broker_url, "decode")(connection.default_channel)
        order = []
        while (message := decode.get(no_ack=True)) is not None:
            order.append(message.decode()[0][0])  # the decode task's args: (job_id, ref)
    assert order == ["large-old", "small-1", "small-2", "medium", "large-new", "line-old"]


def test_a_queues_depth_counts_its_messages_at_every_priority(broker_url: str) -> None:
    """Read in one round trip from every priority list of every queue; a queue never declared is 0."""
    app = make_app(WorkerSettings(broker_url=broker_url))
    with app.connection_for_write() as connection:
        producer = connection.Producer()
        for priority in (0, 1, 2, 9, 9):
            producer.publish(
                {"n": priority}, routing_key="ocr", priority=priority, declare=[stage_queue(broker_url, "ocr")]
            )
        never = f"never-declared-{uuid.uuid4().hex[:8]}"
        assert queue_depths(connection, ["ocr", never]) == {"ocr": 5, never: 0}
        assert redis.Redis.from_url(broker_url).llen("ocr") == 1  # spread over the lists, not all in the first


def test_messages_taken_and_acked_on_the_event_loop_enter_and_leave_the_unacked_index_at_the_end_of_its_round() -> None:
    """Celery takes messages and acks them on its event loop: what one round of the loop takes and acks (a message,
    a written batch's acks) is written to the Redis broker's unacked index in one script when the round ends,
    not one each; a message is restored from the index only once it is there; a take or an ack from another
    thread is kombu's own, at once."""
    valkey, port = start_embedded(persist=False)
    client = redis.Redis(port=port)
    try:
        with Connection(f"redis://127.0.0.1:{port}/0", transport=RedisTransport) as connection:
            channel = connection.default_channel
            queue = KombuQueue("acks", routing_key="acks")(channel)
            queue.declare()
            for n in range(7):
                Producer(channel).publish({"n": n}, routing_key="acks")
            taken = [queue.get(no_ack=False) for _ in range(4)]
            assert client.zcard(channel.unacked_index_key) == 4  # no loop yet: kombu's own, at once
            hub = Hub()
            connection.register_with_event_loop(hub)
            (end_of_round,) = [tick for tick in hub.on_tick if tick.__name__ == "at_each_round"]
            end_of_round()  # run on this thread: this thread is now the loop's

            client.config_resetstat()
            for message in taken[:3]:
                message.ack()
            taken += [queue.get(no_ack=False) for _ in range(2)]
            assert client.zcard(channel.unacked_index_key) == 4  # gathered until the round ends
            end_of_round()
            stats = client.info("commandstats")
            # the calls that ran (the script's first EVALSHA is answered NOSCRIPT, then loaded and called again)
            calls = {name: int(stat["calls"]) - int(stat["failed_calls"]) for name, stat in stats.items()}
            assert (calls["cmdstat_evalsha"], "cmdstat_multi" in calls) == (1, False)  # one step, no transaction
            assert [calls[f"cmdstat_{verb}"] for verb in ("zadd", "hset", "zrem", "hdel")] == [2, 2, 3, 3]
            assert client.zcard(channel.unacked_index_key) == client.hlen(channel.unacked_key) == 3

            requeued = queue.get(no_ack=False)
            requeued.requeue()  # taken this round, handed back at once: in the index first, then back in the queue
            assert client.llen("acks") == 1
            assert client.zcard(channel.unacked_index_key) == 3

            elsewhere = threading.Thread(target=lambda: [message.ack() for message in taken[3:]])
            elsewhere.start()
            elsewhere.join()
            assert client.zcard(channel.unacked_index_key) == 0  # not the loop's thread: at once
            assert all(message.acknowledged for message in taken)
            hub.close()
    finally:
        client.close()
        stop(valkey)
