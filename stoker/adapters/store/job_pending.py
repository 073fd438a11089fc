"""Jobs waiting for the model, as the inference consumer loads them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from stoker.adapters.store.job_records import Queued, job_from_fields
from stoker.adapters.store.keys import job_key, tokens_key
from stoker.core.jobs import STAMPS, Job
from stoker.core.model import ModelRequest


@dataclass(frozen=True)
class Pending:
    """A job waiting for the model, as the inference consumer loads it: its request and its record."""

    job: Job
    request: ModelRequest
    #: When preprocessing handed it over (its wait for a batch starts there), and its deadline, if any.
    preprocessed: float | None
    deadline: float | None
    trace: dict[str, str] | None
    #: Its timestamps so far (name → time), so its timings can be told once it ends without reading it back.
    stamps: dict[str, float] = field(default_factory=dict)


class PendingRequests:
    """Jobs handed over to inference: their model requests loaded with their records for a batch, and the stamps
    the consumer writes while they run."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client

    def load_pending(self, job_ids: Sequence[str], also: Sequence[Queued] = ()) -> dict[str, Pending | None]:
        """Many jobs' model requests with their records, in one pipelined round trip (`also` queued before the
        reads): what a batch needs, so the consumer reads nothing more per job. None for a job with no request left
        (ended, or never handed over)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for queue in also:
                queue(pipe)
            first = len(pipe)
            for job_id in job_ids:
                pipe.get(tokens_key(job_id))
                pipe.hgetall(job_key(job_id))
            raw = pipe.execute()[first:]
        return {job_id: _pending(job_id, raw[2 * i], raw[2 * i + 1]) for i, job_id in enumerate(job_ids)}

    def get_request(self, job_id: str) -> ModelRequest | None:
        """The job's model request, or None once it ended (or was never handed over)."""
        raw = self.redis.get(tokens_key(job_id))
        return ModelRequest.from_json(raw) if raw else None

    def stamp_many(self, job_ids: Sequence[str], name: str, at: float, also: Sequence[Queued] = ()) -> None:
        """The same timestamp on many jobs, with `also`, in one pipelined round trip."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hset(job_key(job_id), f"ts:{name}", repr(at))
            for queue in also:
                queue(pipe)
            pipe.execute()


def _pending(job_id: str, tokens: bytes | None, raw: dict[bytes, bytes]) -> Pending | None:
    if not tokens or not raw:
        return None

    def number(name: bytes) -> float | None:
        value = raw.get(name)
        return float(value) if value is not None else None

    context = raw.get(b"trace_context")
    trace = dict(json.loads(context)) if context else None
    job = job_from_fields(job_id, raw)
    stamps = {name: float(raw[f"ts:{name}".encode()]) for name in STAMPS if f"ts:{name}".encode() in raw}
    request = ModelRequest.from_json(tokens)
    return Pending(job, request, number(b"ts:preprocessed"), number(b"deadline"), trace, stamps)
