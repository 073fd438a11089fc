"""The synchronous baseline: one worker that decodes, reads, transcribes, tokenizes and infers every job in one
thread, as inference servers did before stoker. Kept so `stoker bench` measures both designs on the same code.

Jobs arrive whole on the `sync` queue (`STOKER_PIPELINE_MODE=sync` in the API). The consumer collects them like
the inference consumer does (same batching policy), then, in its one thread, runs every stage of each job in turn
and the model once on the batch: batching what is already preprocessed is allowed, so the comparison is fair, but
the device waits while the thread preprocesses, and one slow input holds up every job behind it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

from celery.canvas import Signature, _chain, group
from celery.worker.request import Request
from celery_batches import Batches, SimpleRequest
from celery_batches.trace import apply_batches_task

from stoker.adapters.kombu_redis import reply_waits, unread_brpop
from stoker.core.batching import BatchPolicy, Waiting, plan_batch
from stoker.core.queues import SYNC_QUEUE
from stoker.runtime.batches import expire, load_batch, run_batch, write_batch
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeder import as_waiting, take_arrived
from stoker.runtime.stages.tokenization import hand_over
from stoker.runtime.watchdog import BatchWatchdog
from tasks.lifecycle import context, watchdog
from tasks.pipeline import preprocessing_branches
from tasks.worker import app

log = logging.getLogger(__name__)


class DeviceBatches(Batches):  # type: ignore[misc]
    """The baseline's receiver: celery-batches driven by stoker's batching policy, flushing only when the device is
    free (the solo pool runs each batch in the receiving thread itself, so a timer collects what came meanwhile).

    Plain celery-batches flushes whatever arrived each interval, even while the model is busy, so under load the
    pool queues many tiny batches. Here every request waits until the policy (`plan_batch`: size, token budget,
    wait since the first arrival, deadlines) says its batch goes, and never while a batch runs: the device runs
    back to back on batches as large as the queue allows. Requests whose deadline passed are answered and
    acked without reaching the model.

    As large as the queue allows, not as large as one tick's delivery: the receiver's one thread runs the batch,
    so the messages that queued meanwhile reach it only once it is back in the consumer's loop, a few each tick.
    While the broker still holds messages of its queue, or the consumer's `BRPOP` took one whose reply it has not
    read yet, a batch that is not full waits for them (`_backlog_to_take`, at most `STOKER_SYNC_BACKLOG_FILL_MS`
    after the device came free), as the inference consumer's intake takes what waits.
    """

    abstract = True

    def __init__(self) -> None:
        super().__init__()
        self._busy = threading.Event()
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[Waiting, Request]] = {}
        self.running: Collection[Request] = ()
        #: When the last batch returned (the device came free for this receiver).
        self._free_since = 0.0
        #: The Celery consumer this task's messages come through (`Strategy`).
        self._consumer: Any = None

    @property
    def flush_every(self) -> int:
        """celery-batches flushes at most this many at once: a full batch."""
        return context().settings.max_batch_size

    @functools.cached_property
    def policy(self) -> BatchPolicy:
        """The batching policy, from the worker's settings (read on the first flush, never at import)."""
        s = context().settings
        return BatchPolicy(
            max_batch_size=s.max_batch_size, max_batch_tokens=s.max_batch_tokens, max_wait_s=s.max_wait_ms / 1000
        )

    def _do_flush(self) -> None:
        with self._lock:
            now = time.time()
            for request in take_arrived(self._buffer, self._buffer.qsize()):
                self._waiting[request.id] = (as_waiting(request, now), request)
            plan = plan_batch([w for w, _ in self._waiting.values()], now, self.policy, not self._busy.is_set())
            if plan.run and self._backlog_to_take(len(plan.run), now):
                plan = replace(plan, run=[])
            expired = [self._waiting.pop(w.key)[1] for w in plan.expired]
            batch = [self._waiting.pop(w.key)[1] for w in plan.run]
            if not self._waiting and not batch:
                self._stop_timer()
        for request in expired:
            _drop_expired(context(), request)
        if batch:
            self._busy.set()
            try:
                self.flush(batch)
            except Exception:
                self._busy.clear()
                raise

    def _backlog_to_take(self, have: int, now: float) -> bool:
        """Whether a batch of `have` should wait for the messages its queue still holds: it is not full, this
        receiver may hold more, and the device came free less than `sync_backlog_fill_ms` ago."""
        s = context().settings
        if have >= self.policy.max_batch_size or now - self._free_since > s.sync_backlog_fill_ms / 1000:
            return False
        if len(self._waiting) >= s.infer_prefetch:
            return False
        if self._queued() > 0:
            return True
        return self._taken_unread()

    def _queued(self) -> int:
        return context().outbox.queue_depths([SYNC_QUEUE], timeout_s=1.0).get(SYNC_QUEUE, 0)

    def _taken_unread(self) -> bool:
        """Whether the consumer's `BRPOP` took a message off the queue that the depth no longer counts and the
        event loop has not read yet (the queue's last message, taken while the receiver looked)."""
        sock = unread_brpop(self._consumer, SYNC_QUEUE)
        if sock is None:
            return False
        # The server writes each round's replies before it reads the next round's commands, so once a later command
        # is answered, the reply to a BRPOP served before the depth was read is on the socket (the depth's own answer
        # can go out just before it, when both were served in one round).
        return self._queued() > 0 or reply_waits(sock)

    def Strategy(self, task: Any, app: Any, consumer: Any) -> Any:
        """celery-batches' handler of this task's messages; the consumer is kept to see what its broker sent."""
        self._consumer = consumer
        return super().Strategy(task, app, consumer)

    def _stop_timer(self) -> None:
        timer: Any = getattr(self, "_tref", None)
        if timer is not None:
            timer.cancel()
        self._tref = None

    def give_back(self) -> None:
        """Before the process is replaced: ack the running batch (its jobs have ended) and requeue the rest."""
        for request in self.running:
            request.acknowledge()
        with self._lock:
            waiting = [r for _, r in self._waiting.values()] + take_arrived(self._buffer, self._buffer.qsize())
            self._waiting.clear()
        for request in waiting:
            request.reject(requeue=True)

    def flush(self, requests: Collection[Request]) -> Any:
        """Run one batch in the pool; ack its messages and free the device when it returns."""
        serializable = ([SimpleRequest.from_request(r) for r in requests],)

        def on_return(_: Any) -> None:
            for request in requests:
                request.acknowledge()
            self.running = ()
            self._free_since = time.time()
            self._busy.clear()

        self.running = requests
        return self._pool.apply_async(apply_batches_task, (self, serializable, 0, None), callback=on_return)


