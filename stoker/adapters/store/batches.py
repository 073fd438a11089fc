"""Files' records and batches' progress in the job store: who owns a file and when it expires, the bytes a tenant's
files hold, each batch's record, where its feeding got to, the lines in flight and each line's output, written once
per `custom_id`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from stoker.adapters.store.keys import (
    ACTIVE_BATCHES_KEY,
    BATCH_COUNTS_KEY,
    FILES_EXPIRY_KEY,
    batch_errors_key,
    batch_key,
    batch_output_key,
    batch_pending_key,
    file_key,
    tenant_batches_key,
    tenant_file_bytes_key,
    tenant_files_key,
)
from stoker.core.batchfiles import BatchRecord, BatchStatus, FileRecord

# A file's record, written only while its tenant's files stay within their byte quota (0: none).
_PUT_FILE = """
local size, quota = tonumber(ARGV[2]), tonumber(ARGV[3])
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
if quota > 0 and used + size > quota then return 0 end
redis.call('INCRBY', KEYS[2], size)
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'tenant', ARGV[5], 'lines', ARGV[6])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[7])
if ARGV[8] ~= '' then redis.call('ZADD', KEYS[4], ARGV[8], ARGV[7]) end
return 1
"""

# A file's record gone, and its bytes no longer counted; 0 if it was gone already.
_DELETE_FILE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
if tonumber(redis.call('DECRBY', KEYS[2], ARGV[2])) <= 0 then redis.call('DEL', KEYS[2]) end
return 1
"""

# A batch's status moved on only from one of the statuses given, with its timestamp: 1 if it moved.
_TRANSITION = """
local status = cjson.decode(redis.call('HGET', KEYS[1], 'status') or 'null')
for i = 4, #ARGV do
  if ARGV[i] == status then
    redis.call('HSET', KEYS[1], 'status', cjson.encode(ARGV[1]), ARGV[2], ARGV[3])
    return 1
  end
end
return 0
"""


@dataclass(frozen=True)
class Progress:
    """How far a batch's feeding got: lines read off its input file, and the byte offset after them."""

    lines: int
    offset: int


@dataclass(frozen=True)
class PendingLine:
    """A batch line fed as a job and not yet collected."""

    job_id: str
    custom_id: str
    line: int
    #: Its job's first message was published (until then a feeder that died may have made the record alone).
    sent: bool = False


