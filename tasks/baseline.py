"""The synchronous baseline: one worker that decodes, reads, transcribes, tokenizes and infers every job in one
thread, as inference servers did before stoker. Kept so `stoker bench` measures both designs on the same code.

Jobs arrive whole on the `sync` queue (`STOKER_PIPELINE_MODE=sync` in the API). The consumer collects them like
the inference consumer does (same batching policy), then, in its one thread, runs every stage of each job in turn
and the model once on the batch: batching what is already preprocessed is allowed, so the comparison is fair, but
the device waits while the thread preprocesses, and one slow input holds up every job behind it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.canvas import Signature, _chain, group
from celery.signals import celeryd_after_setup
from celery_batches import SimpleRequest

from stoker.core.queues import SYNC_QUEUE
from tasks import resources
from tasks.inference import TICK_S, DeviceBatches, serve_batch
from tasks.pipeline import preprocessing_branches
from tasks.preprocess import pipeline_context, tokenize_job
from tasks.worker import app

log = logging.getLogger(__name__)


@app.task(
    base=DeviceBatches,
    name="stoker.sync",
    flush_every=resources.settings().max_batch_size,
    flush_interval=TICK_S,
    acks_late=True,
    ignore_result=True,
)
def sync_jobs(requests: list[SimpleRequest]) -> None:
    """Preprocess each job of the batch in this thread, one after another, then run the model on them at once."""
    job_ids = [str(r.kwargs["job_id"]) for r in requests]
    ready = [job_id for job_id in job_ids if preprocess_inline(job_id)]
    resources.store().stats.count_drained(SYNC_QUEUE, len(job_ids))
    serve_batch(ready)


def preprocess_inline(job_id: str) -> bool:
    """Run every pending stage of the job here (the same stage code the pipeline runs as tasks), then tokenize.

    True when the job now waits for the model.
    """
    store = resources.store()
    job = store.jobs.load_job(job_id)
    if job is None or job.terminal:
        return False
    if job.status != "inferring":
        pending = [record for record in job.inputs if record.status == "pending"]
        for branch in preprocessing_branches(job_id, pending, app, resources.settings().video_keyframes):
            run_inline(branch)
        tokenize_job(job_id, backpressure=False, enqueue=False)
    return store.jobs.get_request(job_id) is not None


def run_inline(signature: Signature, previous: Any = None) -> Any:
    """Call a chain's (or group's) tasks in this process, in order, each given the result of the one before."""
    if isinstance(signature, _chain):
        for task in signature.tasks:
            previous = run_inline(task, previous)
        return previous
    if isinstance(signature, group):
        return [run_inline(task, previous) for task in signature.tasks]
    return signature() if previous is None else signature(previous)


@celeryd_after_setup.connect
def _preload(sender: str, instance: Any, **_: Any) -> None:
    """The sync worker needs everything the CPU workers load, before its first job."""
    if SYNC_QUEUE in set(instance.app.amqp.queues.consume_from or {}):
        pipeline_context()
        resources.tesseract()
