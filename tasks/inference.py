"""The inference queue's consumer: the `stoker.infer` task, the feeder behind it, and the device's watchdog.

How a batch is loaded, run and written is `tasks.batches`; how batches are formed and kept flowing so the device
never waits is `tasks.feeder`.
"""

from __future__ import annotations

import logging
import os
from queue import Empty, Queue
from typing import Any

from celery.signals import celeryd_after_setup, worker_shutting_down
from celery.worker.request import Request
from celery_batches import Batches, SimpleRequest

from stoker.core.batching import BatchPolicy
from stoker.core.errors import InferenceFailed
from stoker.core.jobs import ErrorInfo
from tasks import monitoring, resources
from tasks.feeder import Feeder
from tasks.watchdog import BatchWatchdog, RunningBatch
from tasks.worker import app

log = logging.getLogger(__name__)
_settings = resources.settings()


class Feed(Batches):  # type: ignore[misc]
    """celery-batches as the inference queue's receiver: every message goes to the feeder the moment it arrives
    (flush_every=1), so arrival wakes the consumer; no polling tick stands between a job and the device."""

    abstract = True

    def _do_flush(self) -> None:
        arrived = take_arrived(self._buffer, self._buffer.qsize())
        if arrived:
            feeder().add(arrived)

    def give_back(self) -> None:
        """The device is wedged and the process is replaced: see `Feeder.give_back`."""
        feeder().give_back(wedged=True)


def take_arrived(buffer: Queue[Request], limit: int) -> list[Request]:
    """Up to `limit` messages celery-batches has buffered, without waiting."""
    items: list[Request] = []
    while len(items) < limit:
        try:
            items.append(buffer.get_nowait())
        except Empty:
            break
    return items


@app.task(base=Feed, name="stoker.infer", flush_every=1, flush_interval=1.0, acks_late=True, ignore_result=True)
def infer(requests: list[SimpleRequest]) -> None:
    """Never called: the feeder runs the batches (`Feed._do_flush` hands every message to it)."""
    raise RuntimeError("stoker.infer messages are served by the feeder")


_feeder: list[Feeder] = []


def feeder() -> Feeder:
    """This worker's feeder, made on first use."""
    if not _feeder:
        policy = BatchPolicy(
            max_batch_size=_settings.max_batch_size,
            max_batch_tokens=_settings.max_batch_tokens,
            max_wait_s=_settings.max_wait_ms / 1000,
        )
        _feeder.append(Feeder(policy, watchdog))
    return _feeder[0]


def _fail_overdue(batch: RunningBatch) -> None:
    """The batch ran past its budget: its jobs fail now (a late return changes nothing)."""
    late = InferenceFailed(f"batch {batch.id} ran past its {watchdog.budget_s:.0f}s budget", stage="infer")
    for job_id in batch.job_ids:
        resources.store().jobs.finish(job_id, "failed", error=ErrorInfo(**late.to_dict()))


#: Exit status of an inference worker that gave up on a wedged device; its supervisor starts a fresh one.
WEDGED_EXIT = 75


def _replace_worker(batch: RunningBatch) -> None:
    """The device is wedged: hand the queued messages back and exit, so a fresh process takes over."""
    try:
        infer.give_back()
    finally:
        logging.shutdown()
        os._exit(WEDGED_EXIT)


watchdog = BatchWatchdog(_settings.infer_batch_timeout_s, _settings.infer_wedge_grace_s, _fail_overdue, _replace_worker)


@celeryd_after_setup.connect
def _preload(sender: str, instance: Any, **_: Any) -> None:
    """Load the model when this worker consumes the inference queue, before the first batch arrives."""
    queues = set(instance.app.amqp.queues.consume_from or {})
    if {"infer", "sync"} & queues:
        resources.predictor()
        watchdog.watch()
        monitoring.watch_device(_settings.device_sample_s)
    if "infer" in queues:
        feeder().start()


@worker_shutting_down.connect
def _leave(**_: Any) -> None:
    """A clean stop: the feeder's messages go back to the queue, and it stops beating."""
    if _feeder:
        _feeder[0].give_back()
