"""Files' records and batches' progress in the job store: who owns a file and when it expires, the bytes a tenant's
files hold, each OpenAI batch's record, where its feeding got to, the lines in flight and each line's output, written
once per `custom_id`. (An OpenAI batch, not a device batch: see `stoker.core.openai_batches` for the names.)"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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
    tenant_file_holds_key,
    tenant_files_key,
    tenant_live_batches_key,
)
from stoker.core.openai_batches import FileRecord, OpenAIBatch, OpenAIBatchStatus

T = TypeVar("T")

#: The least a file counts against its tenant's stored-files quota, however small (an empty file's record costs the
#: store as much as any other's).
FILE_MIN_BYTES = 1024
#: How long an upload's hold on quota lasts unless renewed (each step of its bytes renews it): a hold of a process
#: that died mid-upload lapses after this.
HOLD_LEASE_S = 600

# The bytes held by a tenant's uploads in flight (a hash: file id → "<bytes>:<until>") but `file_id`'s, lapsed holds
# dropped on the way.
_OTHER_HOLDS = """
local function other_holds(holds_key, file_id, now)
  local held, entries = 0, redis.call('HGETALL', holds_key)
  for i = 1, #entries, 2 do
    local bytes, till = string.match(entries[i + 1], '^(%d+):(%d+)$')
    if till == nil or tonumber(till) < now then
      redis.call('HDEL', holds_key, entries[i])
    elseif entries[i] ~= file_id then
      held = held + tonumber(bytes)
    end
  end
  return held
end
"""

# Hold room for an upload in its tenant's quota: as much as asked (ARGV[3]) of what the files' bytes and the other
# uploads' holds leave, if that is at least what it needs now (ARGV[4]); what it holds then, or -1 (nothing changed).
_HOLD = (
    _OTHER_HOLDS
    + """
local now, asked, needed, quota, lease = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6])
local room = quota - tonumber(redis.call('GET', KEYS[2]) or '0') - other_holds(KEYS[1], ARGV[1], now)
local held = math.min(asked, room)
if held < needed then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d:%d', held, now + lease))
redis.call('EXPIRE', KEYS[1], lease)
return held
"""
)

# A file's record, written only while its tenant's files (with the other uploads' holds) stay within their byte
# quota (ARGV[3], 0: none) and their count within its cap (ARGV[9], 0: none); the upload's own hold becomes its
# bytes.
_PUT_FILE = (
    _OTHER_HOLDS
    + """
local size, quota, most = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[9])
if most > 0 and redis.call('ZCARD', KEYS[3]) >= most then return 0 end
if quota > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used + size + other_holds(KEYS[5], ARGV[7], tonumber(ARGV[10])) > quota then return 0 end
end
redis.call('HDEL', KEYS[5], ARGV[7])
redis.call('INCRBY', KEYS[2], size)
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'tenant', ARGV[5], 'lines', ARGV[6])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[7])
if ARGV[8] ~= '' then redis.call('ZADD', KEYS[4], ARGV[8], ARGV[7]) end
return 1
"""
)

# A file's record gone, and its bytes no longer counted; 0 if it was gone already.
_DELETE_FILE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
if tonumber(redis.call('DECRBY', KEYS[2], ARGV[2])) <= 0 then redis.call('DEL', KEYS[2]) end
return 1
"""

