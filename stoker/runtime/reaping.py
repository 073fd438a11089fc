"""The reaper's hands: what happens to a job that stopped making progress. Every accepted job reaches an end.

Which jobs are late and what they need is decided in `stoker.core.deadlines`; this module only acts on it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from stoker.core.deadlines import JobClock, ReapPolicy, Verdict, decide
from stoker.core.errors import DeadlineExceeded, InferenceFailed, WorkerLost
from stoker.core.jobs import ErrorInfo
from stoker.core.queues import CPU_QUEUES
from stoker.runtime.context import WorkerContext
from stoker.runtime.handoff import fail_unfinished
from stoker.runtime.monitoring import log_finished
from stoker.runtime.stages.tokenization import cut_off

log = logging.getLogger(__name__)


def policy(ctx: WorkerContext) -> ReapPolicy:
    """The reaper's patience, from settings."""
    s = ctx.settings
    return ReapPolicy(
        redrive_after_s=s.redrive_after_s,
        max_redrives=s.max_redrives,
        batch_timeout_s=s.infer_batch_timeout_s + s.infer_wedge_grace_s,
        visibility_timeout_s=s.visibility_timeout_s,
    )


def reap_once(ctx: WorkerContext, now: float | None = None, limit: int = 200) -> Counter[str]:
    """Look at every job that is due, act on it, and count what was done."""
    store = ctx.store
    now = time.time() if now is None else now
    rules = policy(ctx)
    done: Counter[str] = Counter()
    for job_id in store.watch.due_jobs(now, limit):
        clock = store.watch.clock(job_id)
        verdict = decide(clock, now, rules)
        try:
            act(ctx, job_id, clock, verdict)
        except Exception:  # one job's trouble must not stop the reaper; look again shortly
            log.exception("reaper could not %s job %s", verdict.action, job_id)
            store.watch.watch_next(job_id, now + rules.recheck_s)
        done[verdict.action] += 1
    return done


def recover_lost(ctx: WorkerContext) -> Counter[str]:
    """Jobs held by inference consumers that died (their heartbeat lapsed), a batch on the device included: sent
    again at once, so a live worker serves them within seconds; a job lost with its consumer more than
    `max_deliveries` times fails as worker_lost."""
    done: Counter[str] = Counter()
    for consumer, job_ids in ctx.store.consumers.take_lost().items():
        log.warning("inference consumer %s is gone: sending its %d jobs again", consumer, len(job_ids))
        for job_id in job_ids:
            done[resend_lost(ctx, job_id)] += 1
    return done


def lift_aged(ctx: WorkerContext) -> Counter[str]:
    """The age bound of small-before-large: stage messages of medium and large inputs that waited
    `small_first_max_age_s` in their queues go to the front, so small inputs never starve them."""
    max_age_s = ctx.settings.small_first_max_age_s
    moved = ctx.outbox.promote_aged(CPU_QUEUES, max_age_s) if max_age_s > 0 else 0
    return Counter({"lifted": moved} if moved else {})


def dispatch_callbacks(ctx: WorkerContext, now: float | None = None) -> Counter[str]:
    """Hand every due completion callback to a CPU worker (`stoker.callback`); one that cannot be sent now is due
    again in a few seconds."""
    store = ctx.store
    now = time.time() if now is None else now
    done: Counter[str] = Counter()
    for job_id in store.callbacks.due(now):
        if not store.callbacks.take(job_id):  # another reaper took it (it lost the lease meanwhile)
            continue
        try:
            ctx.outbox.send_callback(job_id)
        except Exception:
            log.exception("could not send the callback of job %s; again shortly", job_id)
            store.callbacks.put_back(job_id, now + 5)
            continue
        done["callback"] += 1
    return done


def resend_lost(ctx: WorkerContext, job_id: str) -> str:
    """One job of a dead consumer: send it to the inference queue again, or give up on it."""
    store = ctx.store
    losses = store.watch.count_loss(job_id)
    if losses is None:
        return "forget"
    if losses > ctx.settings.max_deliveries:
        lost = WorkerLost(f"its inference worker died {losses} times while holding it", stage="infer")
        if store.jobs.finish(job_id, "failed", error=ErrorInfo(**lost.to_dict())):
            log_finished(store, job_id)
        return "lost"
    request, clock = store.jobs.get_request(job_id), store.watch.clock(job_id)
    ctx.outbox.enqueue_inference(job_id, len(request.prompt_ids) if request else None, clock.deadline or None)
    return "resend"


def restart(ctx: WorkerContext, job_id: str, clock: JobClock) -> bool:
    """A job whose preprocessing messages may be lost (`deadlines.restart_due`): no stage started it long after it
    was accepted, or none wrote anything for longer than a dead worker's messages take to come back. While a CPU
    queue holds messages, one of its may be waiting there (looked at again later); with them all empty it has none
    left (lost with a worker SIGKILLed as it took one off the queue, or with a process that died between writing the
    record and publishing): sent to preprocessing again. Its stages pass over inputs that failed or were skipped and
    downloads already stored; the rest they do again, from the stage cache where a first run left its results."""
    if any(ctx.outbox.queue_depths(CPU_QUEUES).values()):
        return False
    if ctx.store.watch.clock(job_id) != clock:  # a stage moved it since the verdict: not lost after all
        return False
    job = ctx.store.jobs.load_job(job_id)
    if job is None or job.status not in ("queued", "preprocessing"):
        return False
    if job.status == "queued":
        log.warning("job %s: no stage started it and no CPU queue holds anything: sending it again", job_id)
    else:
        log.warning("job %s: preprocessing stalled and no CPU queue holds anything: sending it again", job_id)
    ctx.store.watch.count_redrive(job_id)
    ctx.outbox.resubmit(job, clock.deadline or None)
    return True


def act(ctx: WorkerContext, job_id: str, clock: JobClock, verdict: Verdict) -> None:
    """Carry out one verdict."""
    store = ctx.store
    if verdict.action != "wait":
        log.warning("reaper: job %s → %s (status %s)", job_id, verdict.action, clock.status)
    store.watch.watch_next(job_id, verdict.next_at)  # first, so a crash below is retried
    if verdict.action == "cutoff":
        cut_off(ctx, job_id)
    elif verdict.action == "expire":
        stage = "preprocess" if clock.preprocessed is None else "infer_queue"
        late = DeadlineExceeded("the deadline passed before the model could start", stage=stage)
        fail_unfinished(ctx, job_id, late)
        if store.jobs.finish(job_id, "failed", error=ErrorInfo(**late.to_dict())):
            log_finished(store, job_id)
    elif verdict.action == "restart":
        restart(ctx, job_id, clock)
    elif verdict.action == "redrive":
        request = store.jobs.get_request(job_id)
        store.watch.count_redrive(job_id)
        ctx.outbox.enqueue_inference(job_id, len(request.prompt_ids) if request else None, clock.deadline or None)
    elif verdict.action == "abandon":
        lost = InferenceFailed("the inference worker never reported back on this job's batch", stage="infer")
        if store.jobs.finish(job_id, "failed", error=ErrorInfo(**lost.to_dict())):
            log_finished(store, job_id)
