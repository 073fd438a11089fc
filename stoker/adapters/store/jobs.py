"""Job records: created by the API, filled in by each stage, handed to inference once, ended once.

Each concern is a repository of its own over the one key layout (`keys`): a new job (`job_creation`), reads
(`job_reads`), preprocessing's progress and hand-off (`job_progress`), the requests waiting for the model
(`job_pending`) and endings (`job_endings`), with the Lua scripts they run (`job_scripts`) and the record's codec
(`job_records`). `JobRepository` is all of them over one client: what `Store.jobs` is, so a caller reaches a job's
every write and read in one place.
"""

from __future__ import annotations

import redis

from stoker.adapters.store.job_creation import JobCreation, LoopJobs, NewJob, Required, check_record_size
from stoker.adapters.store.job_endings import Ending, JobEndings
from stoker.adapters.store.job_pending import Pending, PendingRequests
from stoker.adapters.store.job_progress import HandOff, JobProgress
from stoker.adapters.store.job_reads import JobReads
from stoker.adapters.store.job_records import Queued, ScriptCall, ended_job, job_from_fields
from stoker.adapters.store.job_scripts import TERMINAL_LUA
from stoker.core.jobs import MAX_RECORD_BYTES

__all__ = [
    "TERMINAL_LUA",
    "Ending",
    "HandOff",
    "JobRepository",
    "LoopJobs",
    "NewJob",
    "Pending",
    "Queued",
    "Required",
    "ScriptCall",
    "check_record_size",
    "ended_job",
    "job_from_fields",
]


class JobRepository(JobCreation, JobReads, JobProgress, PendingRequests, JobEndings):
    """One hash per job (`keys.job_key`), its model request, and its place on the reaper's watch list: every job
    repository over one client."""

    def __init__(
        self,
        client: redis.Redis[bytes],
        *,
        ttl_s: int,
        max_record_bytes: int = MAX_RECORD_BYTES,
        max_result_bytes: int = MAX_RECORD_BYTES,
    ) -> None:
        JobCreation.__init__(self, client, ttl_s=ttl_s, max_record_bytes=max_record_bytes)
        JobReads.__init__(self, client)
        JobProgress.__init__(self, client, ttl_s=ttl_s)
        PendingRequests.__init__(self, client)
        JobEndings.__init__(self, client, max_result_bytes=max_result_bytes)
