"""The stage cache against real Redis: the pipeline identity the API reads per submission, what a miss writes."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from stoker.adapters.cache import CONTEXT_REUSE_S, COST_FIELD, LARGE_VALUE_BYTES, LoopCache, StageCache
from stoker.adapters.store.keys import CACHE_STATS_KEY, PIPELINE_IDENTITY_KEY, cache_key
from stoker.core.cachekeys import CacheAddress, PipelineContext
from stoker.core.jobs import InputRecord
from workers.broker import start_embedded
from workers.procs import stop


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def cache_redis() -> Iterator[redis.Redis[bytes]]:
    """A Valkey of this module's own: the tests here publish pipeline identities, which the session's stacks, on
    the suite's cache database, would otherwise read."""
    valkey, port = start_embedded(persist=False)
    client = redis.Redis(port=port)
    try:
        yield client
    finally:
        client.close()
        stop(valkey)


def test_the_pipeline_identity_is_read_once_a_second_and_a_missing_one_every_time(
    cache_redis: redis.Redis[bytes],
) -> None:
    clock = Clock()
    cache = StageCache(cache_redis, ttl_s=60, max_value_bytes=1 << 20, clock=clock)
    cache_redis.delete(PIPELINE_IDENTITY_KEY)
    assert cache.context() is None
    first = PipelineContext(identity=uuid.uuid4().hex, tokenizer="t", budget=100)
    cache.publish_context(first)
    assert cache.context() == first  # none was reused: the first job after the workers publish finds it

    second = PipelineContext(identity=uuid.uuid4().hex, tokenizer="t", budget=100)
    cache.publish_context(second)  # another version of the workers started
    clock.now += CONTEXT_REUSE_S / 2
    assert cache.context() == first  # reused: no read
    clock.now += CONTEXT_REUSE_S
    assert cache.context() == second


def test_a_pipeline_identity_from_newer_workers_is_read_without_what_it_adds(
    cache_redis: redis.Redis[bytes],
) -> None:
    # In a rolling restart, workers of the next version may publish a field this API does not know.
    published = {"identity": "i", "tokenizer": "t", "budget": 100, "render_decode": "d", "later": [1, 2]}
    cache_redis.set(PIPELINE_IDENTITY_KEY, json.dumps(published))
    found = StageCache(cache_redis, ttl_s=60, max_value_bytes=1 << 20, clock=Clock()).context()
    assert found == PipelineContext(identity="i", tokenizer="t", budget=100, render_decode="d")


@pytest.mark.parametrize("on_loop", [False, True], ids=["sync", "loop"])
def test_a_miss_is_cached_with_its_cost_and_counted_and_one_over_the_cap_only_counted(
    cache_redis: redis.Redis[bytes], on_loop: bool
) -> None:
    cache = StageCache(cache_redis, ttl_s=60, max_value_bytes=200)
    stage = f"test-{uuid.uuid4().hex[:8]}"
    small = CacheAddress(stage, "1", uuid.uuid4().hex, "f", "s")
    large = CacheAddress(stage, "1", uuid.uuid4().hex, "f", "s")

    if on_loop:  # the API's own, on its loop

        async def put(loop_cache: LoopCache) -> list[bool]:
            small_kept = await loop_cache.put_miss(small, {"text": "short"}, 0.25)
            return [small_kept, await loop_cache.put_miss(large, {"text": "x" * 500}, 0.5)]

        kept = _on_loop(cache_redis, put)
    else:
        kept = [cache.put_miss(small, {"text": "short"}, 0.25), cache.put_miss(large, {"text": "x" * 500}, 0.5)]
    assert kept == [True, False]  # over the cap: not kept, counted as oversize

    assert cache.get_json(small) == {"text": "short", COST_FIELD: 0.25}
    assert cache.get_json(large) is None
    assert cache.stats()[stage] == {"misses": 2, "spent_s": 0.75, "oversize": 1}


def _on_loop(client: redis.Redis[bytes], call: Callable[[LoopCache], Awaitable[Any]]) -> Any:
    """`call` with a `LoopCache` over the same Valkey, on a loop of its own."""

    async def run() -> Any:
        port = client.connection_pool.connection_kwargs["port"]
        cache = LoopCache(aioredis.Redis(port=port), ttl_s=60, max_value_bytes=200)
        try:
            return await call(cache)
        finally:
            await cache.aclose()

    return asyncio.run(run())


def test_a_jobs_inputs_are_found_whole_on_the_loop_as_in_a_thread_or_not_at_all(
    cache_redis: redis.Redis[bytes],
) -> None:
    # The API looks a job's inputs up on its loop (one round trip for them all): the records a worker cached,
    # each with its own index and counted as a hit; one missing, and none is found.
    cache = StageCache(cache_redis, ttl_s=60, max_value_bytes=1 << 20)
    identity, scope = uuid.uuid4().hex, "s"
    cached = [
        InputRecord(index=i, kind="image", content_hash=uuid.uuid4().hex, size_bytes=10, status="ok", text=f"page {i}")
        for i in range(2)
    ]
    cached[0].timings_ms = {"ocr": 12.0}
    for record in cached:
        cache.put_input(identity, record, scope)
    asked = [record.model_copy(update={"index": record.index + 5, "text": None}) for record in cached]
    missing = InputRecord(index=9, kind="image", content_hash=uuid.uuid4().hex, size_bytes=10)

    found = _on_loop(cache_redis, lambda c: c.get_inputs(identity, asked, scope))
    assert found == cache.get_inputs(identity, asked, scope)
    assert [(r.index, r.text, r.cache_hit) for r in found] == [(5, "page 0", {"ocr": True}), (6, "page 1", {})]
    assert _on_loop(cache_redis, lambda c: c.get_inputs(identity, [*asked, missing], scope)) is None
    assert _on_loop(cache_redis, lambda c: c.get_inputs(identity, [], scope)) == []


