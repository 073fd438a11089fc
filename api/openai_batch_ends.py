"""How an OpenAI batch's lines are collected and how a batch ends (completed, cancelled, expired, its input file
deleted, or failed because the feeder cannot move it on): the output and error files written, every line in exactly
one of them, the line index dropped. The batch feeder (`api.openai_batch_feeder`) decides when; this says how."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from itertools import islice

from api.chat import completion
from api.context import ApiContext
from api.files import store_file
from api.submission import cancel
from stoker.adapters.store.openai_batches import PendingLine, Progress
from stoker.core.errors import BatchCancelled, BatchExpired, StokerError, error_class
from stoker.core.jobs import ErrorInfo, Job
from stoker.core.openai_batches import (
    LineError,
    OpenAIBatch,
    OpenAIBatchErrors,
    OpenAIBatchLine,
    OpenAIBatchStatus,
    RequestCounts,
    indexed_names,
    line_index_id,
    line_job_id,
    now_s,
    output_line,
    parse_line,
    split_lines,
    unrun_line,
)

log = logging.getLogger(__name__)
#: Lines that never ran written to the store at a time (when a batch is cancelled, expires or loses its input).
UNRUN_AT_ONCE = 1000
#: The statuses a batch the feeder cannot move on fails from.
_UNENDED: tuple[OpenAIBatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")


class OpenAIBatchEnds:
    """Collects a batch's ended lines and ends the batch, in the store and its files."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context

    # -- collecting -------------------------------------------------------------------------------------------
    def collect(self, record: OpenAIBatch) -> int:
        """Write the outcome of every line whose job ended; how many were written."""
        store = self.context.store
        pending = store.openai_batches.pending(record.id)
        if not pending:
            return 0
        progress = store.openai_batches.progress(record.id)
        jobs = store.jobs.load_many([p.job_id for p in pending])
        written = 0
        model = self.context.settings.public_model_name
        for line, job in zip(pending, jobs, strict=True):
            if job is None:
                if line.line <= progress.lines:  # fed and gone (its record outlived): it never answered
                    body = unrun_line(line.custom_id, line.job_id, "job_lost", "the request's job was lost")
                    written += store.openai_batches.settle(record.id, line, body, ok=False)
                continue  # not made yet: fed again from the cursor
            if job.terminal:
                outcome, ok = line_outcome(line, job, model)
                written += store.openai_batches.settle(record.id, line, outcome, ok=ok)
        return written

    def all_done(self, record: OpenAIBatch) -> bool:
        store = self.context.store.openai_batches
        fresh = store.get(record.id)
        if fresh is None or fresh.status != "in_progress":
            return False
        counts = fresh.request_counts
        return counts.completed + counts.failed >= counts.total and not store.pending(record.id)

    # -- ending -----------------------------------------------------------------------------------------------
    def stop(self, record: OpenAIBatch, ending: OpenAIBatchStatus) -> None:
        """Cancel or expire a batch: its queued lines cancelled (none reaches the device from now on), what had
        finished kept, every line that never ran written to the error file with why; then its files."""
        store = self.context.store
        reason: StokerError = BatchCancelled() if ending == "cancelled" else BatchExpired()
        for line in store.openai_batches.pending(record.id):
            cancel(store, line.job_id, replace_stage(reason))
        self.collect(record)
        progress = store.openai_batches.progress(record.id)
        if self._write_unrun(record, progress, reason.code, reason.message) is None:
            log.warning("batch %s: the lines it never fed cannot be named (its input file is gone)", record.id)
        self.finish(record, ending)

    def input_gone(self, record: OpenAIBatch, progress: Progress) -> None:
        """The input file of a running batch was deleted: every line not fed yet goes to the error file
        (`file_not_found`), and the batch completes once the lines in flight end. Without a line index to name its
        lines by (a batch validated before indexes were kept), the batch fails."""
        message = f"the input file {record.input_file_id} was deleted before this line ran"
        last = self._write_unrun(record, progress, missing_input(record.input_file_id).code, message)
        if last is None:
            self.give_up(record.id, message.replace("this line ran", "every line ran"))
            return
        self.context.store.openai_batches.advance(record.id, Progress(max(last, progress.lines), progress.offset))

    def _write_unrun(self, record: OpenAIBatch, progress: Progress, code: str, message: str) -> int | None:
        """Write every line past the feeding cursor that has no outcome yet to the error file, as one that never
        ran (`code`), a thousand at a time: named by the line index, read once without parsing the input again.
        The last line number seen; None if the lines cannot be named."""
        try:
            names = self._names_after(record, progress)
        except FileNotFoundError:
            return None
        store, last = self.context.store.openai_batches, progress.lines
        while chunk := list(islice(names, UNRUN_AT_ONCE)):
            rows = []
            for number, custom_id in chunk:
                job_id = line_job_id(record.id, number)
                rows.append((job_id, custom_id, unrun_line(custom_id, job_id, code, message)))
            store.settle_unrun(record.id, rows)
            last = chunk[-1][0]
        return last

    def _names_after(self, record: OpenAIBatch, progress: Progress) -> Iterator[tuple[int, str]]:
        """The line number and custom_id of each request past the feeding cursor: from the line index, or (a batch
        validated before indexes were kept) from its input file; FileNotFoundError when neither is there."""
        files = self.context.files
        try:
            return indexed_names(split_lines(files.read(line_index_id(record.id))), progress.lines)
        except FileNotFoundError:
            lines = next_lines(self.context, record, progress, None)
            return ((parsed.number, parsed.custom_id) for parsed, _ in lines if parsed is not None)

    def end_unstarted(self, record: OpenAIBatch, ending: OpenAIBatchStatus) -> None:
        """End a batch cancelled or expired before it started: no line of it ran, none is in a file (its counts
        all 0)."""
        store = self.context.store.openai_batches
        store.update(record.id, request_counts=RequestCounts().model_dump())
        if store.move(record.id, ending, now_s(), only_from=("validating", "cancelling")):
            store.retire(record.id)
        self.drop_index(record.id)

    def drop_index(self, batch_id: str) -> None:
        """Delete a batch's line index (it ended, or never started)."""
        try:
            self.context.files.delete(line_index_id(batch_id))
        except OSError as exc:  # the batch's end stands: a file left behind is only disk
            log.warning("batch %s: its line index was not deleted (%s)", batch_id, exc)

    def give_up(self, batch_id: str, problem: str) -> None:
        """Fail a batch the feeder cannot move on, saying why; its lines in flight are cancelled."""
        store = self.context.store
        error = LineError(code="internal_error", message=f"the batch could not go on: {problem}"[:500])
        store.openai_batches.update(batch_id, errors=OpenAIBatchErrors(data=[error]).model_dump(mode="json"))
        if store.openai_batches.move(batch_id, "failed", now_s(), only_from=_UNENDED):
            for line in store.openai_batches.pending(batch_id):
                cancel(store, line.job_id, replace_stage(BatchCancelled()))
            store.openai_batches.retire(batch_id)
        self.drop_index(batch_id)

    def finish(self, record: OpenAIBatch, ending: OpenAIBatchStatus) -> None:
        """Write the output and error files and end the batch (through `finalizing` when it completed)."""
        store = self.context.store.openai_batches
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
        source: tuple[OpenAIBatchStatus, ...] = ("finalizing",)
        if ending != "completed":
            source = ("in_progress", "cancelling", "finalizing")
        store.move(record.id, ending, now_s(), only_from=source)
        store.retire(record.id)
        self.drop_index(record.id)
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


def next_lines(
    context: ApiContext, record: OpenAIBatch, progress: Progress, count: int | None
) -> list[tuple[OpenAIBatchLine | None, int]]:
    """The next `count` lines of a batch's input (all that are left: None) from where feeding got to, each with
    the offset after it; a blank line is None. FileNotFoundError when the input file is gone."""
    found: list[tuple[OpenAIBatchLine | None, int]] = []
    number = progress.lines
    chunks = context.files.read(record.input_file_id, progress.offset)
    for raw, after in split_lines(chunks, context.settings.max_body_bytes):
        number += 1
        parsed = parse_line(raw, number, record.endpoint) if raw.strip() else None
        found.append((parsed if isinstance(parsed, OpenAIBatchLine) else None, progress.offset + after))
        if count is not None and sum(1 for p, _ in found if p is not None) >= count:
            break
    return found


def missing_input(file_id: str) -> LineError:
    return LineError(code="file_not_found", message=f"the input file {file_id} is gone")
