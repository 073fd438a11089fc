"""The batch feeder: the loop that moves every batch on, in a process of its own (`stoker batch-feeder`, as
`stoker up`, Compose and Kubernetes run it) or in an API process (`STOKER_BATCH_FEEDER`); one feeder of a
deployment at a time, by lease. It validates a new batch's input file; feeds its lines as stoker jobs of class
`batch` through the same intake as `/v1/chat/completions` (`api.chat_intake.accept_chat`,
`api.submission.submit_line`), only into the room the queues' watermarks leave and never more than
`STOKER_BATCH_MAX_IN_FLIGHT` at once; and has each ended line's outcome collected and the batch ended (its output
and error files written) when it completes, is cancelled or expires, by `api.openai_batch_ends`.

Every step's progress is in the store, so a feeder that dies (SIGKILLed) is replaced by the next lease
holder, which resumes where it left off: a line's job id is derived from its batch and line number, so a line
fed again is found to exist and never runs twice, and each `custom_id`'s outcome is written once.

Each batch is moved on by itself: an error in one batch's step is that batch's (tried again later, and after
`MAX_STEP_FAULTS` tries in a row the batch fails), never the other batches'. The room a tick has is shared among
the tenants with running batches in turn, so one tenant's large batch never holds another's small one back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import TypeVar

import redis
from starlette.concurrency import run_in_threadpool

from api.chat_intake import accept_chat
from api.context import ApiContext, close_clients
from api.files import sweep_expired_files
from api.intake import AcceptedRequest
from api.limits import JsonValueCounter
from api.openai_batch_ends import OpenAIBatchEnds, missing_input, next_lines
from api.submission import submit_line, unmake
from stoker.adapters.store.coordination import give_up_lease
from stoker.adapters.store.keys import BATCH_FEEDER_LEASE_KEY
from stoker.adapters.store.openai_batches import PendingLine, Progress
from stoker.core.errors import StokerError
from stoker.core.openai_batches import (
    LineError,
    OpenAIBatch,
    OpenAIBatchErrors,
    OpenAIBatchLine,
    OpenAIBatchStatus,
    RequestCounts,
    Room,
    Validation,
    index_entry,
    line_index_id,
    line_job_id,
    line_room,
    now_s,
    output_line,
    split_lines,
    tenant_turns,
)
from stoker.core.pacing import Pace
from stoker.core.queues import inference_depth
from stoker.settings import ApiSettings

log = logging.getLogger(__name__)
#: The most lines of one batch fed in one tick (taken in concurrently).
FEED_AT_ONCE = 32
#: How often expired files are looked for.
SWEEP_EVERY_S = 10.0
#: A batch whose step fails this many times in a row fails; it is tried again after 0.5 s, 1 s, 2 s, ...
MAX_STEP_FAULTS = 5
FAULT_BACKOFF_S = 0.5
T = TypeVar("T")


class OpenAIBatchFeeder:
    """Moves every active batch on, a step per tick, while this process holds the feeder's lease."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.holding = False  # the inference queue passed its high watermark: wait for the low one
        self._swept = 0.0
        self._turn = 0  # rounds of feeding so far: which tenant is served first in the next
        self._retry_at: dict[str, float] = {}  # batches whose last step failed: when they are tried again
        self.ends = OpenAIBatchEnds(context)

    async def run(self) -> None:
        """Tick until cancelled (the API's lifespan, or `stoker batch-feeder`'s signal handler): every
        `batch_feed_interval_s` while a batch is active, slower and slower while none is (up to `idle_max_wait_s`:
        a batch created meanwhile is taken up within that)."""
        settings = self.context.settings
        pace = Pace(settings.batch_feed_interval_s, settings.idle_max_wait_s)
        lease_s = max(settings.batch_feed_interval_s * 8, pace.max_s * 3, 2.0)  # never lapses between two ticks
        try:
            while True:
                active = False
                try:
                    if await run_in_threadpool(self._lease, lease_s):
                        active = await self.tick()
                except (redis.RedisError, OSError) as exc:
                    log.warning("batch feeder: %s", exc)
                except Exception:  # the loop must outlive any one batch's failure
                    log.exception("batch feeder: a tick failed")
                settings.batch_feeder_heartbeat.touch()
                await asyncio.sleep(pace.next_wait(active))
        finally:  # a clean stop gives the lease up: another feeder takes over at once, not when it lapses
            give_up_lease(self.context.settings, BATCH_FEEDER_LEASE_KEY, self.token)

    def _lease(self, lease_s: float) -> bool:
        return self.context.store.leases.take_lease(BATCH_FEEDER_LEASE_KEY, self.token, lease_s)

    async def tick(self) -> bool:
        """One round over every active batch: validate, collect, end, each batch by itself; then feed the room
        there is across tenants in turn. Whether any batch was active."""
        store = self.context.store
        if time.time() - self._swept >= SWEEP_EVERY_S:
            self._swept = time.time()
            await run_in_threadpool(sweep_expired_files, self.context)
        ids = await run_in_threadpool(store.openai_batches.active)
        room = await run_in_threadpool(self._room, ids)
        running = []
        for batch_id in ids:
            record = await self._guarded(batch_id, partial(self._advance, batch_id))
            if record is not None:
                running.append(record)
        await self._feed_in_turn(running, room)
        return bool(ids)

    async def _advance(self, batch_id: str) -> OpenAIBatch | None:
        """Move one batch on but for feeding; the batch if it has lines to feed."""
        store = self.context.store.openai_batches
        record = await run_in_threadpool(store.get, batch_id)
        if record is None or record.ended:
            await run_in_threadpool(store.retire, batch_id)
            return None
        return record if await self.step(record) else None

    async def _guarded(self, batch_id: str, work: Callable[[], Awaitable[T]]) -> T | None:
        """One batch's work, by itself: an error in it is that batch's alone (logged with its traceback the first
        time), tried again later and later, and the batch fails after `MAX_STEP_FAULTS` tries in a row. The
        store's errors are everyone's: the tick waits for the store."""
        if time.monotonic() < self._retry_at.get(batch_id, 0.0):
            return None
        try:
            done = await work()
        except redis.RedisError:
            raise
        except Exception as exc:  # one batch's fault (a bad line, a schema, a storage error) never stops the rest
            await run_in_threadpool(self._fault, batch_id, exc)
            return None
        if self._retry_at.pop(batch_id, None) is not None:
            await run_in_threadpool(self.context.store.openai_batches.clear_faults, batch_id)
        return done

    def _fault(self, batch_id: str, exc: Exception) -> None:
        """Count a failed step of a batch: tried again after a pause that doubles, failed after too many."""
        tries = self.context.store.openai_batches.note_fault(batch_id)
        if tries == 1:
            log.error("batch %s: its step failed (tried up to %d times)", batch_id, MAX_STEP_FAULTS, exc_info=exc)
        if tries < MAX_STEP_FAULTS:
            self._retry_at[batch_id] = time.monotonic() + FAULT_BACKOFF_S * 2 ** (tries - 1)
            return
        problem = f"{type(exc).__name__}: {exc}"
        log.error("batch %s failed: its step failed %d times in a row (%s)", batch_id, tries, problem)
        self._retry_at.pop(batch_id, None)
        self.ends.give_up(batch_id, problem)

    def _room(self, ids: list[str]) -> int:
        """How many lines may be fed this tick, over every batch."""
        settings, monitor = self.context.settings, self.context.monitor
        snapshot = monitor.fresh()
        if snapshot is None or monitor.store_full() is not None:
            return 0
        depths = {q.name: q.depth for q in snapshot.queues}
        marks = Room(settings.infer_high_watermark, settings.infer_low_watermark, settings.cpu_queue_limit)
        in_flight = self.context.store.openai_batches.in_flight(ids)
        most = settings.batch_max_in_flight
        if settings.auth and settings.max_jobs_in_flight > 0:  # leave a tenant room for its interactive jobs
            most = min(most, max(settings.max_jobs_in_flight // 2, 1))
        room = line_room(depths, in_flight, max_in_flight=most, room=marks, holding=self.holding)
        infer = inference_depth(depths)
        self.holding = infer > settings.infer_high_watermark or (self.holding and infer > settings.infer_low_watermark)
        return room

    async def step(self, record: OpenAIBatch) -> bool:
        """Move one batch on, but for feeding it: validate it, end it (cancelled, expired, completed) or collect
        its ended lines; whether it is running, with lines to feed."""
        ending = self._ending(record)
        if ending is not None:
            await run_in_threadpool(ending, record)
            return False
        await run_in_threadpool(self.ends.collect, record)
        if await run_in_threadpool(self.ends.all_done, record):
            await run_in_threadpool(self.ends.finish, record, "completed")
            return False
        return True

    def _ending(self, record: OpenAIBatch) -> Callable[[OpenAIBatch], None] | None:
        """What moves a batch on when it is not running: its validation, or its end; None while it runs."""
        expired = record.expires_at is not None and now_s() >= record.expires_at
        if record.in_progress_at is None:  # never started: no line of it ran, none is written anywhere
            if record.status == "cancelling" or expired:
                ending: OpenAIBatchStatus = "cancelled" if record.status == "cancelling" else "expired"
                return partial(self.ends.end_unstarted, ending=ending)
            return self._validate
        if record.status == "finalizing":
            return partial(self.ends.finish, ending="completed")
        if expired:
            return partial(self.ends.stop, ending="expired")
        if record.status == "cancelling":
            return partial(self.ends.stop, ending="cancelled")
        return None

    async def _feed_in_turn(self, running: list[OpenAIBatch], room: int) -> None:
        """Feed the room there is across tenants in turn: each tenant's next batch (its oldest first) is offered
        an equal share of the room left (at most `FEED_AT_ONCE` lines), the first tenant served changing every
        tick, so a small batch of one tenant never waits for a large one of another."""
        turns = tenant_turns(running, self._turn)
        self._turn += 1
        while room > 0 and turns:
            batches = turns.popleft()
            record = batches.popleft()
            share = min(max(room // (len(turns) + 1), 1), FEED_AT_ONCE)
            room -= await self._guarded(record.id, partial(self._feed, record, share)) or 0
            if batches:
                turns.append(batches)

    # -- validation -------------------------------------------------------------------------------------------
    def _validate(self, record: OpenAIBatch) -> None:
        """Read the input file through once: every line a request to the endpoint, within a request's limits, each
        custom_id once, one model; the tenant's files within their quota (its batches' output and error files
        count: a tenant past it runs no new batch). The custom_ids are kept in the batch's line index."""
        full = self._storage_full(record)
        if full is not None:
            self._refuse(record, [full])
            return
        check = self._check_lines(record)
        if check.errors:
            self._refuse(record, check.errors)
            return
        store = self.context.store.openai_batches
        store.update(record.id, request_counts=RequestCounts(total=check.requests).model_dump())
        store.move(record.id, "in_progress", now_s(), only_from=("validating",))  # cancelled meanwhile: see _ending

    def _refuse(self, record: OpenAIBatch, errors: list[LineError]) -> None:
        """A batch that failed validation: `failed`, with OpenAI's `errors` list."""
        store = self.context.store.openai_batches
        self.ends.drop_index(record.id)
        store.update(record.id, errors=OpenAIBatchErrors(data=errors).model_dump(mode="json"))
        if store.move(record.id, "failed", now_s(), only_from=("validating",)):
            store.retire(record.id)

    def _check_lines(self, record: OpenAIBatch) -> Validation:
        """Check every line of the input file, each held to the limits of the request it stands for (a line over
        them is never held whole), writing the line index as it goes; the check, its errors found."""
        settings, files = self.context.settings, self.context.files
        most = settings.max_body_bytes
        check = Validation(record.endpoint, settings.batch_max_requests, most, settings.max_json_values, _json_values)
        try:
            lines = split_lines(files.read(record.input_file_id), most)
            with files.create(line_index_id(record.id)) as index:
                for raw, _ in lines:
                    index.write(index_entry(check.add(raw)))
        except FileNotFoundError:
            check.errors.append(missing_input(record.input_file_id))
        check.finish()
        return check

    def _storage_full(self, record: OpenAIBatch) -> LineError | None:
        """Why the batch may not run: its tenant's stored files hold their whole quota; None if they do not."""
        quota = self.context.settings.files_tenant_max_bytes
        if quota == 0 or self.context.store.files.used(record.tenant) < quota:
            return None
        message = "the tenant's stored files (its batches' output and error files too) hold their whole quota"
        return LineError(code="tenant_storage_full", message=f"{message}: delete some first")

    # -- feeding ----------------------------------------------------------------------------------------------
    async def _feed(self, record: OpenAIBatch, room: int) -> int:
        """Feed up to `room` of the batch's next lines (at most `FEED_AT_ONCE` a tick, taken in together, so the
        lines' outcomes are collected between rounds); a refusal that will pass (the tenant's slots, the store,
        the broker) stops the cursor at that line, tried again next tick."""
        store = self.context.store.openai_batches
        progress = await run_in_threadpool(store.progress, record.id)
        try:
            lines = await run_in_threadpool(next_lines, self.context, record, progress, min(room, FEED_AT_ONCE))
        except FileNotFoundError:
            await run_in_threadpool(self.ends.input_gone, record, progress)
            return 0
        requests = [parsed for parsed, _ in lines if parsed is not None]
        outcomes = dict(
            zip(
                [r.number for r in requests],
                await asyncio.gather(*(self._feed_line(record, r) for r in requests)),
                strict=True,
            )
        )
        number = progress.lines
        for parsed, after in lines:
            if parsed is not None and outcomes[parsed.number] == "retry":
                break  # fed again from here (those after it that were made are found to exist then)
            number, progress = number + 1, Progress(number + 1, after)
        await run_in_threadpool(store.advance, record.id, progress)
        fed = sum(1 for outcome in outcomes.values() if outcome == "fed")
        if fed:
            await run_in_threadpool(store.count_fed, fed)
        return fed

    async def _feed_line(self, record: OpenAIBatch, line: OpenAIBatchLine) -> str:
        """Make one line a job (or write why it cannot run): "fed", "done" (nothing to feed) or "retry"."""
        job_id = line_job_id(record.id, line.number)
        pending = PendingLine(job_id, line.custom_id, line.number)
        try:
            accepted = await run_in_threadpool(self._prepare, record, pending, line)
            if accepted is None:
                return "fed"  # made before a crash, or settled already: collected like any other
            await submit_line(self.context, record.tenant, job_id, accepted, record.id)
            await run_in_threadpool(self.context.store.openai_batches.pend, record.id, replace(pending, sent=True))
        except StokerError as exc:
            return await run_in_threadpool(self._refused, record, pending, exc)
        return "fed"

    def _prepare(self, record: OpenAIBatch, pending: PendingLine, line: OpenAIBatchLine) -> AcceptedRequest | None:
        """Note the line as in flight (first: a crash from here on is resumed) and read its request the way
        `/v1/chat/completions` reads one; None when there is nothing to make (its job was sent, or it has its
        outcome). A job a feeder made but died before sending (still queued, its line not noted as sent) is
        unmade and made again: otherwise it would wait for a message that never comes."""
        store = self.context.store
        if store.openai_batches.settled(record.id, line.custom_id):
            return None
        earlier = store.openai_batches.pended(record.id, pending.job_id)
        if earlier is not None and earlier.sent:
            return None
        store.openai_batches.pend(record.id, pending)
        made = store.jobs.load_job(pending.job_id)
        if made is not None:
            if made.status != "queued":
                return None  # a worker started it: its message was sent
            log.warning("batch %s: line %d's job was made but not sent; making it again", record.id, line.number)
            unmake(store, pending.job_id)
        _, accepted = accept_chat(line.body, self.context.settings)
        return replace(accepted, deadline_ms=self._deadline_ms(record))

    def _refused(self, record: OpenAIBatch, pending: PendingLine, exc: StokerError) -> str:
        """A line the intake refused: for now ("retry", not in flight), or for good (its error line, "done")."""
        store = self.context.store.openai_batches
        if not exc.permanent:
            store.unpend(record.id, pending.job_id)
            return "retry"
        body = output_line(pending.custom_id, pending.job_id, exc.http_status, exc.envelope())
        store.settle(record.id, pending, body, ok=False)
        return "done"

    def _deadline_ms(self, record: OpenAIBatch) -> int:
        """A line's deadline: the longest a job may have, within what is left of the batch's window."""
        left_ms = max(((record.expires_at or 0) - now_s()) * 1000, 100)
        return int(min(self.context.settings.max_deadline_ms, left_ms))


def _json_values(raw: bytes) -> int:
    """A line's JSON values, counted as a request body's to `/v1/chat/completions` are (`api.limits`: never those
    in strings, so a line with a CSV in its prompt is held to what the same body on the endpoint is)."""
    counter = JsonValueCounter()
    counter.feed(raw)
    return counter.values


def run_openai_batch_feeder(settings: ApiSettings) -> int:
    """`stoker batch-feeder`: the batch feeder as a process of its own, at a lower CPU priority
    (`STOKER_BATCH_FEEDER_NICE`), beside API processes that run with `STOKER_BATCH_FEEDER=false` (as `stoker up`
    runs them). Feeding a batch is CPU work (each line read, checked and taken in as a job); in an API process it
    shares the interpreter with interactive requests, which then wait for the feeder's turn at the GIL. Until
    SIGTERM, SIGINT or SIGHUP; one feeder of a deployment feeds at a time, by lease."""
    if settings.batch_feeder_nice:
        os.nice(settings.batch_feeder_nice)
    asyncio.run(_feed_until_stopped(ApiContext.build(settings)))
    return 0


async def _feed_until_stopped(context: ApiContext) -> None:
    """The queue monitor (the feeder's room comes from its samples), the tokenizer and the feeder, until a signal."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(signum, stopping.set)
    background = [
        asyncio.create_task(context.monitor.run()),
        asyncio.create_task(asyncio.to_thread(context.prompts.load)),
        asyncio.create_task(OpenAIBatchFeeder(context).run()),
    ]
    log.info("batch feeder %s ready", os.getpid())
    await stopping.wait()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)  # the feeder gives its lease up on the way out
    await context.loop.aclose()
    close_clients(context)
    log.info("batch feeder %s stopped", os.getpid())