class FileRepository:
    """Stored files' records, by id and by tenant, and the bytes each tenant's files hold."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._put = client.register_script(_PUT_FILE)
        self._delete = client.register_script(_DELETE_FILE)

    def put(self, record: FileRecord, quota: int) -> bool:
        """Record a file whose bytes are stored; False (nothing written) if that takes its tenant's files past
        `quota` bytes."""
        keys = [file_key(record.id), tenant_file_bytes_key(record.tenant), tenant_files_key(record.tenant)]
        expiry = "" if record.expires_at is None else str(record.expires_at)
        args = [record.model_dump_json(), record.bytes, quota, record.created_at, record.tenant, record.lines]
        return bool(self._put(keys=[*keys, FILES_EXPIRY_KEY], args=[*args, record.id, expiry]))

    def get(self, file_id: str) -> FileRecord | None:
        """A file's record; None if there is none."""
        raw = self.redis.hmget(file_key(file_id), ["record", "tenant", "lines"])
        if raw[0] is None:
            return None
        record = FileRecord.model_validate_json(raw[0])
        return record.model_copy(update={"tenant": (raw[1] or b"local").decode(), "lines": int(raw[2] or 0)})

    def page(self, tenant: str, after: str | None, limit: int, purpose: str | None = None) -> list[FileRecord]:
        """Up to `limit` of a tenant's files, newest first, after the file `after` (of `purpose`, if given)."""
        ids = [raw.decode() for raw in self.redis.zrevrange(tenant_files_key(tenant), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        found = [r for r in (self.get(i) for i in ids) if r is not None and (purpose is None or r.purpose == purpose)]
        return found[:limit]

    def delete(self, record: FileRecord) -> bool:
        """Forget a file's record and stop counting its bytes; False if it was gone already."""
        keys = [file_key(record.id), tenant_file_bytes_key(record.tenant), tenant_files_key(record.tenant)]
        return bool(self._delete(keys=[*keys, FILES_EXPIRY_KEY], args=[record.id, record.bytes]))

    def due(self, now: float, count: int = 100) -> list[str]:
        """Ids of files whose expiry has come."""
        return [raw.decode() for raw in self.redis.zrangebyscore(FILES_EXPIRY_KEY, "-inf", now, start=0, num=count)]

    def forget_due(self, file_id: str) -> None:
        """Take a file off the expiry list (its record is gone already)."""
        self.redis.zrem(FILES_EXPIRY_KEY, file_id)

    def used(self, tenant: str) -> int:
        """Bytes the tenant's files hold now."""
        return int(self.redis.get(tenant_file_bytes_key(tenant)) or 0)


class BatchRepository:
    """Batches: their records (one hash field per OpenAI field, so status and counts move independently), feeding
    progress, lines in flight, and each line's outcome, written once per `custom_id`."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._transition = client.register_script(_TRANSITION)

    def create(self, record: BatchRecord) -> None:
        """Store a new batch and put it on the feeder's work list."""
        fields: dict[str | bytes, str | int] = {k: json.dumps(v) for k, v in record.model_dump(mode="json").items()}
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(batch_key(record.id), mapping={**fields, "tenant": record.tenant, "fed": 0, "offset": 0})
            pipe.zadd(tenant_batches_key(record.tenant), {record.id: record.created_at})
            pipe.sadd(ACTIVE_BATCHES_KEY, record.id)
            pipe.execute()

    def get(self, batch_id: str) -> BatchRecord | None:
        """A batch's record with its counts (live while it runs); None if there is none."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(batch_key(batch_id))
            pipe.hlen(batch_output_key(batch_id))
            pipe.hlen(batch_errors_key(batch_id))
            raw, completed, failed = pipe.execute()
        if not raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        values: dict[str, Any] = {
            k: json.loads(fields[k]) for k in BatchRecord.model_fields if k in fields and k != "tenant"
        }
        record = BatchRecord.model_validate({**values, "tenant": fields.get("tenant", "local")})
        if record.ended:  # its final counts were written when it ended, and its working sets are gone
            return record
        counts = record.request_counts.model_copy(update={"completed": completed, "failed": failed})
        return record.model_copy(update={"request_counts": counts})

    def page(self, tenant: str, after: str | None, limit: int) -> list[BatchRecord]:
        """Up to `limit` of a tenant's batches, newest first, after the batch `after`."""
        ids = [raw.decode() for raw in self.redis.zrevrange(tenant_batches_key(tenant), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        found = (self.get(i) for i in ids[: limit + 1])
        return [r for r in found if r is not None][:limit]

    def update(self, batch_id: str, **fields: Any) -> None:
        """Set some of a batch's OpenAI fields."""
        self.redis.hset(batch_key(batch_id), mapping={k: json.dumps(v) for k, v in fields.items()})

    def move(self, batch_id: str, to: BatchStatus, at: int, *, only_from: Iterable[BatchStatus]) -> bool:
        """Move a batch to status `to` (stamping `<to>_at`), only if it is in one of `only_from` now."""
        keys = [batch_key(batch_id)]
        return bool(self._transition(keys=keys, args=[to, f"{to}_at", json.dumps(at), *only_from]))

    def active(self) -> list[str]:
        """Batches not over yet."""
        return sorted(raw.decode() for raw in self.redis.smembers(ACTIVE_BATCHES_KEY))

    def retire(self, batch_id: str) -> None:
        """A batch is over: off the feeder's work list, its working sets gone (its record stays)."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(ACTIVE_BATCHES_KEY, batch_id)
            pipe.delete(batch_pending_key(batch_id), batch_output_key(batch_id), batch_errors_key(batch_id))
            pipe.execute()

    # -- feeding ----------------------------------------------------------------------------------------------
    def progress(self, batch_id: str) -> Progress:
        """How far the batch's feeding got."""
        fed, offset = self.redis.hmget(batch_key(batch_id), ["fed", "offset"])
        return Progress(int(fed or 0), int(offset or 0))

    def pend(self, batch_id: str, line: PendingLine) -> None:
        """Note a line as fed before its job is made (and again once its job's message is sent, `line.sent`): a
        crash between the steps leaves it known, never lost."""
        value = json.dumps({"custom_id": line.custom_id, "line": line.line, "sent": line.sent})
        self.redis.hset(batch_pending_key(batch_id), line.job_id, value)

    def pended(self, batch_id: str, job_id: str) -> PendingLine | None:
        """The line in flight with this job id, if it is."""
        raw = self.redis.hget(batch_pending_key(batch_id), job_id)
        return None if raw is None else PendingLine(job_id, *_pending_fields(raw))

    def unpend(self, batch_id: str, job_id: str) -> None:
        """A line noted as fed was not made a job after all (refused for now): it is fed again later."""
        self.redis.hdel(batch_pending_key(batch_id), job_id)

    def advance(self, batch_id: str, progress: Progress) -> None:
        """Record that feeding got past `progress.lines` lines."""
        self.redis.hset(batch_key(batch_id), mapping={"fed": progress.lines, "offset": progress.offset})

    def pending(self, batch_id: str) -> list[PendingLine]:
        """The batch's lines in flight."""
        raw = self.redis.hgetall(batch_pending_key(batch_id))
        return [PendingLine(k.decode(), *_pending_fields(v)) for k, v in raw.items()]

    def in_flight(self, batch_ids: Iterable[str]) -> int:
        """Lines in flight across these batches."""
        with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hlen(batch_pending_key(batch_id))
            return sum(int(n) for n in pipe.execute())

    def settle(self, batch_id: str, line: PendingLine, outcome: dict[str, Any], *, ok: bool) -> bool:
        """Write a line's outcome to the output (`ok`) or the error side, once per custom_id, and take it off the
        lines in flight; False if that custom_id had an outcome already (then nothing changes but that)."""
        where = batch_output_key(batch_id) if ok else batch_errors_key(batch_id)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hexists(batch_output_key(batch_id), line.custom_id)
            pipe.hexists(batch_errors_key(batch_id), line.custom_id)
            seen_ok, seen_error = pipe.execute()
        written = False
        if not (seen_ok or seen_error):
            written = bool(self.redis.hsetnx(where, line.custom_id, json.dumps(outcome, separators=(",", ":"))))
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(batch_pending_key(batch_id), line.job_id)
            if written:
                pipe.hincrby(BATCH_COUNTS_KEY, "completed" if ok else "failed", 1)
            pipe.execute()
        return written

    def settled(self, batch_id: str, custom_id: str) -> bool:
        """Whether a custom_id has its outcome already."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hexists(batch_output_key(batch_id), custom_id)
            pipe.hexists(batch_errors_key(batch_id), custom_id)
            return any(pipe.execute())

    def outcomes(self, batch_id: str, *, ok: bool) -> Iterable[bytes]:
        """Every output (`ok`) or error line written so far, a batch at a time."""
        key = batch_output_key(batch_id) if ok else batch_errors_key(batch_id)
        for _, value in self.redis.hscan_iter(key, count=500):
            yield value

    def count_fed(self, n: int = 1) -> None:
        """Count lines fed into the pipeline (for /v1/stats and the metrics)."""
        self.redis.hincrby(BATCH_COUNTS_KEY, "fed", n)

    def line_stats(self) -> dict[str, int]:
        """Batch lines (jobs of class `batch`): fed, completed and failed since the store began; in the pipeline
        now; and waiting to be fed, over every running batch."""
        raw = {k.decode(): int(v) for k, v in self.redis.hgetall(BATCH_COUNTS_KEY).items()}
        ids = self.active()
        in_flight = self.in_flight(ids)
        left = 0
        for record in (self.get(i) for i in ids):
            if record is not None and record.status == "in_progress":
                done = record.request_counts
                left += max(done.total - done.completed - done.failed, 0)
        totals = {name: raw.get(name, 0) for name in ("fed", "completed", "failed")}
        return {**totals, "in_flight": in_flight, "waiting": max(left - in_flight, 0)}


def _pending_fields(raw: bytes) -> tuple[str, int, bool]:
    value = json.loads(raw)
    return str(value["custom_id"]), int(value["line"]), bool(value.get("sent", False))
