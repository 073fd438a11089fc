"""The Celery applications: `make_app(settings)` builds one from a process's settings; `make_worker_app` builds the
workers' app, configured from the worker's settings only when Celery first reads its configuration.

The API builds its producer with the settings given to `create_app`; the workers' app (`tasks.worker.app`, what
`celery -A tasks.worker` loads) takes the one `WorkerSettings` that `tasks.lifecycle` reads for its process.
Nobody reads the environment here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from celery import Celery
from celery.app import backends
from celery.signals import before_task_publish

import celeryconfig
from stoker.core.queues import SENT_HEADER
from stoker.settings import ApiSettings, CommonSettings, WorkerSettings


def make_app(settings: CommonSettings, include: Sequence[str] = ()) -> Celery:
    """A Celery app configured by `celeryconfig` for these settings (with stage time limits for a worker)."""
    app = make_worker_app(include)
    configure(app, settings)
    return app


def make_worker_app(include: Sequence[str] = ()) -> Celery:
    """A Celery app with `celeryconfig`'s flat settings; what depends on the deployment is added by `configure`,
    which the workers' lifecycle calls when Celery first reads the configuration (never at import)."""
    app = StokerCelery("stoker", include=list(include), set_as_current=False)
    app.config_from_object(celeryconfig)
    return app


class StokerCelery(Celery):  # type: ignore[misc]
    """Celery, with its result backend's class looked up once per app instead of once per thread.

    A backend that is not thread-safe (Redis's) is made once for each thread that publishes, and Celery finds its
    class anew each time by reading every installed package's entry points: about 8 ms of CPU holding the GIL,
    paid by each new API thread on its first publish. When a batch began feeding, a burst of new threads stalled
    every request of the API for up to a second."""

    @cached_property
    def _backend_class(self) -> tuple[type, str]:
        backend_class, url = backends.by_url(self.backend_cls or self.conf.result_backend, self.loader)
        return backend_class, url

    def _get_backend(self) -> Any:
        backend_class, url = self._backend_class
        return backend_class(app=self, url=url)


def configure(app: Celery, settings: CommonSettings) -> None:
    """The part of the configuration computed from settings: connection, and limits or producer by process."""
    app.conf.update(celeryconfig.connection(settings))
    if isinstance(settings, WorkerSettings):
        app.conf.update(celeryconfig.limits(settings))
    if isinstance(settings, ApiSettings):
        app.conf.update(celeryconfig.producer(settings))


@before_task_publish.connect
def _stamp_sent(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Every message carries its publish time (a retry or redelivery keeps the original)."""
    if headers is not None:
        headers.setdefault(SENT_HEADER, time.time())
