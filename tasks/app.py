"""The Celery application shared by the API (to send) and the workers (to run)."""

import time
from typing import Any

from celery import Celery
from celery.signals import before_task_publish

app = Celery(
    "stoker",
    include=["tasks.preprocess", "tasks.media", "tasks.fetch", "tasks.inference", "tasks.monitoring", "tasks.baseline"],
)
app.config_from_object("celeryconfig")

#: Message header holding when a task message was published: a stage's broker queue wait starts there.
SENT_HEADER = "stoker_sent"


@before_task_publish.connect
def _stamp_sent(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Every message carries its publish time (a retry or redelivery keeps the original)."""
    if headers is not None:
        headers.setdefault(SENT_HEADER, time.time())
