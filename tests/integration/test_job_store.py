"""The job store's promises against real Redis: a terminal status is final, whoever writes after it."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from stoker.adapters.store import Store
from stoker.adapters.store.coordination import give_up_lease
from stoker.adapters.store.idempotency import IdempotencyKeys
from stoker.adapters.store.jobs import Ending, LoopJobs, NewJob, Required, ended_job
from stoker.adapters.store.keys import (
    ACTIVE_KEY,
    blob_holders_key,
    blob_key,
    consumer_jobs_key,
    done_channel,
    job_blobs_key,
    job_key,
    tokens_key,
)
from stoker.core.deadlines import deadline_for
from stoker.core.errors import RecordTooLarge
from stoker.core.jobs import TERMINAL, ErrorInfo, InputRecord, Job, ResultInfo
from stoker.core.media import ContentHash
from stoker.core.model import ModelRequest
from stoker.settings import CommonSettings
from workers.broker import free_port, start_embedded
from workers.procs import stop


@pytest.fixture
def job_store(store_redis: redis.Redis[bytes]) -> Store:
    """The test store, as the API and the workers see it."""
    return Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)


def _new_job(store: Store, watched: bool = False) -> str:
    job_id = uuid.uuid4().hex
    now = time.time()
    record = InputRecord(index=0, kind="image", content_hash="ab" * 32, size_bytes=10)
    deadline = deadline_for(now, 60_000, 5_000)
    store.jobs.create(job_id, NewJob("Hi.", [record], now, deadline, 60_000, tenant="t", watched=watched))
    return job_id


def _every_later_write(store: Store, job_id: str) -> None:
    """Every write a stage, the consumer, the reaper or the API makes to a job's record."""
    store.jobs.mark_started(job_id)
    late = InputRecord(index=0, kind="image", content_hash="ab" * 32, size_bytes=10, status="ok", text="late")
    store.jobs.put_input(job_id, "input:0", late)
    store.jobs.hand_off(job_id, ModelRequest(prompt_ids=[1, 2, 3]), None)
    store.jobs.finish(
        job_id, "succeeded", result=ResultInfo(text="late", model="m", prompt_tokens=3, completion_tokens=1)
    )
    store.jobs.finish_many([Ending(job_id, "t", "failed", error=ErrorInfo(code="x", message="late"))])
    store.watch.count_loss(job_id)


@pytest.mark.parametrize("status", sorted(TERMINAL))
def test_a_terminal_status_is_final_whatever_writes_after_it(job_store: Store, status: str) -> None:
    job_id = _new_job(job_store)
    try:
        assert job_store.jobs.finish(job_id, status)  # type: ignore[arg-type]
        ended = job_store.client.hgetall(job_key(job_id))
        counts = job_store.stats.job_counts()
        _every_later_write(job_store, job_id)
        assert job_store.client.hgetall(job_key(job_id)) == ended  # not one field changed
        assert job_store.stats.job_counts() == counts  # counted once
        assert not job_store.client.exists(tokens_key(job_id))  # nothing handed to the model
    finally:
        job_store.client.zrem(ACTIVE_KEY, job_id)


def test_only_a_queued_job_starts(job_store: Store) -> None:
    job_id = _new_job(job_store)
    try:
        assert job_store.jobs.mark_started(job_id)
        assert not job_store.jobs.mark_started(job_id)  # the second stage to start changes nothing
        assert job_store.client.hget(job_key(job_id), "status") == b"preprocessing"
        assert not job_store.jobs.mark_started(uuid.uuid4().hex)  # an unknown job is not made up
    finally:
        job_store.jobs.finish(job_id, "cancelled")
        job_store.client.zrem(ACTIVE_KEY, job_id)


def test_every_record_or_band_a_stage_writes_is_progress_the_reaper_reads(job_store: Store) -> None:
    job_id = _new_job(job_store)
    try:
        assert job_store.jobs.mark_started(job_id)
        clock = job_store.watch.clock(job_id)
        assert clock.status == "preprocessing"
        assert clock.progressed is None
        assert clock.started is not None
        assert clock.last_progress == clock.started
        decoded = InputRecord(index=0, kind="image", content_hash="ab" * 32, size_bytes=10, bands=2)
        assert job_store.jobs.put_input(job_id, "input:0", decoded)
        written = job_store.watch.clock(job_id).progressed
        assert written is not None
        assert written >= clock.started
        assert job_store.jobs.put_band(job_id, "input:0", 0, decoded) == 1
        banded = job_store.watch.clock(job_id).progressed
        assert banded is not None
        assert banded >= written
        job_store.jobs.hand_off(job_id, ModelRequest(prompt_ids=[1, 2, 3]), None)
        assert not job_store.jobs.put_input(job_id, "input:0", decoded)  # refused once handed over: no progress
        assert job_store.watch.clock(job_id).progressed == banded
    finally:
        job_store.jobs.finish(job_id, "cancelled")
        job_store.client.zrem(ACTIVE_KEY, job_id)


