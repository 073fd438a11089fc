"""The workers' Celery app (`celery -A tasks.worker`): configured from the worker's one settings object when Celery
first reads its configuration, and started and stopped by `tasks.lifecycle`."""

from __future__ import annotations

from tasks import lifecycle
from tasks.app import make_worker_app

#: Every module defining tasks; a worker imports them all, whichever queues it consumes.
TASK_MODULES = (
    "tasks.preprocess",
    "tasks.media",
    "tasks.fetch",
    "tasks.inference",
    "tasks.baseline",
    "tasks.callbacks",
)

app = make_worker_app(include=TASK_MODULES)
lifecycle.wire(app)
