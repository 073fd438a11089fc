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
    """Celery, with its result backend's class looked up once per app instead of once per thread, and, in a process
    that only publishes (`publish_only`), a backend that waits on no result.

    A backend that is not thread-safe (Redis's) is made once for each thread that publishes, and Celery finds its
    class anew each time by reading every installed package's entry points: about 8 ms of CPU holding the GIL,
    paid by each new API thread on its first publish. When a batch began feeding, a burst of new threads stalled
    every request of the API for up to a second (docs/bench/log/2026-12-02-batchfill-line-policy.md)."""

    #: Set by `configure` for the API: it publishes jobs and never waits on a Celery result (a job's is in the job
    #: store), so its backend subscribes to no result channel (`PublishOnly`).
    publish_only = False

    @cached_property
    def _backend_class(self) -> tuple[type, str]:
        backend_class, url = backends.by_url(self.backend_cls or self.conf.result_backend, self.loader)
        if self.publish_only:
            backend_class = type(f"PublishOnly{backend_class.__name__}", (PublishOnly, backend_class), {})
        return backend_class, url

    def _get_backend(self) -> Any:
        backend_class, url = self._backend_class
        return backend_class(app=self, url=url)


class PublishOnly:
    """A result backend (mixed in before Celery's own) for a process that publishes and never waits on a result.

    Celery's Redis backend subscribes its publisher to the result channel of every task it sends that keeps a
    result, and of a chord's header (every job with media), starting a thread that drains them; once it has
    subscribed to one, it unsubscribes for every result handle that is dropped (every job the API publishes after
    its first job with media): a round trip per job, and a listener's work per result, for results nobody here
    reads. Celery has no setting for a publisher that never joins (its own workers skip the subscription through a
    private flag of theirs)."""

    def on_task_call(self, producer: Any, task_id: str) -> None:
        """Subscribe to nothing."""

    def add_pending_result(self, result: Any, weak: bool = False, start_drainer: bool = True) -> Any:
        """Wait on nothing (a group's result handle asks to: a chord's header)."""
        return result

    def add_pending_results(self, results: Any, weak: bool = False) -> Any:
        """Wait on none of them."""
        return results

    def remove_pending_result(self, result: Any) -> Any:
        """Nothing to leave: no result handle is pending here."""
        return result


def configure(app: Celery, settings: CommonSettings) -> None:
    """The part of the configuration computed from settings: connection, and limits or producer by process."""
    app.conf.update(celeryconfig.connection(settings))
    if isinstance(settings, WorkerSettings):
        app.conf.update(celeryconfig.limits(settings))
        app.conf.update(task_publish_retry_policy=celeryconfig.WORKER_PUBLISH_RETRY_POLICY)
    if isinstance(settings, ApiSettings):
        app.conf.update(celeryconfig.producer(settings))
        app.publish_only = True


@before_task_publish.connect
def _stamp_sent(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Every message carries its publish time (a retry or redelivery keeps the original)."""
    if headers is not None:
        headers.setdefault(SENT_HEADER, time.time())
