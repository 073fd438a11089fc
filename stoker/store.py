"""The job store: every Redis key stoker writes is laid out and read here, and nowhere else."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

import redis

from stoker.core.media import ContentHash
from stoker.jobs import STAMPS, BatchInfo, ErrorInfo, InputRecord, Job, JobStatus, ResultInfo, compute_timings

PREFIX = "stoker"


def job_key(job_id: str) -> str:
    """Hash holding one job's record, fields written by whichever stage owns them."""
    return f"{PREFIX}:job:{job_id}"


def input_ref(index: int) -> str:
    """Field of a job's hash holding one input's record."""
    return f"input:{index}"


def frame_ref(index: int, frame: int) -> str:
    """Field holding one keyframe of a video input."""
    return f"input:{index}:frame:{frame}"


def deliveries_key(task_id: str) -> str:
    """How many times a task message was delivered to a worker."""
    return f"{PREFIX}:deliveries:{task_id}"


def tokens_key(job_id: str) -> str:
    """The job's tokenized prompt, ready for the model."""
    return f"{PREFIX}:job:{job_id}:tokens"


def done_channel(job_id: str) -> str:
    """Pub/sub channel announcing that a job reached a terminal status."""
    return f"{PREFIX}:job:{job_id}:done"


def blob_key(digest: ContentHash) -> str:
    """Raw input bytes, addressed by content."""
    return f"{PREFIX}:blob:{digest}"


def cache_key(stage: str, version: str, digest: str, fingerprint: str, part: str = "value") -> str:
    """A cached stage result: stage : stage version : content BLAKE3 : parameter fingerprint (: part)."""
    return f"{PREFIX}:cache:{stage}:{version}:{digest}:{fingerprint}:{part}"


def cache_lease_key(stage: str, version: str, digest: str, fingerprint: str) -> str:
    """The single-flight lease of whoever is computing that result now."""
    return f"{PREFIX}:lease:{stage}:{version}:{digest}:{fingerprint}"


CACHE_STATS_KEY = f"{PREFIX}:cache-stats"
#: The fingerprint of the workers' whole preprocessing configuration, as they last published it.
PIPELINE_IDENTITY_KEY = f"{PREFIX}:pipeline-identity"