def test_a_blob_lives_until_the_last_job_holding_it_ends(job_store: Store) -> None:
    first, second = _new_job(job_store), _new_job(job_store)
    digest = ContentHash(uuid.uuid4().hex * 2)
    job_store.blobs.put_blob(digest, b"x" * 1000, first)
    job_store.blobs.put_blob(digest, b"x" * 1000, second)  # the same content in another job: stored once
    try:
        assert job_store.blobs.holders(digest) == {first, second}
        job_store.jobs.finish(first, "succeeded")
        assert job_store.blobs.get_blob(digest) == b"x" * 1000  # the other job still needs it
        job_store.jobs.finish(second, "cancelled")
        assert job_store.blobs.get_blob(digest) is None
        assert not job_store.client.exists(blob_key(digest), blob_holders_key(digest), job_blobs_key(first))
    finally:
        job_store.client.zrem(ACTIVE_KEY, first, second)


def test_a_job_never_accepted_lets_go_of_its_blobs_and_a_held_blob_cannot_be_revived(job_store: Store) -> None:
    job_id = _new_job(job_store)
    digest = ContentHash(uuid.uuid4().hex * 2)
    job_store.blobs.put_blob(digest, b"y", job_id)
    job_store.jobs.delete_job(job_id)
    job_store.blobs.release(job_id)
    assert job_store.blobs.get_blob(digest) is None
    assert not job_store.blobs.hold(digest, job_id)  # gone: nothing to hold, and no holder left behind
    assert not job_store.client.exists(blob_holders_key(digest), job_blobs_key(job_id))


def test_a_record_over_its_size_limit_is_refused_before_anything_is_written(store_redis: redis.Redis[bytes]) -> None:
    store = Store.over(store_redis, blob_ttl_s=60, job_ttl_s=60, max_record_bytes=64 * 1024)
    job_id, now = uuid.uuid4().hex, time.time()
    with pytest.raises(RecordTooLarge) as refused:
        store.jobs.create(job_id, NewJob("x" * 70_000, [], now, deadline_for(now, 60_000, 5_000), 60_000, tenant="t"))
    assert (refused.value.http_status, refused.value.code) == (413, "record_too_large")
    assert not store_redis.exists(job_key(job_id))
    assert store_redis.zscore(ACTIVE_KEY, job_id) is None


def test_each_picture_says_whether_its_vision_embeddings_hit_when_the_job_ends(job_store: Store) -> None:
    job_id = uuid.uuid4().hex
    now = time.time()
    seen, new = "cd" * 32, "ef" * 32
    records = [InputRecord(index=i, kind="image", content_hash=h, size_bytes=10) for i, h in enumerate((seen, new))]
    records.append(InputRecord(index=2, kind="audio", content_hash="01" * 32, size_bytes=3))
    job_store.jobs.create(job_id, NewJob("Hi.", records, now, deadline_for(now, 60_000, 5_000), 60_000, tenant="t"))
    try:
        result = ResultInfo(text="a shoe", model="m", prompt_tokens=3, completion_tokens=2)
        ending = Ending(job_id, "t", "succeeded", result=result, encoder={seen: "hit", new: "miss"})
        assert job_store.jobs.finish_many([ending]) == [True]
        job = job_store.jobs.load_job(job_id)
        assert job is not None
        assert [r.encoder for r in job.inputs] == ["hit", "miss", None]
    finally:
        job_store.client.zrem(ACTIVE_KEY, job_id)


def test_a_lease_is_given_up_only_by_its_holder(job_store: Store) -> None:
    leases, key = job_store.leases, f"stoker:test:lease:{uuid.uuid4().hex}"
    try:
        assert leases.take_lease(key, "first", 60)
        assert not leases.take_lease(key, "second", 60)  # held: another waits
        assert not leases.release_lease(key, "second")  # not its lease: still held
        assert job_store.client.get(key) == b"first"
        assert leases.release_lease(key, "first")
        assert leases.take_lease(key, "second", 60)  # at once, not when the first would have lapsed
        assert not leases.release_lease(key, "first")  # the old holder cannot take it from the new one
        assert job_store.client.get(key) == b"second"
    finally:
        job_store.client.delete(key)


