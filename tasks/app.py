"""The Celery applications: `make_app(settings)` builds one from a process's settings.

The API builds its producer with the settings given to `create_app`; the workers' app (`tasks.worker.app`, what
`celery -A tasks.worker` loads) is built from the worker's one `WorkerSettings`. Nobody reads the environment here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery.signals import before_task_publish

from stoker.settings import ApiSettings, CommonSettings, WorkerSettings
from tasks import celeryconfig

#: Message header holding when a task message was published: a stage's broker queue wait starts there.
SENT_HEADER = "stoker_sent"


def make_app(settings: CommonSettings, include: Sequence[str] = ()) -> Celery:
    """A Celery app configured by `celeryconfig` for these settings (with stage time limits for a worker)."""
    app = Celery("stoker", include=list(include), set_as_current=False)
    app.config_from_object(celeryconfig)
    app.conf.update(celeryconfig.connection(settings))
    if isinstance(settings, WorkerSettings):
        app.conf.update(celeryconfig.limits(settings))
    if isinstance(settings, ApiSettings):
        app.conf.update(celeryconfig.producer(settings))
    return app


@before_task_publish.connect
def _stamp_sent(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Every message carries its publish time (a retry or redelivery keeps the original)."""
    if headers is not None:
        headers.setdefault(SENT_HEADER, time.time())
