"""The reaper's view of unfinished jobs: where each stands against its deadlines, and when to look again."""

from __future__ import annotations

import time
from typing import Literal

import redis

from stoker.adapters.store.jobs import TERMINAL_LUA
from stoker.adapters.store.keys import ACTIVE_KEY, PROGRESS_FIELD, job_key, tokens_key
from stoker.core.deadlines import JobClock
from stoker.core.jobs import TERMINAL

# A job whose inference consumer died holding it: count the loss and clear its batch start, unless it ended.
_LOST = (
    TERMINAL_LUA
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or TERMINAL[status] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
redis.call('HDEL', KEYS[1], 'ts:infer_start')
return redis.call('HINCRBY', KEYS[1], 'losses', 1)
"""
)


class Watchlist:
    """Every unfinished job in a sorted set, scored by when the reaper should next look at it."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._lost = client.register_script(_LOST)

    def clock(self, job_id: str) -> JobClock:
        """Where a job stands against its deadlines."""
        names = (
            "status",
            "deadline",
            "preprocess_by",
            "ts:preprocessed",
            "ts:infer_start",
            "redrives",
            "ts:accepted",
            "ts:started",
            PROGRESS_FIELD,
        )
        raw = dict(zip(names, self.redis.hmget(job_key(job_id), names), strict=True))

        def number(name: str) -> float | None:
            value = raw[name]
            return float(value) if value is not None else None

        return JobClock(
            status=raw["status"].decode() if raw["status"] is not None else None,
            deadline=number("deadline") or 0.0,
            preprocess_by=number("preprocess_by") or 0.0,
            preprocessed=number("ts:preprocessed"),
            infer_start=number("ts:infer_start"),
            redrives=int(number("redrives") or 0),
            accepted=number("ts:accepted"),
            started=number("ts:started"),
            progressed=number(PROGRESS_FIELD),
        )

    def stage_gate(self, job_id: str, now: float | None = None) -> Literal["open", "ended", "spent"]:
        """Whether a stage may still work for this job: "open"; "ended" once it ended (cancelled, failed: its
        stages are skipped, nothing written); "spent" once it went to inference or its budget ran out."""
        budget, handed, status = self.redis.hmget(job_key(job_id), ["preprocess_by", "ts:preprocessed", "status"])
        if status is not None and status.decode() in TERMINAL:
            return "ended"
        if handed is not None:
            return "spent"
        open_ = budget is None or (time.time() if now is None else now) < float(budget)
        return "open" if open_ else "spent"

    def ended(self, job_id: str) -> bool:
        """Whether the job ended (or is gone): work still running for it is wasted."""
        status = self.redis.hget(job_key(job_id), "status")
        return status is None or status.decode() in TERMINAL

    def due_jobs(self, now: float, limit: int = 200) -> list[str]:
        """Jobs the reaper should look at now."""
        return [raw.decode() for raw in self.redis.zrangebyscore(ACTIVE_KEY, "-inf", now, start=0, num=limit)]

    def watching(self) -> int:
        """How many jobs the reaper watches (every job that has not ended)."""
        return int(self.redis.zcard(ACTIVE_KEY))

    def watch_next(self, job_id: str, at: float | None) -> None:
        """When the reaper looks at a job again; None forgets it. A job that ended meanwhile stays forgotten."""
        if at is None:
            self.redis.zrem(ACTIVE_KEY, job_id)
        else:
            self.redis.zadd(ACTIVE_KEY, {job_id: at}, xx=True)

    def count_redrive(self, job_id: str) -> None:
        """One more re-send of a job to the inference queue."""
        self.redis.hincrby(job_key(job_id), "redrives", 1)

    def count_loss(self, job_id: str) -> int | None:
        """The consumer holding this job died: count it (how many times now) and clear its batch start; None if
        the job ended meanwhile or has no model request to send again."""
        losses = int(self._lost(keys=[job_key(job_id), tokens_key(job_id)]))
        return None if losses < 0 else losses
