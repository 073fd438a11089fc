"""The core pipeline with RabbitMQ as the broker (quorum queues, publisher confirms); store and cache stay Redis."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import amqp
import pytest
from kombu.connection import Connection
from kombu.entity import Queue

from stoker.core.queues import QUEUES
from tests.conftest import missing
from tests.fleet import Fleet, own_fleet
from tests.integration.test_pipeline import _wait
from tests.media import text_image

AMQP_URL = os.environ.get("STOKER_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")


def _rabbit_answers() -> bool:
    try:
        with Connection(AMQP_URL, connect_timeout=3) as connection:  # type: ignore[no-untyped-call]
            connection.ensure_connection(max_retries=1)
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Workers, reaper and API on RabbitMQ; its queues purged first so nothing from earlier runs is replayed."""
    if not _rabbit_answers():
        missing(f"no RabbitMQ answers at {AMQP_URL} (set STOKER_TEST_AMQP to test against one)")
    # The broker is under test, not the model: the device is simulated.
    with own_fleet({"STOKER_BROKER_URL": AMQP_URL, "STOKER_BACKEND": "sim"}) as crew:
        with Connection(AMQP_URL) as connection:  # type: ignore[no-untyped-call]
            channel = connection.channel()
            for queue in crew.app.conf.task_queues:
                bound = queue(channel)
                bound.declare()
                bound.purge()
        yield crew


def test_image_and_text_jobs_complete_over_rabbitmq(fleet: Fleet) -> None:
    files = [("image", ("r.png", text_image(f"RABBIT {time.time_ns() % 10000}"), "image/png"))]
    image_job = fleet.client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=files).json()["id"]
    text_job = fleet.client.post("/v1/jobs", data={"prompt": "Say hello."}).json()["id"]
    image, text = _wait(fleet.client, image_job), _wait(fleet.client, text_job)
    assert (image["status"], text["status"]) == ("succeeded", "succeeded"), (image, fleet.logs())
    assert "RABBIT" in image["inputs"][0]["text"]
    assert image["result"]["text"].strip()
    stats = fleet.client.get("/v1/stats").json()  # queue depths read over AMQP
    assert set(stats["queues"]) == set(QUEUES)


def test_the_queues_are_durable_quorum_queues(fleet: Fleet) -> None:
    queues = {q.name: q for q in fleet.app.conf.task_queues}
    assert all(q.durable for q in queues.values())
    assert all(q.queue_arguments == {"x-queue-type": "quorum"} for q in queues.values())
    assert fleet.app.conf.broker_transport_options == {"confirm_publish": True}


def test_the_broker_itself_holds_quorum_queues_and_confirms_publishes(fleet: Fleet) -> None:
    with Connection(AMQP_URL) as connection:  # type: ignore[no-untyped-call]
        for queue in fleet.app.conf.task_queues:
            # Redeclaring as classic is refused by the broker, which names the type it holds.
            classic = Queue(  # type: ignore[no-untyped-call]  # kombu is unannotated
                queue.name, durable=True, queue_arguments={"x-queue-type": "classic"}
            )
            with pytest.raises(amqp.exceptions.PreconditionFailed) as refused:
                classic(connection.channel()).declare()  # type: ignore[no-untyped-call]
            assert "'quorum'" in str(refused.value), queue.name
    with fleet.app.connection_for_write() as connection:
        producer = connection.Producer()
        producer.publish({"probe": True}, routing_key=f"nowhere-{time.time_ns()}")
        assert producer.channel._confirm_selected  # the broker put the channel in confirm mode (confirm.select-ok)