def test_a_stopping_process_gives_its_lease_up_once_and_a_store_that_is_gone_is_no_error(job_store: Store) -> None:
    key = f"stoker:test:lease:{uuid.uuid4().hex}"
    live = CommonSettings()  # the test store's address, from the environment as every process reads it
    try:
        assert job_store.leases.take_lease(key, "me", 60)
        assert give_up_lease(live, key, "me")
        assert job_store.client.get(key) is None
    finally:
        job_store.client.delete(key)
    gone = CommonSettings(result_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    assert not give_up_lease(gone, key, "me")


@pytest.fixture
def own_store() -> Iterator[Store]:
    """A store on a Valkey of the test's own, for tests that count its commands or flush its scripts."""
    valkey, port = start_embedded(persist=False)
    client = redis.Redis(port=port)
    try:
        yield Store.over(client, blob_ttl_s=60, job_ttl_s=60)
    finally:
        client.close()
        stop(valkey)


def test_a_batch_ends_in_one_round_trip_and_still_ends_after_the_store_forgot_its_scripts(own_store: Store) -> None:
    """The consumer's writer sends its batch's endings as one pipeline, with no SCRIPT EXISTS before it; a store that
    restarted empty or was flushed (no scripts) still ends every job of the batch."""
    store, client = own_store, own_store.client
    first, second = _new_job(store), _new_job(store)
    store.jobs.finish_many([Ending(first, "t", "failed", error=ErrorInfo(code="x", message="warm"))])
    client.config_resetstat()
    answer = ResultInfo(text="a", model="m", prompt_tokens=1, completion_tokens=1)
    ending = Ending(second, "t", "succeeded", result=answer)
    assert store.jobs.finish_many([ending]) == [True]
    calls = {name: int(stat["calls"]) for name, stat in client.info("commandstats").items()}
    assert "cmdstat_script|exists" not in calls
    assert calls["cmdstat_evalsha"] == 1

    client.script_flush()
    third, fourth = _new_job(store), _new_job(store)
    endings = [Ending(j, "t", "succeeded", result=answer) for j in (third, fourth)]
    assert store.jobs.finish_many([*endings, ending]) == [True, True, False]  # the second had already ended
    ended = [store.jobs.load_job(j) for j in (third, fourth)]
    assert [job.status if job else None for job in ended] == ["succeeded", "succeeded"]


def _create(store: Store, on_loop: bool, job_id: str, new: NewJob) -> Job:
    """A new job, made by the synchronous repository or by its asyncio twin on a loop (as the API makes it)."""
    if not on_loop:
        return store.jobs.create(job_id, new)
    kwargs = store.client.connection_pool.connection_kwargs

    async def made() -> Job:
        jobs = LoopJobs(aioredis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs["db"]), ttl_s=3600)
        try:
            return await jobs.create(job_id, new)
        finally:
            await jobs.aclose()

    return asyncio.run(made())


@pytest.mark.parametrize("on_loop", [False, True], ids=["sync", "loop"])
def test_a_job_for_the_model_is_made_handed_over_and_read_back_in_one_transaction(
    own_store: Store, on_loop: bool
) -> None:
    """The API makes a job that skips preprocessing in one round trip: its record, its hand-off to inference, what
    another repository queues with it (the retry fingerprint) and the read of the job as written; after the store
    forgot its scripts, the hand-off still happens. So does the asyncio twin the API makes it with."""
    store, client = own_store, own_store.client
    request = ModelRequest(prompt_ids=[1, 2, 3])

    def made(note: str) -> tuple[str, Job]:
        job_id, now = uuid.uuid4().hex, time.time()
        remember = functools.partial(IdempotencyKeys.queue_recent, digest=note, job_id=job_id, ttl_s=60)
        deadline = deadline_for(now, 60_000, 5_000)
        new = NewJob("Hi.", [], now, deadline, 60_000, tenant="t", request=request, also=[remember])
        return job_id, _create(store, on_loop, job_id, new)

    made("warm")
    client.config_resetstat()
    job_id, job = made("d1")
    calls = {name: int(stat["calls"]) for name, stat in client.info("commandstats").items()}
    assert (calls["cmdstat_multi"], calls["cmdstat_exec"], calls["cmdstat_evalsha"]) == (1, 1, 1)
    assert "cmdstat_script|exists" not in calls
    assert (job.id, job.status) == (job_id, "inferring")  # read back after the hand-off
    assert store.jobs.get_request(job_id) == request
    assert store.idempotency.recent("d1") == job_id

    client.script_flush()
    job_id, job = made("d2")
    assert job.status == "inferring"
    assert store.jobs.get_request(job_id) == request
    assert store.idempotency.recent("d2") == job_id


