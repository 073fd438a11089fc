"""The completion callback of an ended job: POSTed, signed, to its `callback_url` by a CPU worker.

The job has ended before this runs (the finish script put it on the due list, the reaper handed it here), so a
slow or failing receiver never holds a job up. A failure that may pass (5xx, 408, 429, a timeout, the network) is
tried again with exponential backoff up to `callback_max_attempts`; anything else (a 4xx, a refused address) gives
up at once. Each attempt is written into the job's `callback` state.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Literal

from celery import Task

from stoker.adapters import urlfetch
from stoker.adapters.urlfetch import FetchPolicy
from stoker.core.callbacks import SIGNATURE_HEADER, TIMESTAMP_HEADER, backoff_s, deployment_fallback, signature_header
from stoker.core.errors import FetchTimeout, FetchUnavailable, StokerError
from stoker.core.jobs import CallbackState, Job
from stoker.core.tenancy import DEFAULT_TENANT
from stoker.core.urls import Allowlist
from stoker.runtime.context import WorkerContext
from tasks.lifecycle import context
from tasks.worker import app

log = logging.getLogger(__name__)

#: Failures worth another attempt.
RETRYABLE = (FetchUnavailable, FetchTimeout)


@app.task(name="stoker.callback", bind=True, max_retries=None)
def deliver(self: Task, job_id: str) -> str:
    """One attempt at POSTing an ended job to its callback URL; schedules the next attempt if this one may pass."""
    ctx = context()
    store = ctx.store
    state, job = store.callbacks.state(job_id), store.jobs.load_job(job_id)
    if state is None or job is None or state.status != "pending":
        return "skipped"
    attempt, settings = state.attempts + 1, ctx.settings
    try:
        send(ctx, state.url, job)
    except RETRYABLE as exc:
        left = attempt < settings.callback_max_attempts
        store.callbacks.record(job_id, _after(state, attempt, exc, "pending" if left else "failed"))
        if not left:
            log.warning("callback of job %s given up after %d attempts: %s", job_id, attempt, exc.message)
            return "failed"
        raise self.retry(countdown=backoff_s(attempt, settings.callback_backoff_s)) from exc
    except StokerError as exc:
        store.callbacks.record(job_id, _after(state, attempt, exc, "failed"))
        log.warning("callback of job %s refused: %s", job_id, exc.message)
        return "failed"
    store.callbacks.record(job_id, state.model_copy(update={"status": "delivered", "attempts": attempt}))
    return "delivered"


def send(ctx: WorkerContext, url: str, job: Job) -> None:
    """POST the job as GET /v1/jobs/{id} shows it, signed with its tenant's live secrets and the time of sending."""
    body = json.dumps(job.model_dump(mode="json")).encode()
    now = int(time.time())
    headers = {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: str(now),
        SIGNATURE_HEADER: signature_header(live_secrets(ctx, job.tenant or DEFAULT_TENANT), now, body),
    }
    urlfetch.post(url, body, headers, policy(ctx))


def live_secrets(ctx: WorkerContext, tenant: str) -> list[str]:
    """The secrets a tenant's callbacks are signed with: its own (two during a rotation's grace); the deprecated
    deployment-wide one only for the default tenant, and only until that tenant has one of its own."""
    fallback = deployment_fallback(tenant, ctx.settings.callback_secret)
    return ctx.store.callbacks.live_secrets(tenant, fallback)


def policy(ctx: WorkerContext) -> FetchPolicy:
    """A callback goes where a URL input may be fetched from (the same allowlist), within its own time cap."""
    s = ctx.settings
    return FetchPolicy(0, s.callback_timeout_s, 0, Allowlist.parse(s.url_allowlist))


def _after(state: CallbackState, attempt: int, exc: StokerError, status: Literal["pending", "failed"]) -> CallbackState:
    return state.model_copy(update={"status": status, "attempts": attempt, "last_error": f"{exc.code}: {exc.message}"})