# A new batch, unless its tenant has ARGV[3] (0: no cap) not yet ended: its record (fields from ARGV[6] on), its
# place in the tenant's listing (which keeps ARGV[4] seconds of batches: older ones expired, ARGV[5] is that horizon),
# the feeder's work list, the tenant's live batches. 1 if made.
_CREATE_BATCH = """
local most = tonumber(ARGV[3])
if most > 0 and redis.call('SCARD', KEYS[4]) >= most then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('EXPIRE', KEYS[4], ARGV[4])
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
    """Stored files' records, by id and by tenant, the bytes each tenant's files hold (each counted as
    `FILE_MIN_BYTES` at least), and the room its uploads in flight hold in its quota."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._put = client.register_script(_PUT_FILE)
        self._delete = client.register_script(_DELETE_FILE)
        self._hold = client.register_script(_HOLD)

    def put(self, record: FileRecord, quota: int, max_count: int = 0) -> bool:
        """Record a file whose bytes are stored (its upload's hold, if any, becoming its bytes); False (nothing
        written) if that takes its tenant's files past `quota` bytes with what other uploads hold, or past
        `max_count` files (0: no cap)."""
        keys = [file_key(record.id), tenant_file_bytes_key(record.tenant), tenant_files_key(record.tenant)]
        keys += [FILES_EXPIRY_KEY, tenant_file_holds_key(record.tenant)]
        expiry = "" if record.expires_at is None else str(record.expires_at)
        args = [record.model_dump_json(), counted_bytes(record.bytes), quota, record.created_at, record.tenant]
        args += [record.lines, record.id, expiry, max_count, int(time.time())]
        return bool(self._put(keys=keys, args=args))

    def hold(self, tenant: str, file_id: str, needed: int, asked: int, quota: int) -> int:
        """Hold room in the tenant's quota for an upload in flight, renewing its hold: up to `asked` bytes of what
        the files and the other uploads leave, if that is at least `needed` (each counted as `FILE_MIN_BYTES` at
        least); the bytes it holds now, or -1 when `needed` does not fit (its hold left as it was)."""
        keys = [tenant_file_holds_key(tenant), tenant_file_bytes_key(tenant)]
        needed = counted_bytes(needed)
        args = [file_id, int(time.time()), max(asked, needed), needed, quota, HOLD_LEASE_S]
        return int(self._hold(keys=keys, args=args))

    def release(self, tenant: str, file_id: str) -> None:
        """An upload in flight gave up: the room it held is free again."""
        self.redis.hdel(tenant_file_holds_key(tenant), file_id)

    def count(self, tenant: str) -> int:
        """How many files the tenant stores now (its batches' output and error files included)."""
        return int(self.redis.zcard(tenant_files_key(tenant)))

    def get(self, file_id: str) -> FileRecord | None:
        """A file's record; None if there is none."""
        return _file_record(self.redis.hmget(file_key(file_id), ["record", "tenant", "lines"]))

    def page(self, tenant: str, after: str | None, limit: int, purpose: str | None = None) -> list[FileRecord]:
        """Up to `limit` of a tenant's files, newest first, after the file `after` (of `purpose`, if given): read
        a range of the listing at a time, and ids whose record is gone taken off it."""
        found: list[FileRecord] = []
        for record in _listed(self.redis, tenant_files_key(tenant), after, limit, self._records):
            if purpose is None or record.purpose == purpose:
                found.append(record)
            if len(found) == limit:
                break
        return found

    def _records(self, file_ids: list[str]) -> list[FileRecord | None]:
        with self.redis.pipeline(transaction=False) as pipe:
            for file_id in file_ids:
                pipe.hmget(file_key(file_id), ["record", "tenant", "lines"])
            return [_file_record(raw) for raw in pipe.execute()]

    def delete(self, record: FileRecord) -> bool:
        """Forget a file's record and stop counting its bytes; False if it was gone already."""
        keys = [file_key(record.id), tenant_file_bytes_key(record.tenant), tenant_files_key(record.tenant)]
        return bool(self._delete(keys=[*keys, FILES_EXPIRY_KEY], args=[record.id, counted_bytes(record.bytes)]))

    def due(self, now: float, count: int = 100) -> list[str]:
        """Ids of files whose expiry has come."""
        return [raw.decode() for raw in self.redis.zrangebyscore(FILES_EXPIRY_KEY, "-inf", now, start=0, num=count)]

    def forget_due(self, file_id: str) -> None:
        """Take a file off the expiry list (its record is gone already)."""
        self.redis.zrem(FILES_EXPIRY_KEY, file_id)

    def used(self, tenant: str) -> int:
        """Bytes the tenant's files count for now (each `FILE_MIN_BYTES` at least)."""
        return int(self.redis.get(tenant_file_bytes_key(tenant)) or 0)


def counted_bytes(size: int) -> int:
    """What a file of `size` bytes counts for in its tenant's quota."""
    return max(size, FILE_MIN_BYTES)