@pytest.mark.parametrize("on_loop", [False, True], ids=["sync", "loop"])
def test_an_upload_is_stored_with_its_job_in_one_transaction_even_after_the_store_forgot_its_scripts(
    own_store: Store, on_loop: bool
) -> None:
    """The API writes a job's uploaded bytes in the transaction that makes the job: the job holds them once it
    exists, with no round trip of their own; after the store forgot its scripts they are still written (by the
    asyncio twin too)."""
    store, client = own_store, own_store.client

    def made(data: bytes) -> tuple[str, ContentHash]:
        job_id, now, digest = uuid.uuid4().hex, time.time(), ContentHash(uuid.uuid4().hex)
        upload = Required(
            functools.partial(store.blobs.queue_put, digest=digest, data=data, job_id=job_id),
            functools.partial(store.blobs.put_blob, digest, data, job_id),
        )
        deadline = deadline_for(now, 60_000, 5_000)
        _create(store, on_loop, job_id, NewJob("Hi.", [], now, deadline, 60_000, tenant="t", required=[upload]))
        return job_id, digest

    made(b"warm")
    client.config_resetstat()
    job_id, digest = made(b"picture bytes")
    calls = {name: int(stat["calls"]) for name, stat in client.info("commandstats").items()}
    # one transaction: the new job's script and the upload's
    assert (calls["cmdstat_multi"], calls["cmdstat_exec"], calls["cmdstat_evalsha"]) == (1, 1, 2)
    assert store.blobs.get_blob(digest) == b"picture bytes"
    assert store.blobs.holders(digest) == {job_id}

    client.script_flush()
    job_id, digest = made(b"more bytes")
    assert store.blobs.get_blob(digest) == b"more bytes"
    assert store.blobs.holders(digest) == {job_id}
    assert store.jobs.load_job(job_id) is not None


def test_a_job_is_announced_ended_only_where_a_client_waits_on_it(own_store: Store) -> None:
    """A job's end is announced when its client waits on it from the start (a POST that waits) or began to later
    (a long-poll's or a chat's read, `watch_job`): an API process wakes for no job nobody waits on."""
    store, client = own_store, own_store.client
    unwatched, from_start, later = _new_job(store), _new_job(store, watched=True), _new_job(store)
    watched = store.jobs.watch_job(later)
    assert watched is not None
    assert (watched.id, watched.status) == (later, "queued")
    unknown = uuid.uuid4().hex
    assert store.jobs.watch_job(unknown) is None
    assert not client.exists(job_key(unknown))  # an unknown job is not made by watching it
    pubsub = client.pubsub()
    pubsub.psubscribe(done_channel("*"))
    confirmed = pubsub.get_message(timeout=10)
    assert confirmed is not None
    assert confirmed["type"] == "psubscribe"
    try:
        answer = ResultInfo(text="a", model="m", prompt_tokens=1, completion_tokens=1)
        for job_id in (unwatched, from_start, later):
            assert store.jobs.finish_many([Ending(job_id, "t", "succeeded", result=answer)]) == [True]
        ended = client.hgetall(job_key(unwatched))
        read = store.jobs.watch_job(unwatched)
        assert read is not None
        assert read.status == "succeeded"
        assert client.hgetall(job_key(unwatched)) == ended  # an ended job's record no longer changes
        marker = uuid.uuid4().hex
        client.publish(done_channel(marker), "")  # heard after every announcement made before it
        heard: list[str] = []
        records: list[Job | None] = []
        while marker not in heard:
            message = pubsub.get_message(timeout=10)
            assert message is not None, f"no announcement within 10 s (heard {heard})"
            heard.append(message["channel"].decode().split(":")[-2])
            records.append(ended_job(heard[-1], message["data"]))
    finally:
        pubsub.close()
    assert heard == [from_start, later, marker]
    # each end carries the ended record, as a read of it finds it; the marker carries none
    assert records == [store.jobs.load_job(from_start), store.jobs.load_job(later), None]
    assert records[0] is not None
    assert (records[0].status, records[0].result) == ("succeeded", answer)


def test_a_batch_is_ended_counted_and_let_go_of_in_one_pipeline_even_after_the_store_forgot_its_scripts(
    own_store: Store,
) -> None:
    """The consumer's writer sends a batch's endings, its counters and its letting go of the batch's jobs in one
    pipeline: each is written, and the endings' answers are the endings' alone, scripts or none."""
    store, client = own_store, own_store.client
    answer = ResultInfo(text="a", model="m", prompt_tokens=1, completion_tokens=1)
    for forgot in (False, True):
        if forgot:
            client.script_flush()
        jobs = [_new_job(store), _new_job(store)]
        store.consumers.hold("c1", jobs)
        before = store.stats.counters()["drained"].get("infer", 0.0)
        also = [
            functools.partial(store.stats.queue_batch, queue="infer", size=2, busy_s=0.5, gap_s=None),
            functools.partial(store.consumers.queue_release, consumer="c1", job_ids=jobs),
        ]
        endings = [Ending(j, "t", "succeeded", result=answer) for j in jobs]
        assert store.jobs.finish_many(endings, also=also) == [True, True]
        assert [job.status if job else None for job in map(store.jobs.load_job, jobs)] == ["succeeded"] * 2
        assert store.stats.counters()["drained"]["infer"] == before + 2
        assert not client.smembers(consumer_jobs_key("c1"))
