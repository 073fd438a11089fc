"""The Celery fence (`stoker.adapters.celery_protocol`) against the installed Celery: a message built there is the
one `apply_async` sends, the signals go out as Celery sends them, and a protocol-2 message reads as the fence reads
it. A Celery release that changes any of these fails here, naming what changed.

On kombu's in-memory transport: no broker, and the message as kombu's channel would hand it to Redis."""

from __future__ import annotations

import base64
import inspect
import json
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import pytest
from celery import Celery
from celery.canvas import Signature
from celery.signals import after_task_publish, before_task_publish
from packaging.specifiers import SpecifierSet

from stoker.adapters.celery_protocol import CELERY_VERSIONS, task_id, task_kwargs, task_message
from stoker.settings import CommonSettings
from tasks.app import make_app

#: What differs between two messages of the same signature: their ids, the time stoker stamps, and, once tracing is on
#: in the process (an earlier test's, in a suite), the span each message was published in (W3C trace context).
_PER_MESSAGE_HEADERS = {"id", "root_id", "stoker_sent", "traceparent", "tracestate"}
_PER_MESSAGE_PROPERTIES = {"correlation_id", "delivery_tag"}


@pytest.fixture
def app() -> Celery:
    """stoker's producer app (its routes, serializer and signal handlers), over kombu's in-memory transport."""
    return make_app(CommonSettings(broker_url="memory://"))


@pytest.fixture
def signals() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """The publish signals sent while the test runs, by name, with what they carried."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def before(**kwargs: Any) -> None:
        seen.append(("before_task_publish", kwargs))

    def after(**kwargs: Any) -> None:
        seen.append(("after_task_publish", kwargs))

    before_task_publish.connect(before, weak=False)
    after_task_publish.connect(after, weak=False)
    yield seen
    before_task_publish.disconnect(before)
    after_task_publish.disconnect(after)


def _plain_signatures(app: Celery) -> list[Signature]:
    """The plain signatures stoker publishes itself: an interactive job's hand-off, a batch line's."""
    kwargs = {"job_id": "j-1", "prompt_tokens": 12, "deadline": 1.5}
    return [
        app.signature("stoker.infer", kwargs=kwargs, ignore_result=True),
        app.signature("stoker.infer", kwargs={**kwargs, "job_class": "batch"}, queue="infer_batch", priority=9),
    ]


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    headers = {k: v for k, v in message["headers"].items() if k not in _PER_MESSAGE_HEADERS}
    properties = {k: v for k, v in message["properties"].items() if k not in _PER_MESSAGE_PROPERTIES}
    return {**message, "headers": headers, "properties": properties}


def test_the_installed_celery_is_one_the_fence_mirrors() -> None:
    installed = version("celery")
    assert installed in SpecifierSet(CELERY_VERSIONS), (
        f"celery {installed} is outside {CELERY_VERSIONS}, the releases stoker.adapters.celery_protocol mirrors: "
        "check it against this release (the tests here), then widen CELERY_VERSIONS"
    )


@pytest.mark.parametrize("which", [0, 1])
def test_a_message_built_by_the_fence_is_the_one_apply_async_sends(
    app: Celery, signals: list[tuple[str, dict[str, Any]]], which: int
) -> None:
    signature = _plain_signatures(app)[which]
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        sent_by_celery = signature.apply_async()
        queue = app.amqp.router.route(dict(signature.options), signature.task)["queue"].name
        celerys = channel._get(queue)
        celerys_signals, signals[:] = list(signals), []
        built = task_message(app, signature, channel)
        channel.basic_publish(built.message, "", built.queue)
        built.sent()
        ours = channel._get(queue)
    assert built.queue == queue
    assert (celerys["headers"]["id"], ours["headers"]["id"]) == (sent_by_celery.id, built.task_id)
    assert _without_ids(ours) == _without_ids(celerys), "Celery's apply_async now sends another message"
    assert [name for name, _ in signals] == [name for name, _ in celerys_signals]
    for (name, theirs), (_, mine) in zip(celerys_signals, signals, strict=True):
        assert sorted(mine) == sorted(theirs), f"{name} is now sent with other arguments"
        for key in ("sender", "exchange", "routing_key", "retry_policy"):
            assert mine.get(key) == theirs.get(key), f"{name}'s {key}"
        assert _without_ids({"headers": mine["headers"], "properties": {}}) == _without_ids(
            {"headers": theirs["headers"], "properties": {}}
        ), f"{name}'s headers"


def test_as_task_v2_takes_what_the_fence_gives_it() -> None:
    parameters = inspect.signature(Celery().amqp.as_task_v2).parameters
    for name in ("task_id", "name", "args", "kwargs", "reply_to", "ignore_result", "argsrepr", "kwargsrepr"):
        assert name in parameters, f"as_task_v2 takes no {name} any more"


def test_a_protocol_2_message_reads_as_the_fence_reads_it(app: Celery) -> None:
    signature = _plain_signatures(app)[0]
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        sent = signature.apply_async()
        raw = channel._get("infer")
    body = json.loads(base64.b64decode(raw["body"]))
    assert task_kwargs(body) == signature.kwargs
    assert task_id(raw["headers"]) == sent.id