def _file_record(raw: list[bytes | None]) -> FileRecord | None:
    """A file's record from its hash's fields (record, tenant, lines); None if there is none."""
    if raw[0] is None:
        return None
    record = FileRecord.model_validate_json(raw[0])
    return record.model_copy(update={"tenant": (raw[1] or b"local").decode(), "lines": int(raw[2] or 0)})


#: Ids read off a listing at a time.
LISTING_STEP = 100
#: How long an ended batch's record is kept unless the repository is told otherwise (`batch_ttl_s`'s default).
OPENAI_BATCH_TTL_S = 30 * 24 * 3600
#: Slack on how long a listing keeps a batch past its window and its record's time: a feeder that was down ends it
#: late.
LISTING_SLACK_S = 24 * 3600


def _listed(
    client: redis.Redis[bytes], key: str, after: str | None, wanted: int, read: Callable[[list[str]], list[T | None]]
) -> Iterator[T]:
    """A tenant's listing (a sorted set, newest first) from just after `after` (from the start when `after` is not
    in it), as the records `read` finds for its ids, a range at a time (`wanted` ids first, then `LISTING_STEP`);
    an id whose record is gone (expired) is taken off the listing."""
    start = 0
    if after is not None:
        rank = client.zrevrank(key, after)
        start = 0 if rank is None else int(rank) + 1
    step = max(1, min(wanted, LISTING_STEP))
    while ids := [raw.decode() for raw in client.zrevrange(key, start, start + step - 1)]:
        records = read(ids)
        gone = [listed_id for listed_id, record in zip(ids, records, strict=True) if record is None]
        if gone:
            client.zrem(key, *gone)
        start += len(ids) - len(gone)  # what was taken off moved the rest up
        yield from (record for record in records if record is not None)
        step = LISTING_STEP


