"""A job's record as its Redis hash holds it, read back into a `Job`; the types the job repositories share."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis.client import Pipeline

from stoker.adapters.store.keys import job_key
from stoker.core.jobs import (
    STAMPS,
    BatchInfo,
    CallbackState,
    Conversation,
    ErrorInfo,
    InputRecord,
    Job,
    ResultInfo,
    compute_timings,
    preprocess_share,
)
from stoker.core.model import EncoderUse
from stoker.core.tenancy import DEFAULT_TENANT

#: Another repository's commands, queued onto a transaction of this one's (so that both go in one round trip).
Queued = Callable[["Pipeline[bytes]"], Any]
#: A script's keys and arguments.
ScriptCall = tuple[list[str], list[Any]]


def tenant_of(client: redis.Redis[bytes], job_id: str) -> str | None:
    """The tenant a job belongs to; None if the job is unknown."""
    raw = client.hget(job_key(job_id), "tenant")
    return raw.decode() if raw is not None else None


def ended_job(job_id: str, announced: bytes) -> Job | None:
    """The job as the announcement of its end carries it (a watched job's ended record, `FINISH`: a JSON array of
    its hash's fields and values in turn); None for an announcement that carries no record."""
    try:
        flat = json.loads(announced)
    except ValueError:
        return None
    if not isinstance(flat, list) or not flat or len(flat) % 2:
        return None
    return _job_from_text(job_id, pairs(flat))


def pairs(flat: list[Any]) -> dict[Any, Any]:
    """A hash's fields and values, given in turn (as a script's `HGETALL` returns them), as a mapping."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def job_from_fields(job_id: str, raw: dict[bytes, bytes]) -> Job:
    """Assemble a Job from the fields of its Redis hash."""
    return _job_from_text(job_id, {k.decode(): v.decode() for k, v in raw.items()})


def _job_from_text(job_id: str, fields: dict[str, str]) -> Job:
    """Assemble a Job from the fields of its Redis hash, decoded."""
    inputs = _nest_inputs({k: InputRecord.model_validate_json(v) for k, v in fields.items() if k.startswith("input:")})
    if "encoder" in fields:
        _mark_encoder(inputs, json.loads(fields["encoder"]))
    stamps = {name: float(fields[f"ts:{name}"]) for name in STAMPS if f"ts:{name}" in fields}
    timings = compute_timings(stamps)
    return Job(
        id=job_id,
        status=fields.get("status", "queued"),
        prompt=fields.get("prompt", ""),
        inputs=inputs,
        result=ResultInfo.model_validate_json(fields["result"]) if "result" in fields else None,
        error=ErrorInfo.model_validate_json(fields["error"]) if "error" in fields else None,
        batch=BatchInfo.model_validate_json(fields["batch"]) if "batch" in fields else None,
        timings_ms=timings,
        deadline_ms=int(fields["deadline_ms"]) if "deadline_ms" in fields else None,
        preprocess_share=preprocess_share(timings),
        trace_id=fields.get("trace_id"),
        chat=Conversation.model_validate_json(fields["chat"]) if "chat" in fields else None,
        callback=CallbackState.model_validate_json(fields["callback"]) if "callback" in fields else None,
        tenant=fields.get("tenant", DEFAULT_TENANT),
        job_class=fields.get("class", "interactive"),
        batch_id=fields.get("batch_id"),
    )


def _mark_encoder(records: Iterable[InputRecord], used: dict[str, EncoderUse]) -> None:
    """Each picture (or keyframe) the model read says whether its vision embeddings hit the cache: one field
    written when the job ended, not one write per input."""
    for record in records:
        record.encoder = used.get(record.content_hash, record.encoder)
        _mark_encoder(record.frames or [], used)


def _nest_inputs(records: dict[str, InputRecord]) -> list[InputRecord]:
    """Top-level inputs in order, each video carrying its filled keyframes."""
    top = {ref: r for ref, r in records.items() if ref.count(":") == 1}
    for ref, frame in sorted(records.items(), key=lambda item: item[1].index):
        parent = ref.rsplit(":frame:", 1)[0]
        if ref.count(":") == 3 and parent in top and frame.status != "skipped":
            top[parent].frames = [*(top[parent].frames or []), frame]
    return sorted(top.values(), key=lambda r: r.index)
