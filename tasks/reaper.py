"""The reaper's hands: what happens to a job that stopped making progress. Every accepted job reaches an end.

Which jobs are late and what they need is decided in `stoker.core.deadlines`; this module only acts on it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from stoker.core.deadlines import JobClock, ReapPolicy, Verdict, decide
from stoker.core.errors import DeadlineExceeded, InferenceFailed
from stoker.core.jobs import ErrorInfo
from tasks import resources
from tasks.monitoring import log_finished
from tasks.pipeline import enqueue_inference
from tasks.preprocess import cut_off, fail_unfinished
from tasks.worker import app

log = logging.getLogger(__name__)


def policy() -> ReapPolicy:
    """The reaper's patience, from settings."""
    s = resources.settings()
    return ReapPolicy(
        redrive_after_s=s.redrive_after_s,
        max_redrives=s.max_redrives,
        batch_timeout_s=s.infer_batch_timeout_s + s.infer_wedge_grace_s,
    )


def reap_once(now: float | None = None, limit: int = 200) -> Counter[str]:
    """Look at every job that is due, act on it, and count what was done."""
    store = resources.store()
    now = time.time() if now is None else now
    rules = policy()
    done: Counter[str] = Counter()
    for job_id in store.watch.due_jobs(now, limit):
        clock = store.watch.clock(job_id)
        verdict = decide(clock, now, rules)
        try:
            act(job_id, clock, verdict)
        except Exception:  # one job's trouble must not stop the reaper; look again shortly
            log.exception("reaper could not %s job %s", verdict.action, job_id)
            store.watch.watch_next(job_id, now + rules.recheck_s)
        done[verdict.action] += 1
    return done


def act(job_id: str, clock: JobClock, verdict: Verdict) -> None:
    """Carry out one verdict."""
    store = resources.store()
    if verdict.action != "wait":
        log.warning("reaper: job %s → %s (status %s)", job_id, verdict.action, clock.status)
    store.watch.watch_next(job_id, verdict.next_at)  # first, so a crash below is retried
    if verdict.action == "cutoff":
        cut_off(job_id)
    elif verdict.action == "expire":
        stage = "preprocess" if clock.preprocessed is None else "infer_queue"
        late = DeadlineExceeded("the deadline passed before the model could start", stage=stage)
        fail_unfinished(job_id, late)
        if store.jobs.finish(job_id, "failed", error=ErrorInfo(**late.to_dict())):
            log_finished(job_id)
    elif verdict.action == "redrive":
        request = store.jobs.get_request(job_id)
        store.watch.count_redrive(job_id)
        enqueue_inference(job_id, len(request.prompt_ids) if request else None, clock.deadline or None, app)
    elif verdict.action == "abandon":
        lost = InferenceFailed("the inference worker never reported back on this job's batch", stage="infer")
        if store.jobs.finish(job_id, "failed", error=ErrorInfo(**lost.to_dict())):
            log_finished(job_id)
