"""OpenAI's Files and Batch APIs as plain values: a stored file's record, a batch's record and its statuses, an
input file's lines checked one by one, and each line's output or error line.

Pure: the API reads and writes these through the store and the file storage; nothing here does I/O.

Names: in stoker's code a bare *batch* is a device batch (requests run together in one backend call:
`stoker.core.batching`, `stoker.runtime.batches`), as in LitServe's `batch → predict → unbatch`. OpenAI's Batch API
object is an *OpenAI batch* (`OpenAIBatch`, `OpenAIBatchLine`, the `openai_batches` modules). What a client, an
operator or the store sees keeps OpenAI's word: the paths (`/v1/batches`), the ids (`batch_…`, a job's `batch_id`),
the job class `batch`, the error codes (and their classes, named for them), the `STOKER_BATCH_*` settings, the
`stoker batch` command, the metrics and the Redis keys (and the `keys` functions that build them).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from stoker.core.pressure import room_to_enqueue
from stoker.core.queues import INFER_QUEUES, inference_depth

#: OpenAI's batch statuses; the last five end a batch.
OpenAIBatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
ENDED: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
#: The statuses a batch is fed, collected or finished from (the feeder's work list).
ACTIVE: frozenset[str] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
#: The one endpoint a batch line may call here, and the one completion window OpenAI offers.
ENDPOINTS = ("/v1/chat/completions",)
WINDOWS = {"24h": 24 * 3600}
FilePurpose = Literal["batch", "batch_output"]
#: The most line errors a failed validation reports (OpenAI's `errors.data`).
MAX_REPORTED_ERRORS = 100


class FileRecord(BaseModel):
    """A stored file, in OpenAI's `file` shape (its tenant kept out of every answer)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed"] = "processed"
    status_details: str | None = None
    tenant: str = Field("local", exclude=True)
    lines: int = Field(0, exclude=True)


