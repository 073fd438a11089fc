"""The batch feeder: the loop that moves every batch on, in a process of its own (`stoker batch-feeder`, as
`stoker up`, Compose and Kubernetes run it) or in an API process (`STOKER_BATCH_FEEDER`); one feeder of a
deployment at a time, by lease. It validates a new batch's input file; feeds its lines as stoker jobs of class
`batch` through the same intake as `/v1/chat/completions` (`api.chat_intake.accept_chat`,
`api.submission.submit_line`), only into the room the queues' watermarks leave and never more than
`STOKER_BATCH_MAX_IN_FLIGHT` at once; collects each ended line's outcome; and writes the output and error files
when the batch completes, is cancelled or expires.

Every step's progress is in the store, so a feeder that dies (SIGKILLed) is replaced by the next lease
holder, which resumes where it left off: a line's job id is derived from its batch and line number, so a line
fed again is found to exist and never runs twice, and each `custom_id`'s outcome is written once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import redis
from starlette.concurrency import run_in_threadpool

from api.chat import completion
from api.chat_intake import accept_chat
from api.context import ApiContext, close_clients
from api.files import store_file, sweep_expired_files
from api.intake import AcceptedRequest
from api.submission import cancel, submit_line, unmake
from stoker.adapters.store.batches import PendingLine, Progress
from stoker.adapters.store.coordination import give_up_lease
from stoker.adapters.store.keys import BATCH_FEEDER_LEASE_KEY
from stoker.core.batchfiles import (
    BatchErrors,
    BatchLine,
    BatchRecord,
    BatchStatus,
    LineError,
    RequestCounts,
    Room,
    Validation,
    batch_room,
    line_job_id,
    now_s,
    output_line,
    parse_line,
    split_lines,
    unrun_line,
)
from stoker.core.errors import BatchCancelled, BatchExpired, StokerError, error_class
from stoker.core.jobs import ErrorInfo, Job
from stoker.core.pacing import Pace
from stoker.core.queues import inference_depth
from stoker.settings import ApiSettings

log = logging.getLogger(__name__)
#: The most lines fed in one tick (taken in concurrently).
FEED_AT_ONCE = 32
#: How often expired files are looked for.
SWEEP_EVERY_S = 10.0


class BatchFeeder:
    """Moves every active batch on, a step per tick, while this process holds the feeder's lease."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.holding = False  # the inference queue passed its high watermark: wait for the low one
        self._swept = 0.0

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
        """One round over every active batch: validate, collect, feed into the room there is, end; whether any
        batch was active."""
        store = self.context.store
        if time.time() - self._swept >= SWEEP_EVERY_S:
            self._swept = time.time()
            await run_in_threadpool(sweep_expired_files, self.context)
        ids = await run_in_threadpool(store.batches.active)
        room = await run_in_threadpool(self._room, ids)
        for batch_id in ids:
            record = await run_in_threadpool(store.batches.get, batch_id)
            if record is None or record.ended:
                await run_in_threadpool(store.batches.retire, batch_id)
                continue
            room -= await self.step(record, room)
        return bool(ids)

    def _room(self, ids: list[str]) -> int:
        """How many lines may be fed this tick, over every batch."""
        settings, monitor = self.context.settings, self.context.monitor
        snapshot = monitor.fresh()
        if snapshot is None or monitor.store_full() is not None:
            return 0
        depths = {q.name: q.depth for q in snapshot.queues}
        marks = Room(settings.infer_high_watermark, settings.infer_low_watermark, settings.cpu_queue_limit)
        in_flight = self.context.store.batches.in_flight(ids)
        most = settings.batch_max_in_flight
        if settings.auth and settings.max_jobs_in_flight > 0:  # leave a tenant room for its interactive jobs
            most = min(most, max(settings.max_jobs_in_flight // 2, 1))
        room = batch_room(depths, in_flight, max_in_flight=most, room=marks, holding=self.holding)
        infer = inference_depth(depths)
        self.holding = infer > settings.infer_high_watermark or (self.holding and infer > settings.infer_low_watermark)
        return room

    async def step(self, record: BatchRecord, room: int) -> int:
        """Move one batch on; how many of its lines were fed."""
        if record.status == "validating":
            await run_in_threadpool(self._validate, record)
            return 0
        if record.status == "cancelling":
            await run_in_threadpool(self._stop, record, "cancelled")
            return 0
        if record.status == "finalizing":
            await run_in_threadpool(self._finish, record, "completed")
            return 0
        if record.expires_at is not None and now_s() >= record.expires_at:
            await run_in_threadpool(self._stop, record, "expired")
            return 0
        await run_in_threadpool(self._collect, record)
        fed = await self._feed(record, room) if room > 0 else 0
        if await run_in_threadpool(self._all_done, record):
            await run_in_threadpool(self._finish, record, "completed")
        return fed

    # -- validation -------------------------------------------------------------------------------------------
    def _validate(self, record: BatchRecord) -> None:
        """Read the input file through once: every line a request to the endpoint, each custom_id once, one model."""
        settings, store = self.context.settings, self.context.store
        check = Validation(record.endpoint, settings.batch_max_requests)
        try:
            for raw, _ in split_lines(self.context.files.read(record.input_file_id)):
                check.add(raw)
        except FileNotFoundError:
            check.errors.append(_missing_input(record.input_file_id))
        errors = check.finish()
        now = now_s()
        if errors:
            store.batches.update(record.id, errors=BatchErrors(data=errors).model_dump(mode="json"))
            if store.batches.move(record.id, "failed", now, only_from=("validating",)):
                store.batches.retire(record.id)
            return
        store.batches.update(record.id, request_counts=RequestCounts(total=check.requests).model_dump())
        if not store.batches.move(record.id, "in_progress", now, only_from=("validating",)):
            store.batches.move(record.id, "cancelled", now, only_from=("cancelling",))  # cancelled while validated
            store.batches.retire(record.id)

    # -- feeding ----------------------------------------------------------------------------------------------
    async def _feed(self, record: BatchRecord, room: int) -> int:
        """Feed up to `room` of the batch's next lines (at most `FEED_AT_ONCE` a tick, taken in together, so the
        lines' outcomes are collected between rounds); a refusal that will pass (the tenant's slots, the store,
        the broker) stops the cursor at that line, tried again next tick."""
        store = self.context.store.batches
        progress = await run_in_threadpool(store.progress, record.id)
        lines = await run_in_threadpool(_next_lines, self.context, record, progress, min(room, FEED_AT_ONCE))
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

    async def _feed_line(self, record: BatchRecord, line: BatchLine) -> str:
        """Make one line a job (or write why it cannot run): "fed", "done" (nothing to feed) or "retry"."""
        job_id = line_job_id(record.id, line.number)
        pending = PendingLine(job_id, line.custom_id, line.number)
        try:
            accepted = await run_in_threadpool(self._prepare, record, pending, line)
            if accepted is None:
                return "fed"  # made before a crash, or settled already: collected like any other
            await submit_line(self.context, record.tenant, job_id, accepted, record.id)
            await run_in_threadpool(self.context.store.batches.pend, record.id, replace(pending, sent=True))
        except StokerError as exc:
            return await run_in_threadpool(self._refused, record, pending, exc)
        return "fed"

    def _prepare(self, record: BatchRecord, pending: PendingLine, line: BatchLine) -> AcceptedRequest | None:
        """Note the line as in flight (first: a crash from here on is resumed) and read its request the way
        `/v1/chat/completions` reads one; None when there is nothing to make (its job was sent, or it has its
        outcome). A job a feeder made but died before sending (still queued, its line not noted as sent) is
        unmade and made again: otherwise it would wait for a message that never comes."""
        store = self.context.store
        if store.batches.settled(record.id, line.custom_id):
            return None
        earlier = store.batches.pended(record.id, pending.job_id)
        if earlier is not None and earlier.sent:
            return None
        store.batches.pend(record.id, pending)
        made = store.jobs.load_job(pending.job_id)
        if made is not None:
            if made.status != "queued":
                return None  # a worker started it: its message was sent
            log.warning("batch %s: line %d's job was made but not sent; making it again", record.id, line.number)
            unmake(store, pending.job_id)
        _, accepted = accept_chat(line.body, self.context.settings)
        return replace(accepted, deadline_ms=self._deadline_ms(record))

    def _refused(self, record: BatchRecord, pending: PendingLine, exc: StokerError) -> str:
        """A line the intake refused: for now ("retry", not in flight), or for good (its error line, "done")."""
        store = self.context.store.batches
        if not exc.permanent:
            store.unpend(record.id, pending.job_id)
            return "retry"
        body = output_line(pending.custom_id, pending.job_id, exc.http_status, exc.envelope())
        store.settle(record.id, pending, body, ok=False)
        return "done"

    def _deadline_ms(self, record: BatchRecord) -> int:
        """A line's deadline: the longest a job may have, within what is left of the batch's window."""
        left_ms = max(((record.expires_at or 0) - now_s()) * 1000, 100)
        return int(min(self.context.settings.max_deadline_ms, left_ms))

    # -- collecting -------------------------------------------------------------------------------------------
    def _collect(self, record: BatchRecord) -> int:
        """Write the outcome of every line whose job ended; how many were written."""
        store = self.context.store
        pending = store.batches.pending(record.id)
        if not pending:
            return 0
        progress = store.batches.progress(record.id)
        jobs = store.jobs.load_many([p.job_id for p in pending])
        written = 0
        model = self.context.settings.public_model_name
        for line, job in zip(pending, jobs, strict=True):
            if job is None:
                if line.line <= progress.lines:  # fed and gone (its record outlived): it never answered
                    body = unrun_line(line.custom_id, line.job_id, "job_lost", "the request's job was lost")
                    written += store.batches.settle(record.id, line, body, ok=False)
                continue  # not made yet: fed again from the cursor
            if job.terminal:
                outcome, ok = line_outcome(line, job, model)
                written += store.batches.settle(record.id, line, outcome, ok=ok)
        return written

    def _all_done(self, record: BatchRecord) -> bool:
        store = self.context.store.batches
        fresh = store.get(record.id)
        if fresh is None or fresh.status != "in_progress":
            return False
        counts = fresh.request_counts
        return counts.completed + counts.failed >= counts.total and not store.pending(record.id)

    # -- ending -----------------------------------------------------------------------------------------------
    def _stop(self, record: BatchRecord, ending: BatchStatus) -> None:
        """Cancel or expire a batch: its queued lines cancelled (none reaches the device from now on), what had
        finished kept, every line that never ran written to the error file with why; then its files."""
        store = self.context.store
        reason: StokerError = BatchCancelled() if ending == "cancelled" else BatchExpired()
        for line in store.batches.pending(record.id):
            cancel(store, line.job_id, replace_stage(reason))
        self._collect(record)
        progress = store.batches.progress(record.id)
        for parsed, _ in _next_lines(self.context, record, progress, None):
            if parsed is None or store.batches.settled(record.id, parsed.custom_id):
                continue
            job_id = line_job_id(record.id, parsed.number)
            body = unrun_line(parsed.custom_id, job_id, reason.code, reason.message)
            store.batches.settle(record.id, PendingLine(job_id, parsed.custom_id, parsed.number), body, ok=False)
        self._finish(record, ending)

    def _finish(self, record: BatchRecord, ending: BatchStatus) -> None:
        """Write the output and error files and end the batch (through `finalizing` when it completed)."""
        store = self.context.store.batches
        if ending == "completed" and not store.move(record.id, "finalizing", now_s(), only_from=("in_progress",)):
            fresh = store.get(record.id)
            if fresh is None or fresh.status != "finalizing":
                return  # cancelled or expired meanwhile: that path ends it
        live = store.get(record.id) or record
        files: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for ok, name in ((True, "output_file_id"), (False, "error_file_id")):
            lines = list(store.outcomes(record.id, ok=ok))
            if lines:
                kind = "output" if ok else "error"
                made = store_file(self.context, record.tenant, f"{record.id}_{kind}.jsonl", iter(lines))
                files[name] = made.id
        counts = live.request_counts.model_dump()
        store.update(record.id, request_counts=counts, **files)
        source: tuple[BatchStatus, ...] = ("finalizing",)
        if ending != "completed":
            source = ("in_progress", "cancelling", "finalizing")
        store.move(record.id, ending, now_s(), only_from=source)
        store.retire(record.id)
        log.info("batch %s %s: %s", record.id, ending, counts)


def line_outcome(line: PendingLine, job: Job, model: str) -> tuple[dict[str, object], bool]:
    """An ended line's output line (its answer, as `/v1/chat/completions` gives it) and whether it succeeded."""
    if job.result is not None:
        return output_line(line.custom_id, job.id, 200, completion(job, model).model_dump(mode="json")), True
    info = job.error or ErrorInfo(code="internal_error", message="the job ended without an answer")
    if info.code in (BatchCancelled.code, BatchExpired.code):
        return unrun_line(line.custom_id, job.id, info.code, info.message), False
    error = error_class(info.code)(info.message, stage=info.stage)
    return output_line(line.custom_id, job.id, error.http_status, error.envelope()), False


def replace_stage(reason: StokerError) -> StokerError:
    """The reason a line's job was ended, said by the batch."""
    return type(reason)(reason.message, stage="batch")


def _next_lines(
    context: ApiContext, record: BatchRecord, progress: Progress, count: int | None
) -> list[tuple[BatchLine | None, int]]:
    """The next `count` lines of a batch's input (all that are left: None) from where feeding got to, each with
    the offset after it; a blank line is None."""
    found: list[tuple[BatchLine | None, int]] = []
    number = progress.lines
    for raw, after in _lines_from(context, record.input_file_id, progress.offset):
        number += 1
        parsed = parse_line(raw, number, record.endpoint) if raw.strip() else None
        found.append((parsed if isinstance(parsed, BatchLine) else None, progress.offset + after))
        if count is not None and sum(1 for p, _ in found if p is not None) >= count:
            break
    return found


def _lines_from(context: ApiContext, file_id: str, offset: int) -> Iterator[tuple[bytes, int]]:
    try:
        yield from split_lines(context.files.read(file_id, offset))
    except FileNotFoundError:
        return


def _missing_input(file_id: str) -> LineError:
    return LineError(code="file_not_found", message=f"the input file {file_id} is gone")


def run_feeder_process(settings: ApiSettings) -> int:
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
        asyncio.create_task(BatchFeeder(context).run()),
    ]
    log.info("batch feeder %s ready", os.getpid())
    await stopping.wait()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)  # the feeder gives its lease up on the way out
    await context.loop.aclose()
    close_clients(context)
    log.info("batch feeder %s stopped", os.getpid())