def _drop_expired(ctx: WorkerContext, request: Request) -> None:
    """A request whose deadline passed before its batch: the job fails, the message is done with."""
    job_id = str((request.kwargs or {}).get("job_id"))
    try:
        expire(ctx, job_id, time.time())
        ctx.store.stats.count_drained("infer")
    finally:
        request.acknowledge()


#: How often the baseline's receiver looks at what waits (it has no arrival wake-up: its one thread is busy).
TICK_S = 0.01


@app.task(
    base=DeviceBatches,
    name="stoker.sync",
    flush_interval=TICK_S,
    acks_late=True,
    ignore_result=True,
)
def sync_jobs(requests: list[SimpleRequest]) -> None:
    """Preprocess each job of the batch in this thread, one after another, then run the model on them at once."""
    ctx = context()
    job_ids = [str(r.kwargs["job_id"]) for r in requests]
    ready = [job_id for job_id in job_ids if preprocess_inline(ctx, job_id)]
    ctx.store.stats.count_drained(SYNC_QUEUE, len(job_ids))
    serve_batch(ctx, ready, watchdog())


def serve_batch(ctx: WorkerContext, job_ids: Sequence[str], watchdog: BatchWatchdog) -> None:
    """Load, run and write one batch in this thread (the pipeline's consumer does each in a thread of its own)."""
    items = load_batch(ctx, job_ids)
    if items:
        write_batch(ctx, run_batch(ctx, items, watchdog))


def preprocess_inline(ctx: WorkerContext, job_id: str) -> bool:
    """Run every pending stage of the job here (the same stage code the pipeline runs as tasks), then tokenize.

    The stages' tasks are called in this thread, outside any chord, so a dense page is read whole (`tasks.preprocess`
    picks `whole_page` there); tokenize is its hand-over alone (`hand_over`: the model request stored, no inference
    message, no wait for room), since this thread serves the job itself; and this worker's settings have no speech
    lookahead (`tasks.lifecycle.as_its_kind_runs`). True when the job now waits for the model.
    """
    store = ctx.store
    job = store.jobs.load_job(job_id)
    if job is None or job.terminal:
        return False
    if job.status != "inferring":
        pending = [record for record in job.inputs if record.status == "pending"]
        for branch in preprocessing_branches(job_id, pending, app, ctx.settings.video_keyframes):
            run_inline(branch)
        hand_over(ctx, job_id)  # no inference message: this thread serves the job itself
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
