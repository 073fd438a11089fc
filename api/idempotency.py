"""`Idempotency-Key` on submissions (`POST /v1/jobs`, `/v1/chat/completions`): a retry gets the first job back.

The first request with a key claims it atomically (SET NX) before anything else, so of twenty that arrive at once
exactly one is taken in; the others wait for it to finish and replay its job, without a job, an admission slot or a
queue message of their own. They wait on the API's announcements: the first request's claim is settled (the job it
made remembered, or the claim given up) by a script that also announces it, which wakes them at once; they look
again at least every `announcements.POLL_S` in case an announcement was lost. The claim lasts
`idempotency_claim_s` and is renewed while its request is taken in, however slowly its body arrives, so it never
lapses under a request still alive: one key makes one job. Hand-written because no library of the field does this
for a FastAPI app over Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import redis
from starlette.concurrency import run_in_threadpool

from api.announcements import Announcements
from api.intake import AcceptedRequest
from stoker.adapters.store import Store
from stoker.adapters.store.jobs import LoopJobs
from stoker.core.errors import IdempotencyKeyInUse, IdempotencyKeyReused, JobNotFound
from stoker.core.idempotency import HEADER, Remembered, check_key, key_digest, request_fingerprint
from stoker.core.jobs import Job
from stoker.settings import ApiSettings

log = logging.getLogger(__name__)

#: The longest a retry waits for the first request with its key to be taken in.
WAIT_S = 30.0
#: A held claim is renewed this many times per `idempotency_claim_s`: a renewal that fails (Redis away a moment)
#: leaves time for the next before the claim lapses.
RENEWALS_PER_CLAIM = 3


@dataclass(frozen=True)
class Key:
    """A request's idempotency key, as its tenant's digest."""

    digest: str


def key_of(headers: Mapping[str, str], tenant: str) -> Key | None:
    """The key among a request's headers, if it sent one (422 if it is not a valid key)."""
    raw = headers.get(HEADER)
    return Key(key_digest(tenant, check_key(raw))) if raw is not None else None


async def claim(store: Store, announcements: Announcements, key: Key, job_id: str, claim_s: int) -> Remembered | None:
    """Claim the key for `job_id` (None), or what it made when another request had it (waiting while that one is
    still being taken in; taking the key over if it gave up). 409 after `WAIT_S` of waiting."""
    until = time.monotonic() + WAIT_S
    held = await run_in_threadpool(store.idempotency.claim, key.digest, job_id, claim_s)
    while isinstance(held, str):
        holder = held
        with announcements.watch(holder) as settled:  # entered before looking again: no settlement goes unheard
            held = await run_in_threadpool(store.idempotency.claim, key.digest, job_id, claim_s)
            while held == holder:
                left = until - time.monotonic()
                if left <= 0:
                    raise IdempotencyKeyInUse()
                await announcements.wait(settled, left)
                held = await run_in_threadpool(store.idempotency.claim, key.digest, job_id, claim_s)
    return held


@dataclass
class Claim:
    """A key this request holds while it is taken in; `lost` is set once the claim is found no longer its own."""

    store: Store
    key: Key
    job_id: str
    claim_s: int
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    async def renew(self) -> None:
        """Renew the claim every `claim_s / RENEWALS_PER_CLAIM` until cancelled, or until it is no longer ours."""
        while True:
            await asyncio.sleep(self.claim_s / RENEWALS_PER_CLAIM)
            try:
                held = await run_in_threadpool(self.store.idempotency.renew, self.key.digest, self.job_id, self.claim_s)
            except redis.RedisError as exc:  # the claim still has time left: the next renewal may get through
                log.warning("could not renew the claim on an Idempotency-Key: %r", exc)
                continue
            if not held:
                self.lost.set()
                return

    async def confirm(self) -> None:
        """Before the job is made: 409 if the claim is no longer ours, since another request may have made the
        key's job by now (the claim is renewed once more, so it outlasts the writing of the job)."""
        if self.lost.is_set():
            raise IdempotencyKeyInUse()
        held = await run_in_threadpool(self.store.idempotency.renew, self.key.digest, self.job_id, self.claim_s)
        if not held:
            self.lost.set()
            raise IdempotencyKeyInUse()

    async def remember(self, settings: ApiSettings, accepted: AcceptedRequest) -> None:
        """The key now names the job it made, for `idempotency_ttl_s`."""
        remembered = Remembered(self.job_id, fingerprint(accepted))
        kept = await run_in_threadpool(
            self.store.idempotency.remember, self.key.digest, remembered, settings.idempotency_ttl_s
        )
        if not kept:
            log.warning("job %s was made after its Idempotency-Key's claim was lost", self.job_id)


@contextlib.asynccontextmanager
async def holding(store: Store, key: Key, job_id: str, claim_s: int) -> AsyncIterator[Claim]:
    """The claim `claim` took for `job_id`, renewed in the background for the duration of the block; given up if
    the block raises (no job was made: a retry may claim the key)."""
    held = Claim(store, key, job_id, claim_s)
    renewal = asyncio.create_task(held.renew())
    made = False
    try:
        yield held
        made = True
    finally:
        renewal.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewal
        if not made:
            with contextlib.suppress(redis.RedisError):  # unreleased, the claim lapses after claim_s anyway
                await run_in_threadpool(store.idempotency.release, key.digest, job_id)


def fingerprint(accepted: AcceptedRequest) -> str:
    """What replays are compared by: the request as intake normalised it."""
    inputs = [(item.kind, item.digest if item.url is None else "", item.url) for item in accepted.inputs]
    chat = accepted.chat.model_dump_json() if accepted.chat else None
    return request_fingerprint(accepted.prompt, inputs, accepted.deadline_ms, chat, accepted.callback_url)


async def replay(
    reads: LoopJobs, remembered: Remembered, tenant: str, read: Callable[[], Awaitable[AcceptedRequest]]
) -> Job:
    """The job a key made, for a retry of the same request (read and compared); 422 for a different one."""
    accepted = await read()
    if fingerprint(accepted) != remembered.fingerprint:
        raise IdempotencyKeyReused(param=HEADER)
    job = await reads.load_job(remembered.job_id)
    if job is None or job.tenant != tenant:  # its record outlived by the key: nothing to give back
        raise JobNotFound(f"no job {remembered.job_id}")
    return job
