"""A job on its way through preprocessing: its start, its input records and bands, and its hand-off to inference."""

from __future__ import annotations

import time
from typing import Any, Literal

import redis

from stoker.adapters.store.job_records import job_from_fields
from stoker.adapters.store.job_scripts import HAND_OFF, PUT_BAND, PUT_INPUT, START
from stoker.adapters.store.keys import (
    ACTIVE_KEY,
    PROGRESS_FIELD,
    band_ref,
    bands_in_ref,
    handed_off_channel,
    job_key,
    tokens_key,
)
from stoker.core.jobs import InputRecord, Job
from stoker.core.model import ModelRequest

HandOff = Literal["ok", "stale", "done"]


class JobProgress:
    """A job's preprocessing: its start, its input records and OCR bands as stages write them, and its hand-off to
    inference (once, and only against the records its prompt was built from)."""

    def __init__(self, client: redis.Redis[bytes], *, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self._put_input = client.register_script(PUT_INPUT)
        self._start = client.register_script(START)
        self._put_band = client.register_script(PUT_BAND)
        self._hand_off = client.register_script(HAND_OFF)

    def mark_started(self, job_id: str) -> bool:
        """The first stage to run for a job moves it from queued to preprocessing; True if this call did. A job
        that ended first (cancelled while its messages waited) stays as it ended."""
        return bool(self._start(keys=[job_key(job_id)], args=[repr(time.time())]))

    def get_input(self, job_id: str, ref: str) -> InputRecord | None:
        """One input's (or keyframe's) record, by its field name."""
        raw = self.redis.hget(job_key(job_id), ref)
        return InputRecord.model_validate_json(raw) if raw else None

    def put_input(self, job_id: str, ref: str, record: InputRecord) -> bool:
        """Replace one record, unless the job already went to inference (or is gone); True if written. The job's
        progress stamp (`PROGRESS_FIELD`) is written with it.

        Each record has a single writer at a time (its own chain; the reaper only after a cut-off).
        """
        args = [ref, record.model_dump_json(), PROGRESS_FIELD, repr(time.time())]
        return bool(self._put_input(keys=[job_key(job_id)], args=args))

    def put_band(self, job_id: str, ref: str, band: int, record: InputRecord) -> int:
        """Keep one band's outcome of a page OCR'd in bands; how many of its bands are in now (a band redelivered
        counts once), or -1 when the job went on without it (handed over, ended or gone)."""
        args = [band_ref(ref, band), record.model_dump_json(), bands_in_ref(ref), PROGRESS_FIELD, repr(time.time())]
        return int(self._put_band(keys=[job_key(job_id)], args=args))

    def bands(self, job_id: str, ref: str, count: int) -> list[InputRecord | None]:
        """The outcomes of a page's bands, in order (None: not in)."""
        raw = self.redis.hmget(job_key(job_id), [band_ref(ref, band) for band in range(count)])
        return [InputRecord.model_validate_json(r) if r else None for r in raw]

    def clear_bands(self, job_id: str, ref: str, count: int) -> None:
        """Forget a page's band outcomes once its record holds their joined text."""
        self.redis.hdel(job_key(job_id), *(band_ref(ref, band) for band in range(count)), bands_in_ref(ref))

    def load_for_handoff(self, job_id: str) -> tuple[Job | None, int]:
        """The job, and the revision of its input records to hand over against."""
        raw = self.redis.hgetall(job_key(job_id))
        if not raw:
            return None, 0
        return job_from_fields(job_id, raw), int(raw.get(b"rev", b"0"))

    def hand_off(self, job_id: str, request: ModelRequest, rev: int | None) -> HandOff:
        """Store the model request and move the job to inferring, once; rev None hands over whatever changed.

        'stale' when an input record changed after `rev` (build the prompt again); 'done' when someone already
        handed the job over or it ended.
        """
        keys, args = _hand_off_call(job_id, request, rev, self.ttl_s)
        result = self._hand_off(keys=keys, args=args)
        outcome = result.decode() if isinstance(result, bytes) else str(result)
        assert outcome in ("ok", "stale", "done"), outcome
        return outcome  # type: ignore[return-value]


def _hand_off_call(job_id: str, request: ModelRequest, rev: int | None, ttl_s: int) -> tuple[list[str], list[Any]]:
    """The hand-off script's keys and arguments (`JobRepository.hand_off`)."""
    args = [rev or 0, request.to_json(), repr(time.time()), ttl_s, "1" if rev is None else "0", job_id]
    args.append(handed_off_channel(job_id))
    return [job_key(job_id), tokens_key(job_id), ACTIVE_KEY], args
