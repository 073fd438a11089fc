"""The workers' Celery app (`celery -A tasks.worker`), built from the worker's one settings object."""

from __future__ import annotations

from tasks import resources
from tasks.app import make_app

#: Every module defining tasks; a worker imports them all, whichever queues it consumes.
TASK_MODULES = (
    "tasks.preprocess",
    "tasks.media",
    "tasks.fetch",
    "tasks.inference",
    "tasks.monitoring",
    "tasks.baseline",
    "tasks.callbacks",
)

app = make_app(resources.settings(), include=TASK_MODULES)
