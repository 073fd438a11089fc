"""The inference consumer: a celery-batches task that runs one model call per collected batch."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from queue import Empty, Queue
from typing import Any

from celery.signals import celeryd_after_setup
from celery.worker.request import Request
from celery_batches import Batches, SimpleRequest
from celery_batches.trace import apply_batches_task

from stoker.errors import DeadlineExceeded, InferenceFailed, StokerError
from stoker.jobs import BatchInfo, ErrorInfo, ResultInfo, final_status
from stoker.predictor import Prediction, Predictor, run_predictor
from stoker.watchdog import BatchWatchdog, RunningBatch
from tasks import resources
from tasks.app import app

log = logging.getLogger(__name__)
_settings = resources.settings()


@dataclass(frozen=True)
class BatchItem:
    """One job in a batch, with its tokenized prompt."""

    job_id: str
    prompt_ids: list[int]
    preprocessed_at: float


class DeviceBatches(Batches):  # type: ignore[misc]
    """celery-batches, flushing only when the device is free and never more than flush_every at once.

    Plain celery-batches flushes whatever arrived each interval, even while the model is busy, so under load the
    pool queues many tiny batches. Here requests wait in the buffer until the running batch returns, then the next
    flush takes up to a full batch: the device runs back to back on batches as large as the queue allows.
    """

    abstract = True

    def __init__(self) -> None:
        super().__init__()
        self._busy = threading.Event()
        self.running: Collection[Request] = ()

    def _do_flush(self) -> None:
        if self._busy.is_set():
            return  # the timer comes back; requests keep accumulating meanwhile
        requests = _take(self._buffer, self.flush_every)
        if not requests:
            timer: Any = getattr(self, "_tref", None)
            if timer is not None:
                timer.cancel()
            self._tref = None
            return
        self._busy.set()
        try:
            self.flush(requests)
        except Exception:
            self._busy.clear()
            raise

    def give_back(self) -> None:
        """Before the process is replaced: ack the running batch (its jobs have ended) and requeue the rest."""
        for request in self.running:
            request.acknowledge()
        for request in _take(self._buffer, self._buffer.qsize()):
            request.reject(requeue=True)

    def flush(self, requests: Collection[Request]) -> Any:
        """Run one batch in the pool; ack its messages and free the device when it returns."""
        serializable = ([SimpleRequest.from_request(r) for r in requests],)

        def on_return(_: Any) -> None:
            for request in requests:
                request.acknowledge()
            self.running = ()
            self._busy.clear()

        self.running = requests
        return self._pool.apply_async(apply_batches_task, (self, serializable, 0, None), callback=on_return)


def _take(buffer: Queue[Request], limit: int) -> list[Request]:
    items: list[Request] = []
    while len(items) < limit:
        try:
            items.append(buffer.get_nowait())
        except Empty:
            break
    return items


@app.task(
    base=DeviceBatches,
    name="stoker.infer",
    flush_every=_settings.max_batch_size,
    flush_interval=_settings.max_wait_ms / 1000,
    acks_late=True,
    ignore_result=True,
)
def infer(requests: list[SimpleRequest]) -> None:
    """Serve one batch of jobs; messages are acked when this returns, after every result is written."""
    serve_batch([str(r.kwargs["job_id"]) for r in requests])


def serve_batch(job_ids: Sequence[str]) -> None:
    """Load the batch's prompts, run the model once, write each job's result."""
    store = resources.store()
    items = _load_items(job_ids)
    if not items:
        return
    batch_id, started = uuid.uuid4().hex[:12], time.time()
    for item in items:
        store.stamp(item.job_id, "infer_start", at=started)
    watchdog.begin(batch_id, [i.job_id for i in items])
    try:
        outcomes = predict_isolated(resources.predictor(), [i.prompt_ids for i in items])
    finally:
        ran = watchdog.end()
    ended = time.time()
    for item, outcome in zip(items, outcomes, strict=True):
        store.stamp(item.job_id, "infer_end", at=ended)
        batch = BatchInfo(id=batch_id, size=len(items), wait_ms=round((started - item.preprocessed_at) * 1000, 2))
        _finish(item.job_id, outcome, batch)
    late = " (past its budget: results dropped)" if ran and ran.overdue else ""
    log.info("batch %s: %d jobs in %.0f ms%s", batch_id, len(items), (ended - started) * 1000, late)


def _load_items(job_ids: Sequence[str]) -> list[BatchItem]:
    """Jobs still waiting for the model; a redelivered message of a finished job has no prompt left.

    A job whose deadline passed while it waited is dropped here, before the model: no one is waiting for it.
    """
    store = resources.store()
    items = []
    now = time.time()
    for job_id in dict.fromkeys(job_ids):
        ids = store.get_tokens(job_id)
        if ids is None:
            log.info("job %s has no pending prompt; skipping", job_id)
            continue
        clock = store.clock(job_id)
        if clock.deadline and now >= clock.deadline:
            late = DeadlineExceeded("the deadline passed while the job waited for the model", stage="infer_queue")
            store.finish(job_id, "failed", error=ErrorInfo(**late.to_dict()))
            log.info("job %s dropped: deadline passed %.1fs ago", job_id, now - clock.deadline)
            continue
        items.append(BatchItem(job_id, ids, clock.preprocessed or now))
    return items


def predict_isolated(predictor: Predictor, prompts: list[list[int]]) -> list[Prediction | StokerError]:
    """Run the batch; if it fails, retry each prompt alone so one bad item fails alone."""
    try:
        return list(run_predictor(predictor, prompts))
    except Exception:
        if len(prompts) == 1:
            log.exception("inference failed")
            return [InferenceFailed("the model failed on this request", stage="infer")]
        log.exception("batch of %d failed; retrying items one by one", len(prompts))
    outcomes: list[Prediction | StokerError] = []
    for prompt in prompts:
        outcomes.extend(predict_isolated(predictor, [prompt]))
    return outcomes


def _finish(job_id: str, outcome: Prediction | StokerError, batch: BatchInfo) -> None:
    store = resources.store()
    if isinstance(outcome, StokerError):
        store.finish(job_id, "failed", error=ErrorInfo(**outcome.to_dict()), batch=batch)
        return
    job = store.load_job(job_id)
    status = final_status(job.inputs) if job else "succeeded"
    result = ResultInfo(
        text=outcome.text,
        model=_settings.model,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
    )
    store.finish(job_id, status, result=result, batch=batch)


def _fail_overdue(batch: RunningBatch) -> None:
    """The batch ran past its budget: its jobs fail now (a late return changes nothing)."""
    late = InferenceFailed(f"batch {batch.id} ran past its {watchdog.budget_s:.0f}s budget", stage="infer")
    for job_id in batch.job_ids:
        resources.store().finish(job_id, "failed", error=ErrorInfo(**late.to_dict()))


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
    if "infer" in set(instance.app.amqp.queues.consume_from or {}):
        resources.predictor()
        watchdog.watch()
