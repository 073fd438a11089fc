"""The stage cache against real Redis: the pipeline identity the API reads per submission, what a miss writes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from stoker.adapters.cache import CONTEXT_REUSE_S, COST_FIELD, StageCache
from stoker.adapters.store.keys import CACHE_STATS_KEY, PIPELINE_IDENTITY_KEY
from stoker.core.cachekeys import CacheAddress, PipelineContext
from workers.broker import start_embedded
from workers.procs import stop


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def cache_redis() -> Iterator[redis.Redis]:
    """A Valkey of this module's own: the tests here publish pipeline identities, which the session's stacks, on
    the suite's cache database, would otherwise read."""
    valkey, port = start_embedded(persist=False)
    client = redis.Redis(port=port)
    try:
        yield client
    finally:
        client.close()
        stop(valkey)


def test_the_pipeline_identity_is_read_once_a_second_and_a_missing_one_every_time(cache_redis: redis.Redis) -> None:
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


def test_a_miss_is_cached_with_its_cost_and_counted_and_one_over_the_cap_only_counted(cache_redis: redis.Redis) -> None:
    cache = StageCache(cache_redis, ttl_s=60, max_value_bytes=200)
    stage = f"test-{uuid.uuid4().hex[:8]}"
    small = CacheAddress(stage, "1", uuid.uuid4().hex, "f", "s")
    large = CacheAddress(stage, "1", uuid.uuid4().hex, "f", "s")

    assert cache.put_miss(small, {"text": "short"}, 0.25)
    assert not cache.put_miss(large, {"text": "x" * 500}, 0.5)  # over the cap: not kept, counted as oversize

    assert cache.get_json(small) == {"text": "short", COST_FIELD: 0.25}
    assert cache.get_json(large) is None
    assert cache.stats()[stage] == {"misses": 2, "spent_s": 0.75, "oversize": 1}


def test_deferred_counts_are_kept_until_written_in_one_round_trip(cache_redis: redis.Redis) -> None:
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
