"""`Idempotency-Key` on submissions (`POST /v1/jobs`, `/v1/chat/completions`): a retry gets the first job back.

The first request with a key claims it atomically (SET NX) before anything else, so of twenty that arrive at once
exactly one is taken in; the others wait for it to finish (polling the key: it takes milliseconds) and replay its
job, without a job, an admission slot or a queue message of their own. Hand-written because no library of the
field does this for a FastAPI app over Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from api.intake import AcceptedRequest
from stoker.adapters.store import Store
from stoker.core.errors import IdempotencyKeyInUse, IdempotencyKeyReused, JobNotFound
from stoker.core.idempotency import HEADER, Remembered, check_key, key_digest, request_fingerprint
from stoker.core.jobs import Job
from stoker.settings import ApiSettings

#: A claim lapses this long after its request stopped (crashed mid-intake), so the key can be used again.
CLAIM_TTL_S = 60
#: The longest a retry waits for the first request with its key to be taken in.
WAIT_S = 30.0


@dataclass(frozen=True)
class Key:
    """A request's idempotency key, as its tenant's digest."""

    digest: str


def key_of(request: Request, tenant: str) -> Key | None:
    """The request's key, if it sent one (422 if it is not a valid key)."""
    raw = request.headers.get(HEADER)
    return Key(key_digest(tenant, check_key(raw))) if raw is not None else None


async def claim(store: Store, key: Key, job_id: str) -> Remembered | None:
    """Claim the key for `job_id` (None), or what it made when another request had it (waiting while that one is
    still being taken in; taking the key over if it gave up)."""
    until = time.monotonic() + WAIT_S
    while True:
        held = await run_in_threadpool(store.idempotency.claim, key.digest, job_id, CLAIM_TTL_S)
        if held is None or isinstance(held, Remembered):
            return held
        if time.monotonic() > until:
            raise IdempotencyKeyInUse()
        await asyncio.sleep(0.02)


def fingerprint(accepted: AcceptedRequest) -> str:
    """What replays are compared by: the request as intake normalised it."""
    inputs = [(item.kind, item.digest if item.url is None else "", item.url) for item in accepted.inputs]
    chat = accepted.chat.model_dump_json() if accepted.chat else None
    return request_fingerprint(accepted.prompt, inputs, accepted.deadline_ms, chat, accepted.callback_url)


async def replay(
    store: Store, remembered: Remembered, tenant: str, read: Callable[[], Awaitable[AcceptedRequest]]
) -> Job:
    """The job a key made, for a retry of the same request (read and compared); 422 for a different one."""
    accepted = await read()
    if fingerprint(accepted) != remembered.fingerprint:
        raise IdempotencyKeyReused(param=HEADER)
    job = await run_in_threadpool(store.jobs.load_job, remembered.job_id)
    if job is None or job.tenant != tenant:  # its record outlived by the key: nothing to give back
        raise JobNotFound(f"no job {remembered.job_id}")
    return job


async def remember(store: Store, settings: ApiSettings, key: Key, job_id: str, accepted: AcceptedRequest) -> None:
    """The key now names the job it made, for `idempotency_ttl_s`."""
    remembered = Remembered(job_id, fingerprint(accepted))
    await run_in_threadpool(store.idempotency.remember, key.digest, remembered, settings.idempotency_ttl_s)
