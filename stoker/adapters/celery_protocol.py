"""Fence: Celery's task message protocol (version 2), where stoker builds a task message without Celery's
publishing machinery and reads one without its consumer. The one module that knows it.

Mirrors Celery 5.6 (`CELERY_VERSIONS`; written against 5.6.3). `tests/unit/test_fence_celery.py` checks each thing
below against the installed Celery and fails, naming it, on a release that changes it:

- a message built here (`task_message`) is the one `apply_async` sends for the same plain signature, but for its ids
  and times: the queue is the one Celery's router picks, headers, properties and body are `app.amqp.as_task_v2`'s
  (given the reply-to, the ignored result and the argument reprs `send_task` gives it), `before_task_publish` and
  `after_task_publish` are sent with what `app.amqp.send_task_message` sends them, the body is serialized with the
  app's serializer and the delivery mode set as Celery's producer sets it, and kombu's channel prepares the rest
  (`prepare_message`);
- a protocol-2 body is `[args, kwargs, embed]`, and a message's headers carry its task id under `id` (`task_kwargs`,
  `task_id`: what a consumer that takes messages itself reads of them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from celery import Celery
from celery.canvas import Signature
from celery.signals import after_task_publish, before_task_publish
from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps
from kombu.utils.uuid import uuid

#: The Celery releases this module mirrors: a release outside them fails `tests/unit/test_fence_celery.py` until
#: every check there passes on it and this range is widened.
CELERY_VERSIONS = ">=5.6,<5.7"
#: The header that carries a protocol-2 message's task id.
TASK_ID_HEADER = "id"
#: The only options a plain signature has: any other (a link, an ETA, an expiry, a time limit, headers…) is Celery's
#: to send.
PLAIN_OPTIONS = frozenset({"ignore_result", "queue", "priority"})


class TaskMessage(NamedTuple):
    """A task message ready for its channel's publish, and what to call once it is published."""

    task_id: str
    #: The queue it goes to (by the anonymous exchange: the routing key names the queue).
    queue: str
    #: What kombu's channel prepared (`prepare_message`), for its `basic_publish`.
    message: Any
    #: Sends `after_task_publish`, as Celery does once a message is out.
    sent: Callable[[], None]


def is_plain(signature: Signature) -> bool:
    """Whether `task_message` builds the signature's message as Celery would: one task (not a canvas) with no
    option but its queue, its priority and whether its result is ignored."""
    options = {name for name, value in signature.options.items() if value is not None}
    return type(signature) is Signature and options <= PLAIN_OPTIONS


def task_message(app: Celery, signature: Signature, channel: Any) -> TaskMessage:
    """The plain signature's message as `apply_async` would make it, prepared on `channel` (`before_task_publish`
    sent). Raises ValueError for a signature that is not plain."""
    if not is_plain(signature):
        raise ValueError(f"not a plain signature: {sorted(signature.options)}")
    name = signature.task
    options = dict(signature.options)
    ignore_result = bool(options.pop("ignore_result", False))
    options = app.amqp.router.route(options, name, signature.args, signature.kwargs)
    queue = options["queue"]
    task_id = uuid()
    headers, properties, body, _ = app.amqp.as_task_v2(
        task_id,
        name,
        signature.args,
        signature.kwargs,
        reply_to=app.thread_oid,
        ignore_result=ignore_result,
        argsrepr=_short_repr(signature.args, app.amqp.argsrepr_maxsize),
        kwargsrepr=_short_repr(signature.kwargs, app.amqp.kwargsrepr_maxsize),
    )
    before_task_publish.send(
        sender=name,
        body=body,
        exchange="",
        routing_key=queue.name,
        declare=[queue],
        headers=headers,
        properties=properties,
        retry_policy=None,
    )
    content_type, encoding, payload = dumps(body, serializer=app.conf.task_serializer)  # type: ignore[no-untyped-call]
    mode = queue.exchange.delivery_mode or app.conf.task_default_delivery_mode
    properties["delivery_mode"] = maybe_delivery_mode(mode)  # type: ignore[no-untyped-call]
    message = channel.prepare_message(payload, options.get("priority"), content_type, encoding, headers, properties)

    def sent() -> None:
        after_task_publish.send(sender=name, body=body, headers=headers, exchange="", routing_key=queue.name)

    return TaskMessage(task_id, queue.name, message, sent)


def task_kwargs(body: Sequence[Any]) -> dict[str, Any]:
    """The keyword arguments of a protocol-2 body (`[args, kwargs, embed]`); raises on any other shape."""
    _, kwargs, _ = body
    return kwargs  # type: ignore[no-any-return]


def task_id(headers: Mapping[str, Any]) -> str:
    """The task id a protocol-2 message's headers carry; raises KeyError where they carry none."""
    return str(headers[TASK_ID_HEADER])


def _short_repr(value: Any, limit: int) -> str | None:
    """`repr(value)` where it is within `limit` (what Celery's `saferepr` gives for the few scalars a plain message
    carries, at a fifth of its cost); None past it, so Celery's `saferepr` shortens it as usual."""
    text = repr(value)
    return text if len(text) <= limit else None