class JobStore:
    """Synchronous access to jobs, blobs and artefacts in Redis."""

    def __init__(self, client: redis.Redis[bytes], *, blob_ttl_s: int, job_ttl_s: int) -> None:
        self.redis = client
        self.blob_ttl_s = blob_ttl_s
        self.job_ttl_s = job_ttl_s

    @classmethod
    def from_url(cls, url: str, *, blob_ttl_s: int, job_ttl_s: int) -> JobStore:
        """Connect lazily to the store at url."""
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10, health_check_interval=30)
        return cls(client, blob_ttl_s=blob_ttl_s, job_ttl_s=job_ttl_s)

    # -- blobs and artefacts -------------------------------------------------------------------------------
    def put_blob(self, digest: ContentHash, data: bytes) -> None:
        """Store input bytes once; a repeat only refreshes their lifetime."""
        key = blob_key(digest)
        if not self.redis.set(key, data, ex=self.blob_ttl_s, nx=True):
            self.redis.expire(key, self.blob_ttl_s)

    def get_blob(self, digest: ContentHash) -> bytes | None:
        """Input bytes, or None when they expired."""
        return self._get_bytes(blob_key(digest))

    def _get_bytes(self, key: str) -> bytes | None:
        value = self.redis.get(key)
        return bytes(value) if value is not None else None

    def count_delivery(self, task_id: str) -> int:
        """Count one more delivery of a task message; returns how many there have been."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(deliveries_key(task_id))
            pipe.expire(deliveries_key(task_id), self.job_ttl_s)
            count, _ = pipe.execute()
        return int(count)

    # -- jobs ---------------------------------------------------------------------------------------------
    def create_job(self, job_id: str, prompt: str, inputs: Iterable[InputRecord], accepted: float) -> None:
        """Write a new job record atomically, in status queued."""
        fields: dict[str | bytes, str | bytes | float | int] = {
            "prompt": prompt,
            "status": "queued",
            "ts:accepted": repr(accepted),
        }
        for record in inputs:
            fields[input_ref(record.index)] = record.model_dump_json()
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(job_key(job_id), mapping=fields)
            pipe.expire(job_key(job_id), self.job_ttl_s)
            pipe.execute()

    def delete_job(self, job_id: str) -> None:
        """Forget a job that was never enqueued."""
        self.redis.delete(job_key(job_id), tokens_key(job_id))

    def mark_started(self, job_id: str) -> None:
        """The first stage to run for a job moves it to preprocessing."""
        if self.redis.hsetnx(job_key(job_id), "ts:started", repr(time.time())):
            self.redis.hset(job_key(job_id), "status", "preprocessing")

    def stamp(self, job_id: str, name: str, at: float | None = None, status: JobStatus | None = None) -> None:
        """Record a timestamp, and optionally a status change, in one round trip."""
        fields: dict[str | bytes, str | bytes | float | int] = {f"ts:{name}": repr(time.time() if at is None else at)}
        if status:
            fields["status"] = status
        self.redis.hset(job_key(job_id), mapping=fields)

    def get_stamp(self, job_id: str, name: str) -> float | None:
        """One timestamp of a job, or None if not reached yet."""
        raw = self.redis.hget(job_key(job_id), f"ts:{name}")
        return float(raw) if raw else None

    def get_input(self, job_id: str, ref: str) -> InputRecord | None:
        """One input's (or keyframe's) record, by its field name."""
        raw = self.redis.hget(job_key(job_id), ref)
        return InputRecord.model_validate_json(raw) if raw else None

    def put_input(self, job_id: str, ref: str, record: InputRecord) -> None:
        """Replace one record; each has a single writer at a time (its own chain)."""
        self.redis.hset(job_key(job_id), ref, record.model_dump_json())

    def put_tokens(self, job_id: str, ids: list[int]) -> None:
        """Store the tokenized prompt for the inference consumer."""
        self.redis.set(tokens_key(job_id), json.dumps(ids), ex=self.job_ttl_s)

    def get_tokens(self, job_id: str) -> list[int] | None:
        """The tokenized prompt, or None."""
        raw = self.redis.get(tokens_key(job_id))
        return [int(i) for i in json.loads(raw)] if raw else None

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        result: ResultInfo | None = None,
        error: ErrorInfo | None = None,
        batch: BatchInfo | None = None,
    ) -> None:
        """Write a terminal status with its result or error, then announce it."""
        fields: dict[str | bytes, str | bytes | float | int] = {"status": status, "ts:done": repr(time.time())}
        if result:
            fields["result"] = result.model_dump_json()
        if error:
            fields["error"] = error.model_dump_json()
        if batch:
            fields["batch"] = batch.model_dump_json()
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(job_key(job_id), mapping=fields)
            pipe.delete(tokens_key(job_id))
            pipe.publish(done_channel(job_id), status)
            pipe.execute()

    def load_job(self, job_id: str) -> Job | None:
        """The job as clients see it, assembled from its record; None if unknown."""
        raw = self.redis.hgetall(job_key(job_id))
        return job_from_fields(job_id, raw) if raw else None


def job_from_fields(job_id: str, raw: dict[bytes, bytes]) -> Job:
    """Assemble a Job from the fields of its Redis hash."""
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    inputs = _nest_inputs({k: InputRecord.model_validate_json(v) for k, v in fields.items() if k.startswith("input:")})
    stamps = {name: float(fields[f"ts:{name}"]) for name in STAMPS if f"ts:{name}" in fields}
    return Job(
        id=job_id,
        status=fields.get("status", "queued"),
        prompt=fields.get("prompt", ""),
        inputs=inputs,
        result=ResultInfo.model_validate_json(fields["result"]) if "result" in fields else None,
        error=ErrorInfo.model_validate_json(fields["error"]) if "error" in fields else None,
        batch=BatchInfo.model_validate_json(fields["batch"]) if "batch" in fields else None,
        timings_ms=compute_timings(stamps),
    )


def _nest_inputs(records: dict[str, InputRecord]) -> list[InputRecord]:
    """Top-level inputs in order, each video carrying its filled keyframes."""
    top = {ref: r for ref, r in records.items() if ref.count(":") == 1}
    for ref, frame in sorted(records.items(), key=lambda item: item[1].index):
        parent = ref.rsplit(":frame:", 1)[0]
        if ref.count(":") == 3 and parent in top and frame.status != "skipped":
            top[parent].frames = [*(top[parent].frames or []), frame]
    return sorted(top.values(), key=lambda r: r.index)
