"""What the broker will not make a worker do: run a pickled message."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import redis
from fastapi.testclient import TestClient

from tests.integration.test_pipeline import _wait


def test_a_pickled_task_message_is_refused_and_nothing_runs(client: TestClient, workers: dict[str, Path]) -> None:
    from tasks.app import app

    task_id = f"pickled-{uuid.uuid4().hex}"
    queue = app.amqp.queues["decode"]
    headers = {"lang": "py", "task": "stoker.decode", "id": task_id, "root_id": task_id, "retries": 0}
    with app.connection_for_write() as connection:
        connection.Producer().publish(
            (("no-such-job", "input:0"), {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}),
            exchange=queue.exchange,
            routing_key=queue.routing_key,
            declare=[queue],
            serializer="pickle",
            headers=headers,
        )
    log = workers["cpu"]
    deadline = time.monotonic() + 30
    while "application/x-python-serialize" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    assert "application/x-python-serialize" in text  # the worker's decode error names the refused type
    assert "ContentDisallowed" in text or "Refusing to deserialize" in text
    assert f"{task_id}] received" not in text  # never became a task
    with redis.Redis.from_url(os.environ["STOKER_BROKER_URL"]) as broker:
        assert broker.llen("decode") == 0  # dropped, not requeued forever
    job = client.post("/v1/jobs", data={"prompt": "Say hello."}).json()["id"]
    assert _wait(client, job)["status"] == "succeeded"  # the worker carries on