def test_deferred_counts_are_kept_until_written_in_one_round_trip(cache_redis: redis.Redis[bytes]) -> None:
    """The API keeps its cache counts in memory (a hit per cached submission) and writes them in one pipeline: the
    first count since a write is announced once, the write adds every count kept, and counts after it are
    announced again."""
    cache = StageCache(cache_redis, ttl_s=60, max_value_bytes=1 << 20)
    cache_redis.delete(CACHE_STATS_KEY)
    announced: list[int] = []
    cache.defer_counts(lambda: announced.append(1))
    cache.record("tokenize", hit=True, cost_s=0.25)
    cache.record("tokenize", hit=True, cost_s=0.5)
    cache.record("tokenize", hit=False, cost_s=1.0)
    assert len(announced) == 1
    assert cache.stats() == {}  # nothing written yet

    cache_redis.config_resetstat()
    cache.write_counts()
    reads = int(cache_redis.info("stats")["total_reads_processed"])
    assert reads == 2  # the counts' one pipeline, and this INFO
    assert cache.stats()["tokenize"] == {"hits": 2.0, "saved_s": 0.75, "misses": 1.0, "spent_s": 1.0}
    cache.write_counts()  # nothing kept: nothing written
    assert cache.stats()["tokenize"]["hits"] == 2.0

    cache.record("tokenize", hit=True, cost_s=0.25)
    assert len(announced) == 2
    cache.defer_counts(None)  # written at once again, with what was kept by the next write
    cache.record("ocr", hit=True, cost_s=2.0)
    assert cache.stats()["ocr"] == {"hits": 1.0, "saved_s": 2.0}
    cache.write_counts()
    assert cache.stats()["tokenize"]["hits"] == 3.0


def test_a_large_part_is_written_whole_with_its_ttl_and_a_refused_one_is_not_kept(
    cache_redis: redis.Redis[bytes],
) -> None:
    # A part of a MiB or more (a picture's tensors) goes to the socket as it is, around a head and a tail packed
    # by hand: the value read back is the one written, it expires as a small one does, and the connection it went
    # over is fit for the next command.
    cache = StageCache(cache_redis, ttl_s=60, max_value_bytes=1 << 20)
    address = CacheAddress(f"test-{uuid.uuid4().hex[:8]}", "1", uuid.uuid4().hex, "f", "s")
    value = os.urandom(LARGE_VALUE_BYTES * 3 + 7)
    assert cache.put_bytes(address, value, part="tensors", limit=len(value))
    assert cache.get_bytes(address, part="tensors") == value
    assert 0 < cache_redis.ttl(cache_key(address, "tensors")) <= 60
    # Refused by the server (out of memory: this Valkey refuses writes past its maxmemory): the write says so,
    # nothing is kept, and the next write over the same client succeeds.
    refused = CacheAddress(address.stage, "1", uuid.uuid4().hex, "f", "s")
    limit = cache_redis.config_get("maxmemory")["maxmemory"]
    cache_redis.config_set("maxmemory", str(int(cache_redis.info("memory")["used_memory"]) // 2))
    try:
        assert not cache.put_bytes(refused, value, part="tensors", limit=len(value))
    finally:
        cache_redis.config_set("maxmemory", limit)
    assert cache.get_bytes(refused, part="tensors") is None
    assert cache.put_bytes(refused, value[:LARGE_VALUE_BYTES], part="tensors", limit=len(value))
    assert cache.get_bytes(refused, part="tensors") == value[:LARGE_VALUE_BYTES]


def test_a_large_part_is_written_again_over_a_new_connection_when_the_server_dropped_the_old(
    cache_redis: redis.Redis[bytes],
) -> None:
    # The cache restarted (here: its clients' connections killed) between two writes: the next large write does not
    # go out over the dead pooled connection (the pool opens a new one, as for the client's own commands).
    port = cache_redis.connection_pool.connection_kwargs["port"]
    with redis.Redis(port=port) as client:
        cache = StageCache(client, ttl_s=60, max_value_bytes=1 << 20)
        first, second = (CacheAddress("test-drop", "1", uuid.uuid4().hex, "f", "s") for _ in range(2))
        value = os.urandom(LARGE_VALUE_BYTES + 1)
        assert cache.put_bytes(first, value, part="tensors", limit=len(value))
        assert cache_redis.client_kill_filter(skipme=True) >= 1
        assert cache.put_bytes(second, value, part="tensors", limit=len(value))
        assert cache.get_bytes(second, part="tensors") == value