class OpenAIBatchRepository:
    """Batches: their records (one hash field per OpenAI field, so status and counts move independently), feeding
    progress, lines in flight, and each line's outcome, written once per `custom_id`."""

    def __init__(self, client: redis.Redis[bytes], ended_ttl_s: int = OPENAI_BATCH_TTL_S) -> None:
        self.redis = client
        #: How long an ended batch's record is kept.
        self.ended_ttl_s = ended_ttl_s
        self._transition = client.register_script(_TRANSITION)
        self._create = client.register_script(_CREATE_BATCH)

    def create(self, record: OpenAIBatch, max_live: int = 0) -> bool:
        """Store a new batch and put it on the feeder's work list; False (nothing written) when its tenant has
        `max_live` batches not yet ended already (0: no cap)."""
        fields: dict[str, str | int] = {k: json.dumps(v) for k, v in record.model_dump(mode="json").items()}
        fields.update(tenant=record.tenant, fed=0, offset=0)
        window = (record.expires_at or record.created_at) - record.created_at
        # Every batch ends within its window (the feeder expires it) and its record lapses `ended_ttl_s` after: a
        # listing entry older than that (and a day's slack for a feeder that was down) names a record gone.
        keep_s = window + self.ended_ttl_s + LISTING_SLACK_S
        keys = [batch_key(record.id), tenant_batches_key(record.tenant), ACTIVE_BATCHES_KEY]
        keys.append(tenant_live_batches_key(record.tenant))
        args: list[str | int] = [record.id, record.created_at, max_live, keep_s, record.created_at - keep_s]
        args += [item for pair in fields.items() for item in pair]
        return bool(self._create(keys=keys, args=args))

    def get(self, batch_id: str) -> OpenAIBatch | None:
        """A batch's record with its counts (live while it runs); None if there is none."""
        (found,) = self._records([batch_id])
        return found

    def _records(self, batch_ids: list[str]) -> list[OpenAIBatch | None]:
        """Batches' records with their counts, in one round trip; None for each that is gone."""
        with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hgetall(batch_key(batch_id))
                pipe.hlen(batch_output_key(batch_id))
                pipe.hlen(batch_errors_key(batch_id))
            raw = pipe.execute()
        return [_openai_batch(*raw[i : i + 3]) for i in range(0, len(raw), 3)]

    def page(self, tenant: str, after: str | None, limit: int) -> list[OpenAIBatch]:
        """Up to `limit` of a tenant's batches, newest first, after the batch `after`: read a range of the listing
        at a time, and ids whose record is gone (expired) taken off it."""
        found = _listed(self.redis, tenant_batches_key(tenant), after, limit, self._records)
        return list(itertools.islice(found, limit))

    def update(self, batch_id: str, **fields: Any) -> None:
        """Set some of a batch's OpenAI fields."""
        self.redis.hset(batch_key(batch_id), mapping={k: json.dumps(v) for k, v in fields.items()})

    def move(self, batch_id: str, to: OpenAIBatchStatus, at: int, *, only_from: Iterable[OpenAIBatchStatus]) -> bool:
        """Move a batch to status `to` (stamping `<to>_at`), only if it is in one of `only_from` now."""
        keys = [batch_key(batch_id)]
        return bool(self._transition(keys=keys, args=[to, f"{to}_at", json.dumps(at), *only_from]))

    def active(self) -> list[str]:
        """Batches not over yet."""
        return sorted(raw.decode() for raw in self.redis.smembers(ACTIVE_BATCHES_KEY))

    def retire(self, batch_id: str) -> None:
        """A batch is over: off the feeder's work list and its tenant's live batches, its working sets gone, its
        record kept `ended_ttl_s` more."""
        tenant = self.redis.hget(batch_key(batch_id), "tenant")
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(ACTIVE_BATCHES_KEY, batch_id)
            if tenant is not None:
                pipe.srem(tenant_live_batches_key(tenant.decode()), batch_id)
            pipe.delete(batch_pending_key(batch_id), batch_output_key(batch_id), batch_errors_key(batch_id))
            pipe.expire(batch_key(batch_id), self.ended_ttl_s)
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

    # -- a feeder's faults, and lines that never ran, many at a time -----------------------------------------------
    def note_fault(self, batch_id: str) -> int:
        """Count one more failed try at moving a batch on; how many in a row so far."""
        return int(self.redis.hincrby(batch_key(batch_id), "faults", 1))

    def clear_faults(self, batch_id: str) -> None:
        """A batch moved on again: its failed tries are forgotten."""
        self.redis.hdel(batch_key(batch_id), "faults")

    def settle_unrun(self, batch_id: str, lines: Sequence[tuple[str, str, dict[str, Any]]]) -> int:
        """Write lines that never ran, each (job id, custom_id, error line), to the error side in two round trips
        (a line with an outcome already is left as it is), and take them off the lines in flight; how many were
        written."""
        if not lines:
            return 0
        output, errors = batch_output_key(batch_id), batch_errors_key(batch_id)
        with self.redis.pipeline(transaction=False) as pipe:
            for _, custom_id, _ in lines:
                pipe.hexists(output, custom_id)
            ran = pipe.execute()
        fresh = [(custom_id, outcome) for (_, custom_id, outcome), done in zip(lines, ran, strict=True) if not done]
        with self.redis.pipeline(transaction=True) as pipe:
            for custom_id, outcome in fresh:
                pipe.hsetnx(errors, custom_id, json.dumps(outcome, separators=(",", ":")))
            pipe.hdel(batch_pending_key(batch_id), *(job_id for job_id, _, _ in lines))
            written = sum(1 for made in pipe.execute()[: len(fresh)] if made)
        if written:
            self.redis.hincrby(BATCH_COUNTS_KEY, "failed", written)
        return written


def _openai_batch(raw: dict[bytes, bytes], completed: int, failed: int) -> OpenAIBatch | None:
    """A batch's record from its hash, with its live counts while it runs; None if there is none."""
    if not raw:
        return None
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    values: dict[str, Any] = {
        k: json.loads(fields[k]) for k in OpenAIBatch.model_fields if k in fields and k != "tenant"
    }
    record = OpenAIBatch.model_validate({**values, "tenant": fields.get("tenant", "local")})
    if record.ended:  # its final counts were written when it ended, and its working sets are gone
        return record
    counts = record.request_counts.model_copy(update={"completed": completed, "failed": failed})
    return record.model_copy(update={"request_counts": counts})


def _pending_fields(raw: bytes) -> tuple[str, int, bool]:
    value = json.loads(raw)
    return str(value["custom_id"]), int(value["line"]), bool(value.get("sent", False))
