"""A job's end: its terminal status with its result or error, written once and announced."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import redis
from redis.client import PubSub
from redis.exceptions import NoScriptError

from stoker.adapters.store.job_records import Queued, tenant_of
from stoker.adapters.store.job_scripts import FINISH
from stoker.adapters.store.keys import (
    ACTIVE_KEY,
    CALLBACKS_DUE_KEY,
    CANCELLED_CHANNEL,
    JOB_COUNTS_KEY,
    done_channel,
    job_blobs_key,
    job_key,
    tokens_key,
)
from stoker.adapters.store.tenants import result_keys, tenant_keys
from stoker.core.errors import ResultTooLarge
from stoker.core.jobs import MAX_RECORD_BYTES, BatchInfo, ErrorInfo, JobStatus, ResultInfo
from stoker.core.model import EncoderUse
from stoker.core.tenancy import DEFAULT_TENANT


@dataclass(frozen=True)
class Ending:
    """A terminal status to write for one job, with what goes with it."""

    job_id: str
    tenant: str
    status: JobStatus
    result: ResultInfo | None = None
    error: ErrorInfo | None = None
    batch: BatchInfo | None = None
    #: More timestamps to write with it (name → time), e.g. when its batch started and ended.
    stamps: dict[str, float] = field(default_factory=dict)
    #: Per picture the model read (content hash): whether its vision embeddings hit the cache.
    encoder: dict[str, EncoderUse] = field(default_factory=dict)


class JobEndings:
    """A job's terminal status, written once (whoever comes second changes nothing), and the cancellations announced
    as jobs end."""

    def __init__(self, client: redis.Redis[bytes], *, max_result_bytes: int = MAX_RECORD_BYTES) -> None:
        self.redis = client
        #: The most a stored result may hold: one over it is not written, and its job fails `result_too_large`.
        self.max_result_bytes = max_result_bytes
        self._finish = client.register_script(FINISH)

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        result: ResultInfo | None = None,
        error: ErrorInfo | None = None,
        batch: BatchInfo | None = None,
    ) -> bool:
        """Write a terminal status with its result or error and announce it; False if the job had already ended.
        A result over `max_result_bytes` is not written: the job fails `result_too_large` instead."""
        tenant = tenant_of(self.redis, job_id) or DEFAULT_TENANT  # never changes once written: safe to read first
        ending = Ending(job_id, tenant, status, result=result, error=error, batch=batch)
        return bool(self._finish(*_finish_call(ending, time.time(), self.max_result_bytes)))

    def finish_many(self, endings: Sequence[Ending], also: Sequence[Queued] = ()) -> list[bool]:
        """End many jobs in one pipelined round trip (the inference consumer's writer), with `also` queued after
        them (the batch's counters, the consumer letting go of its jobs); True where written. As `finish`, a result
        over `max_result_bytes` ends its job `result_too_large`."""
        now = time.time()
        calls = [_finish_call(ending, now, self.max_result_bytes) for ending in endings]
        # EVALSHA straight into the pipeline: a script run through a pipeline (`client=pipe`) has redis-py send a
        # SCRIPT EXISTS round trip before every batch. The store only forgets the script when it restarts empty
        # or is flushed; those jobs are then ended by the script itself, which loads it on NOSCRIPT.
        with self.redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.evalsha(self._finish.sha, len(keys), *keys, *args)  # type: ignore[attr-defined]  # not in the stubs
            for queue in also:
                queue(pipe)
            results = pipe.execute(raise_on_error=False)
        for i, result in enumerate(results):
            if isinstance(result, NoScriptError) and i < len(calls):
                keys, args = calls[i]
                results[i] = self._finish(keys=keys, args=args)
            elif isinstance(result, Exception):
                raise result
        return [bool(x) for x in results[: len(calls)]]

    @contextlib.contextmanager
    def cancellations(self) -> Iterator[PubSub]:
        """A subscription to every job cancelled from now on (each message's data is its id)."""
        feed = self.redis.pubsub()
        try:
            feed.subscribe(CANCELLED_CHANNEL)
            yield feed
        finally:
            feed.close()


def _finish_call(ending: Ending, now: float, max_result_bytes: int) -> tuple[list[str], list[str | int]]:
    """Keys and arguments of the finish-once script for one ending (a result over `max_result_bytes` ends its job
    failed instead, `_bounded`)."""
    ending, result, size = _bounded(ending, max_result_bytes)
    fields = {"status": ending.status, "ts:done": repr(now)}
    fields.update({f"ts:{name}": repr(at) for name, at in ending.stamps.items()})
    if result is not None:
        fields["result"] = result
    for name, value in (("error", ending.error), ("batch", ending.batch)):
        if value is not None:
            fields[name] = value.model_dump_json()
    if ending.encoder:
        fields["encoder"] = json.dumps(ending.encoder, sort_keys=True)
    job_id = ending.job_id
    keys = [job_key(job_id), tokens_key(job_id), ACTIVE_KEY, done_channel(job_id), JOB_COUNTS_KEY]
    keys += [*tenant_keys(ending.tenant), CALLBACKS_DUE_KEY, job_blobs_key(job_id), *result_keys(ending.tenant)]
    charged = size if ending.tenant != DEFAULT_TENANT else 0  # without keys there are no tenants to charge
    return keys, [job_id, ending.status, ending.tenant, charged, *(x for pair in fields.items() for x in pair)]


def _bounded(ending: Ending, max_result_bytes: int) -> tuple[Ending, str | None, int]:
    """The ending as written, with its result as stored and that result's bytes: a result of more than
    `max_result_bytes` is not stored, and the job fails `result_too_large` (stage `infer`) rather than keep a part
    of its answers: a client that asked for logprobs gets all of them or a reason."""
    if ending.result is None:
        return ending, None, 0
    result = ending.result.model_dump_json()
    size = len(result.encode())
    if size <= max_result_bytes:
        return ending, result, size
    reason = ResultTooLarge(
        f"the answer is {size} bytes, more than the {max_result_bytes} a job's result may hold: ask for fewer "
        "answers, tokens or logprobs",
        stage="infer",
    )
    return replace(ending, status="failed", result=None, error=ErrorInfo(**reason.to_dict())), None, 0
