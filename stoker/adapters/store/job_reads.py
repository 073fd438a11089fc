"""Reading job records: what the API answers a client with, and what a stage reads of a job alone."""

from __future__ import annotations

import json
from collections.abc import Sequence

import redis

from stoker.adapters.store.job_records import job_from_fields, pairs, tenant_of
from stoker.adapters.store.job_scripts import WATCH
from stoker.adapters.store.keys import job_key, tenant_index_key
from stoker.core.jobs import Conversation, Cursor, Job


class JobReads:
    """Jobs as clients see them: one, many, a tenant's page, and the parts a stage reads alone."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._watch = client.register_script(WATCH)

    def load_job(self, job_id: str) -> Job | None:
        """The job as clients see it, assembled from its record; None if unknown."""
        raw = self.redis.hgetall(job_key(job_id))
        return job_from_fields(job_id, raw) if raw else None

    def watch_job(self, job_id: str) -> Job | None:
        """`load_job` for a client that is about to wait on the job: its end is announced from this read on (one
        nobody waits on is not announced). One round trip, as `load_job`."""
        raw = self._watch(keys=[job_key(job_id)])
        return job_from_fields(job_id, pairs(raw)) if raw else None

    def page(self, tenant: str, cursor: Cursor | None, count: int) -> list[Cursor]:
        """Up to `count` of a tenant's jobs, newest first, after `cursor` (None: from the newest): each as the
        cursor that points at it (when it was accepted, its id). Redis orders equal times by id, reversed here."""
        top = "+inf" if cursor is None else repr(cursor.accepted)
        # Entries at the cursor's own time may come before it: ask for enough to step over them.
        raw = self.redis.zrevrangebyscore(
            tenant_index_key(tenant), top, "-inf", start=0, num=count + 64, withscores=True
        )
        entries = [Cursor(float(score), member.decode()) for member, score in raw]
        return [e for e in entries if cursor is None or e.after(cursor)][:count]

    def load_many(self, job_ids: Sequence[str]) -> list[Job | None]:
        """Many jobs as clients see them, in one round trip; None for one whose record is gone."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(job_key(job_id))
            found = pipe.execute()
        return [job_from_fields(job_id, raw) if raw else None for job_id, raw in zip(job_ids, found, strict=True)]

    def tenant(self, job_id: str) -> str | None:
        """The tenant a job belongs to; None if the job is unknown."""
        return tenant_of(self.redis, job_id)

    def conversation(self, job_id: str) -> Conversation | None:
        """A chat job's turns and parameters (a render's among them); None for another job or an unknown one."""
        raw = self.redis.hget(job_key(job_id), "chat")
        return Conversation.model_validate_json(raw) if raw is not None else None

    def trace_context(self, job_id: str) -> dict[str, str] | None:
        """The job's stored trace context (a W3C traceparent carrier), for spans that run outside its messages."""
        raw = self.redis.hget(job_key(job_id), "trace_context")
        return dict(json.loads(raw)) if raw else None