class RequestCounts(BaseModel):
    """How many of a batch's lines there are, and how many ended each way."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class LineError(BaseModel):
    """One reason a batch cannot run (OpenAI's batch error: its line is 1-based)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class OpenAIBatchErrors(BaseModel):
    """OpenAI's `errors` list of a batch."""

    object: Literal["list"] = "list"
    data: list[LineError] = Field(default_factory=list)


class OpenAIBatch(BaseModel):
    """A batch, in OpenAI's `batch` shape (its tenant kept out of every answer)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: OpenAIBatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: OpenAIBatchErrors | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    tenant: str = Field("local", exclude=True)

    @property
    def ended(self) -> bool:
        """True once the batch will not change any more."""
        return self.status in ENDED


def new_file_id() -> str:
    """A file id in OpenAI's form."""
    return f"file-{uuid.uuid4().hex}"


def new_openai_batch_id() -> str:
    """A batch id in OpenAI's form."""
    return f"batch_{uuid.uuid4().hex}"


def line_job_id(batch_id: str, line: int) -> str:
    """The job id of a batch's line: the same every time it is fed, so a line fed again after a crash is seen to
    exist already and is never run twice."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"stoker:{batch_id}:{line}").hex


@dataclass(frozen=True)
class OpenAIBatchLine:
    """One valid line of an input file: its request body, as `/v1/chat/completions` would receive it."""

    number: int
    custom_id: str
    body: bytes
    #: The body's `model`, as sent.
    model: object = None


def parse_line(raw: bytes, number: int, endpoint: str) -> OpenAIBatchLine | LineError:
    """A line of an input file, or why it is not a request to `endpoint` (1-based line numbers). Never raises:
    whatever reading a line fails with is that line's error."""
    try:
        return _parsed_line(raw, number, endpoint)
    except RecursionError:
        return LineError(code="invalid_json_line", message=f"line {number} nests too deeply to read", line=number)
    except Exception:  # any failure to read a line (bad UTF-8, bad JSON, ...) is that line's, never the reader's
        return LineError(code="invalid_json_line", message=f"line {number} is not valid JSON", line=number)


def _parsed_line(raw: bytes, number: int, endpoint: str) -> OpenAIBatchLine | LineError:
    item = json.loads(raw)
    if not isinstance(item, dict):
        return LineError(code="invalid_json_line", message=f"line {number} is not a JSON object", line=number)
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(code="missing_custom_id", message="a line needs a custom_id", param="custom_id", line=number)
    if method != "POST":
        return LineError(code="invalid_method", message="only POST is supported", param="method", line=number)
    if url != endpoint:
        message = f"the url must be the batch's endpoint, {endpoint}"
        return LineError(code="mismatched_endpoint", message=message, param="url", line=number)
    if not isinstance(body, dict):
        return LineError(code="invalid_body", message="body must be a JSON object", param="body", line=number)
    return OpenAIBatchLine(number, custom_id, json.dumps(body, separators=(",", ":")).encode(), body.get("model"))


#: The bytes that open a JSON value after the first (counted as `/v1/chat/completions` counts a body's values).
_VALUE_OPENERS = b",[{"


def json_values(raw: bytes) -> int:
    """How many values a JSON text holds, at most: one, and one more for each `,` `[` `{` (inside strings too: an
    upper bound, where no exact count is given, e.g. `api.limits.JsonValueCounter`'s)."""
    return 1 + len(raw) - len(raw.translate(None, _VALUE_OPENERS))


@dataclass
class Validation:
    """An input file checked line by line as it streams past: every line a request to the endpoint, within the
    limits of the request it stands for (`max_line_bytes`, `max_line_values`; 0: none), every `custom_id` once,
    one model for all."""

    endpoint: str
    max_lines: int
    max_line_bytes: int = 0
    max_line_values: int = 0
    #: How a line's JSON values are counted (as the API counts a request body's).
    values_of: Callable[[bytes], int] = json_values
    errors: list[LineError] = field(default_factory=list)
    lines: int = 0
    _seen: set[str] = field(default_factory=set)
    _model: object = None

    def add(self, raw: bytes) -> str | None:
        """Check the next line (blank lines are skipped but counted, as line numbers are); its custom_id if it is
        a request."""
        self.lines += 1
        if not raw.strip():
            return None
        parsed = self._oversized(raw) or parse_line(raw, self.lines, self.endpoint)
        if isinstance(parsed, LineError):
            self._error(parsed)
            return None
        if parsed.custom_id in self._seen:
            message = f"custom_id {parsed.custom_id!r} appears more than once"
            self._error(LineError(code="duplicate_custom_id", message=message, param="custom_id", line=parsed.number))
        self._seen.add(parsed.custom_id)
        if self._model is None:
            self._model = parsed.model
        elif parsed.model != self._model:
            message = f"every line must use the same model ({self._model!r}); this one uses {parsed.model!r}"
            self._error(LineError(code="mismatched_model", message=message, param="body.model", line=parsed.number))
        return parsed.custom_id

    def _oversized(self, raw: bytes) -> LineError | None:
        """Why the line is larger than the request it stands for may be, before it is parsed; None if it is not."""
        number, most = self.lines, self.max_line_values
        if self.max_line_bytes and len(raw) > self.max_line_bytes:
            message = f"line {number} is over {self.max_line_bytes} bytes, the most a request may be"
            return LineError(code="line_too_large", message=message, line=number)
        if most and self.values_of(raw) > most:
            message = f"line {number} holds more than {most} JSON values, the most a request may hold"
            return LineError(code="line_too_large", message=message, line=number)
        return None

    def _error(self, error: LineError) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(error)

    def finish(self) -> list[LineError]:
        """Every error found (a file of no request, or of too many lines, is one too)."""
        if not self._seen and not self.errors:
            self.errors.append(LineError(code="empty_file", message="the input file holds no request"))
        if len(self._seen) > self.max_lines:
            message = f"a batch may hold at most {self.max_lines} requests"
            self.errors.insert(0, LineError(code="too_many_requests", message=message))
        return self.errors

    @property
    def requests(self) -> int:
        """Requests seen so far."""
        return len(self._seen)


def output_line(custom_id: str, job_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """The line of the output (2xx) or error file for a request that ran: OpenAI's `response` shape."""
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": job_id, "body": body},
        "error": None,
    }


def unrun_line(custom_id: str, job_id: str, code: str, message: str) -> dict[str, Any]:
    """The error file's line for a request that never ran (cancelled, expired, refused at intake)."""
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def split_lines(chunks: Iterable[bytes], max_line_bytes: int = 0) -> Iterator[tuple[bytes, int]]:
    """Each line of a byte stream (without its newline) and the offset just past it. A line longer than
    `max_line_bytes` (0: no limit) comes cut to `max_line_bytes + 1` bytes, its length saying it is too long: the
    rest of it is never held."""
    keep = max_line_bytes + 1 if max_line_bytes > 0 else None
    head, size, offset = bytearray(), 0, 0  # the line's bytes kept so far, and its whole length so far
    for chunk in chunks:
        *done, rest = chunk.split(b"\n")
        for part in done:
            head += part if keep is None else part[: max(keep - len(head), 0)]
            offset += size + len(part) + 1
            yield bytes(head), offset
            head.clear()
            size = 0
        head += rest if keep is None else rest[: max(keep - len(head), 0)]
        size += len(rest)
    if size:
        yield bytes(head), offset + size


def line_index_id(batch_id: str) -> str:
    """The file id of a batch's line index: each input line's custom_id, one a line (an empty line where the input
    has no request), written as the batch is validated, so its lines can be named without reading its input
    again (a cancel, an expiry), or after its input file was deleted."""
    return f"{batch_id}.lines"


def index_entry(custom_id: str | None) -> bytes:
    """A line index's line for an input line: its custom_id, as JSON, or nothing."""
    return (json.dumps(custom_id) if custom_id else "").encode() + b"\n"


def indexed_names(index: Iterable[tuple[bytes, int]], after: int) -> Iterator[tuple[int, str]]:
    """The line number and custom_id of each request a line index names past line `after`."""
    for number, (raw, _) in enumerate(index, 1):
        if number > after and raw:
            yield number, str(json.loads(raw))


def tenant_turns(batches: Iterable[OpenAIBatch], turn: int) -> deque[deque[OpenAIBatch]]:
    """Running batches in the order they are fed: grouped by tenant, each tenant's oldest first, the tenants in
    turn (by name, rotated by `turn`, a count of rounds, so each goes first in its round)."""
    by_tenant: dict[str, deque[OpenAIBatch]] = {}
    for record in sorted(batches, key=lambda r: (r.created_at, r.id)):
        by_tenant.setdefault(record.tenant, deque()).append(record)
    names = sorted(by_tenant)
    first = turn % len(names) if names else 0
    return deque(by_tenant[name] for name in names[first:] + names[:first])


def line_room(depths: dict[str, int], in_flight: int, *, max_in_flight: int, room: Room, holding: bool) -> int:
    """How many more batch lines may be fed now: none while the inference queue is over its watermarks (the same
    as tokenize's hand-off: above the high one, and after a pause until it is back at the low one; `holding`) or a
    CPU queue is past half its admission limit; else what keeps the lines in the pipeline under `max_in_flight` and
    the inference queue at its low watermark.
    Batch lines are fed into the room interactive traffic leaves, never dumped whole."""
    infer = inference_depth(depths)
    if not room_to_enqueue(infer, room.infer_high, room.infer_low, holding):
        return 0
    if any(depth * 2 >= room.cpu_limit for name, depth in depths.items() if name not in INFER_QUEUES):
        return 0
    # Never more than up to the low watermark: the room above it stays the interactive jobs', so tokenize never
    # holds one of them back because batch lines filled the inference queue.
    return max(min(max_in_flight - in_flight, room.infer_low - infer), 0)


@dataclass(frozen=True)
class Room:
    """The queue marks batch feeding keeps under: the inference queue's watermarks, the CPU queues' limit."""

    infer_high: int
    infer_low: int
    cpu_limit: int


def now_s() -> int:
    """Seconds since the epoch, as OpenAI's `*_at` fields count them."""
    return int(time.time())
