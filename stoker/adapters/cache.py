"""The stage-result cache: content-addressed, fingerprinted, single-flight, and never a dependency.

Every call degrades to "miss" when the cache Redis misbehaves, so a flushed or unreachable cache costs work, not jobs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, fields
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.client import Pipeline

from stoker.adapters.metrics import CACHE_LOOKUPS
from stoker.adapters.store.clients import cache_client
from stoker.adapters.store.keys import CACHE_STATS_KEY, PIPELINE_IDENTITY_KEY, cache_key, cache_lease_key, cache_pattern
from stoker.core.cachekeys import CacheAddress, PipelineContext, fingerprint
from stoker.core.jobs import QUEUE_SUFFIX, InputRecord
from stoker.settings import CommonSettings

log = logging.getLogger(__name__)

#: How long a read pipeline identity is reused (`StageCache.context`), in seconds.
CONTEXT_REUSE_S = 1.0
#: Field in a cached value holding what computing it cost (its saving, when it is hit).
COST_FIELD = "_cost_s"
#: A value at least this long is written by `_set_large`.
LARGE_VALUE_BYTES = 256 * 1024


class StageCache:
    """Reads and writes stage results in the cache Redis, with hit/miss accounting."""

    def __init__(
        self,
        client: redis.Redis[bytes] | None,
        *,
        ttl_s: int,
        max_value_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self._clock = clock
        #: The pipeline identity last read, and until when it is reused (`context`).
        self._context: tuple[PipelineContext, float] | None = None
        #: Counts not written yet, by (stage, what): how many and their seconds (`defer_counts`).
        self._unwritten: dict[tuple[str, str], tuple[int, float]] = {}
        self._unwritten_lock = threading.Lock()
        self._on_first_unwritten: Callable[[], object] | None = None

    @classmethod
    def connect(cls, settings: CommonSettings) -> StageCache:
        """The cache at `settings.cache_url`; a disabled cache (`cache_enabled` false) misses every time."""
        return cls(cache_client(settings), ttl_s=settings.cache_ttl_s, max_value_bytes=settings.cache_max_value_bytes)

    @property
    def enabled(self) -> bool:
        """Whether results are kept at all (`cache_enabled`)."""
        return self.redis is not None

    def get_json(self, address: CacheAddress) -> dict[str, Any] | None:
        """A cached JSON result, or None."""
        raw = self.get_bytes(address)
        return dict(json.loads(raw)) if raw is not None else None

    def get_bytes(self, address: CacheAddress, part: str = "value") -> bytes | None:
        """A cached binary part, or None (also when the cache is unreachable)."""
        if self.redis is None:
            return None
        try:
            value = self.redis.get(cache_key(address, part))
        except redis.RedisError as exc:
            log.warning("cache read failed, treating as a miss: %s", exc)
            return None
        return bytes(value) if value is not None else None

    def has(self, address: CacheAddress, part: str = "value") -> bool:
        """Whether a part is cached, without reading it (False also when the cache is unreachable)."""
        return self.has_all([address], part)

    def has_all(self, addresses: Sequence[CacheAddress], part: str = "value") -> bool:
        """Whether a part is cached for every address, in one round trip, without reading them (False also when
        the cache is unreachable)."""
        if self.redis is None:
            return False
        keys = {cache_key(address, part) for address in addresses}
        try:
            return int(self.redis.exists(*keys)) == len(keys)
        except redis.RedisError as exc:
            log.warning("cache read failed, treating as a miss: %s", exc)
            return False

    def put_json(self, address: CacheAddress, value: dict[str, Any]) -> bool:
        """Cache a JSON result; False when it is over the size cap or the cache is unavailable."""
        return self.put_bytes(address, json.dumps(value).encode())

    def put_bytes(self, address: CacheAddress, data: bytes, part: str = "value", limit: int | None = None) -> bool:
        """Cache one binary part (refused over `limit`, `max_value_bytes` unless given)."""
        if self.redis is None:
            return False
        if len(data) > (limit or self.max_value_bytes):
            self._count(address.stage, "oversize")
            return False
        try:
            if len(data) >= LARGE_VALUE_BYTES:
                _set_large(self.redis, cache_key(address, part), data, self.ttl_s)
            else:
                self.redis.set(cache_key(address, part), data, ex=self.ttl_s)
        except redis.RedisError as exc:
            log.warning("cache write failed: %s", exc)
            return False
        return True

    def put_miss(self, address: CacheAddress, value: dict[str, Any], cost_s: float) -> bool:
        """Cache a result just computed after a miss (with what it cost) and count the miss, in one round trip;
        False when it is over the size cap (counted as oversize too) or the cache is unavailable."""
        CACHE_LOOKUPS.labels(address.stage, "miss").inc()
        if self.redis is None:
            return False
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                kept = _queue_miss(pipe, address, value, cost_s, self.ttl_s, self.max_value_bytes)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("cache write failed: %s", exc)
            return False
        return kept

    def record(self, stage: str, hit: bool, cost_s: float) -> None:
        """Count a hit (with the seconds it saved) or a miss (with the seconds it cost): at once, or with the next
        `write_counts` once `defer_counts` was called."""
        CACHE_LOOKUPS.labels(stage, "hit" if hit else "miss").inc()
        what = "hits" if hit else "misses"
        if self._on_first_unwritten is None:
            self._count(stage, what, cost_s)
            return
        with self._unwritten_lock:
            first = not self._unwritten
            count, seconds = self._unwritten.get((stage, what), (0, 0.0))
            self._unwritten[(stage, what)] = (count + 1, seconds + cost_s)
        if first:
            self._on_first_unwritten()

    def defer_counts(self, on_first: Callable[[], object] | None) -> None:
        """From now on `record` keeps its counts in memory until `write_counts` writes them all in one round trip
        (a process that counts a hit per request, the API, then pays no round trip per request for it);
        `on_first` is called, from the recording thread, when the first count since the last write arrives.
        None: counts are written at once again."""
        self._on_first_unwritten = on_first

    def write_counts(self) -> None:
        """Write the counts `record` kept since the last write (`defer_counts`), in one pipeline; lost if the cache
        cannot be reached, as counts written at once would be."""
        with self._unwritten_lock:
            unwritten, self._unwritten = self._unwritten, {}
        if not unwritten or self.redis is None:
            return
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                for (stage, what), (count, seconds) in unwritten.items():
                    _queue_count(pipe, stage, what, seconds, count)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("cache accounting failed: %s", exc)

    def _count(self, stage: str, what: str, seconds: float | None = None) -> None:
        if self.redis is None:
            return
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                _queue_count(pipe, stage, what, seconds)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("cache accounting failed: %s", exc)

    @contextlib.contextmanager
    def single_flight(self, address: CacheAddress, lease_s: float, wait_s: float) -> Iterator[dict[str, Any] | None]:
        """Yield a result another worker just computed, or None when this caller should compute it.

        One caller holds the lease and computes; the others poll for its result. When the lease expires
        without a result (its holder died), the next poller takes over. A follower gives up after wait_s.
        The result is read again once the lease is won: a holder that cached it and let go between this caller's
        read and its lease left a free lease and a result, and computing again would be a second miss.
        """
        token = f"{os.getpid()}-{uuid.uuid4().hex}"  # the pid says which process holds it, for operators
        deadline = time.monotonic() + wait_s
        held, renewing = False, threading.Event()
        try:
            while True:
                found = self.get_json(address)
                if found is None:
                    held = self._acquire(address, token, lease_s)
                    found = self.get_json(address) if held else None
                if found is not None:
                    yield found
                    return
                if held:
                    self._keep_alive(address, token, lease_s, renewing)
                if held or self.redis is None or time.monotonic() >= deadline:
                    yield None
                    return
                time.sleep(0.05)
        finally:
            renewing.set()
            if held:
                self._release(address, token)

    def _keep_alive(self, address: CacheAddress, token: str, lease_s: float, stop: threading.Event) -> None:
        """Renew a held lease until stop is set; a killed holder stops renewing and its lease lapses."""

        def renew() -> None:
            while not stop.wait(lease_s / 3):
                with contextlib.suppress(redis.RedisError):
                    if self.redis is not None and self.redis.get(cache_lease_key(address)) == token.encode():
                        self.redis.pexpire(cache_lease_key(address), int(lease_s * 1000))

        if self.redis is not None:
            threading.Thread(target=renew, name="stoker-lease", daemon=True).start()

    def _acquire(self, address: CacheAddress, token: str, lease_s: float) -> bool:
        if self.redis is None:
            return True
        try:
            return bool(self.redis.set(cache_lease_key(address), token, nx=True, px=int(lease_s * 1000)))
        except redis.RedisError:
            return True  # no cache: compute

    def _release(self, address: CacheAddress, token: str) -> None:
        if self.redis is None:
            return
        with contextlib.suppress(redis.RedisError):
            if self.redis.get(cache_lease_key(address)) == token.encode():
                self.redis.delete(cache_lease_key(address))

    # -- whole preprocessed inputs: what lets a fully cached job skip the CPU queues ------------------------------
    def publish_context(self, context: PipelineContext) -> None:
        """Record the workers' current preprocessing identity, for the API to address finished work by."""
        if self.redis is not None:
            with contextlib.suppress(redis.RedisError):
                self.redis.set(PIPELINE_IDENTITY_KEY, json.dumps(asdict(context)))

    def context_fresh(self) -> bool:
        """Whether `context` answers now without a read (the cache is off, or what it read is still reused)."""
        return self.redis is None or (self._context is not None and self._clock() < self._context[1])

    def context(self) -> PipelineContext | None:
        """What the workers last published, or None before any did.

        Read again at most every `CONTEXT_REUSE_S`: the API asks on every submission, and the identity changes
        only when workers of another version start (a fleet in a rolling restart publishes both in turn anyway).
        None is never reused: the first job after the workers publish already finds it."""
        if self.redis is None:
            return None
        now = self._clock()
        if self._context is not None and now < self._context[1]:
            return self._context[0]
        try:
            raw = self.redis.get(PIPELINE_IDENTITY_KEY)
        except redis.RedisError:
            return None
        if not raw:
            return None
        published = json.loads(raw)
        known = {f.name for f in fields(PipelineContext)}  # a newer worker's fields, in a rolling restart, left out
        found = PipelineContext(**{k: v for k, v in published.items() if k in known})
        self._context = (found, now + CONTEXT_REUSE_S)
        return found

    def put_input(self, identity: str, record: InputRecord, scope: str) -> None:
        """Cache a fully preprocessed input (text, features, segments, frames), minus per-job facts."""
        if record.status == "ok":
            self.put_json(_input_address(identity, record, scope), record.model_dump(mode="json"))

    def get_inputs(self, identity: str, records: list[InputRecord], scope: str) -> list[InputRecord] | None:
        """Every record filled from the cache, or None unless all of them are there."""
        filled = []
        for record in records:
            found = self.get_json(_input_address(identity, record, scope))
            if found is None:
                return None
            filled.append(_filled(record, found))
        return filled

    def stats(self) -> dict[str, dict[str, float]]:
        """Per-stage counters: hits, misses, oversize, saved_s, spent_s."""
        if self.redis is None:
            return {}
        out: dict[str, dict[str, float]] = {}
        for field, value in self.redis.hgetall(CACHE_STATS_KEY).items():
            stage, name = field.decode().split(":", 1)
            out.setdefault(stage, {})[name] = float(value)
        return out

    def clear(self, stage: str | None = None) -> int:
        """Delete cached results (of one stage, or all) and reset their counters; returns keys deleted."""
        if self.redis is None:
            return 0
        pattern = cache_pattern(stage)
        deleted = 0
        for key in self.redis.scan_iter(pattern, count=500):
            deleted += int(self.redis.delete(key))
        if stage:
            fields = [f for f in self.redis.hkeys(CACHE_STATS_KEY) if f.decode().startswith(f"{stage}:")]
            if fields:
                self.redis.hdel(CACHE_STATS_KEY, *fields)
        else:
            self.redis.delete(CACHE_STATS_KEY)
        return deleted


def _queue_count(pipe: Pipeline[bytes], stage: str, what: str, seconds: float | None = None, count: int = 1) -> None:
    """`count` more `what` (hits, misses, oversize) for a stage, with the seconds they saved or cost, into `pipe`."""
    pipe.hincrby(CACHE_STATS_KEY, f"{stage}:{what}", count)
    if seconds is not None:
        field = "saved_s" if what == "hits" else "spent_s"
        pipe.hincrbyfloat(CACHE_STATS_KEY, f"{stage}:{field}", seconds)


class LoopCache:
    """The stage cache's calls the API makes per request (a cached job's inputs and prompt, a prompt's miss), on
    its asyncio loop: `StageCache`'s, without the hop to a pool thread that cost the API about four times the
    call's CPU (`stoker.adapters.store.jobs.LoopJobs` says how that was measured). The same keys and values; a
    cache that misbehaves is a miss, as there."""

    def __init__(self, client: aioredis.Redis[bytes] | None, *, ttl_s: int, max_value_bytes: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes

    async def get_json(self, address: CacheAddress) -> dict[str, Any] | None:
        """`StageCache.get_json`, on the loop."""
        if self.redis is None:
            return None
        try:
            raw = await self.redis.get(cache_key(address, "value"))
        except redis.RedisError as exc:
            log.warning("cache read failed, treating as a miss: %s", exc)
            return None
        return dict(json.loads(raw)) if raw is not None else None

    async def get_inputs(self, identity: str, records: list[InputRecord], scope: str) -> list[InputRecord] | None:
        """`StageCache.get_inputs`, on the loop, in one round trip."""
        if self.redis is None or not records:
            return None if records else []
        keys = [cache_key(_input_address(identity, record, scope), "value") for record in records]
        try:
            found = await self.redis.mget(keys)
        except redis.RedisError as exc:
            log.warning("cache read failed, treating as a miss: %s", exc)
            return None
        values = [raw for raw in found if raw is not None]
        if len(values) < len(records):
            return None
        return [_filled(record, json.loads(raw)) for record, raw in zip(records, values, strict=True)]

    async def put_miss(self, address: CacheAddress, value: dict[str, Any], cost_s: float) -> bool:
        """`StageCache.put_miss`, on the loop."""
        CACHE_LOOKUPS.labels(address.stage, "miss").inc()
        if self.redis is None:
            return False
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                kept = _queue_miss(pipe, address, value, cost_s, self.ttl_s, self.max_value_bytes)  # type: ignore[arg-type]
                await pipe.execute()
        except redis.RedisError as exc:
            log.warning("cache write failed: %s", exc)
            return False
        return kept

    async def aclose(self) -> None:
        """Close the client's connections, and its pool."""
        if self.redis is not None:
            await self.redis.aclose(close_connection_pool=True)  # type: ignore[attr-defined]  # the stubs lag


def _queue_miss(
    pipe: Pipeline[bytes], address: CacheAddress, value: dict[str, Any], cost_s: float, ttl_s: int, max_bytes: int
) -> bool:
    """A result computed after a miss, into `pipe`: its value with what it cost (unless over `max_bytes`: counted
    as oversize instead), and the miss; whether the value is kept."""
    data = json.dumps({**value, COST_FIELD: cost_s}).encode()
    kept = len(data) <= max_bytes
    if kept:
        pipe.set(cache_key(address, "value"), data, ex=ttl_s)
    else:
        _queue_count(pipe, address.stage, "oversize")
    _queue_count(pipe, address.stage, "misses", cost_s)
    return kept


def _filled(record: InputRecord, found: dict[str, Any]) -> InputRecord:
    """A job's input record filled from its cached whole record (its own index kept)."""
    return _as_cached(InputRecord.model_validate(found)).model_copy(update={"index": record.index})


def _input_address(identity: str, record: InputRecord, scope: str) -> CacheAddress:
    return CacheAddress("input", "1", record.content_hash, fingerprint(identity=identity, kind=record.kind), scope)


def _as_cached(record: InputRecord) -> InputRecord:
    """A record reused whole: every stage it went through counts as a hit, and nothing ran for this job."""
    stages = sorted({*record.cache_hit, *(t for t in record.timings_ms if not t.endswith(QUEUE_SUFFIX))})
    frames = [_as_cached(f) for f in record.frames] if record.frames else record.frames
    return record.model_copy(update={"timings_ms": {}, "cache_hit": dict.fromkeys(stages, True), "frames": frames})


def _set_large(client: redis.Redis[bytes], key: str, data: bytes, ttl_s: int) -> None:
    """`SET key data EX ttl_s`, with `data` handed to the socket as it is. redis-py packs a command into one buffer
    (with hiredis, a copy of every argument): for a picture's 8 MB of tensors that copy costs more than the rest of
    the write (9 CPU ms against 3.5 here), so the command's head and tail are packed around the value instead, as
    redis-py's own connection sends a list of pieces (`send_packed_command`)."""
    name = key.encode()
    ttl = str(ttl_s).encode()
    head = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, len(data))
    tail = b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    pool = client.connection_pool
    connection = pool.get_connection()

    def send() -> object:
        connection.send_packed_command([head, data, tail])
        return connection.read_response()

    try:  # a connection lost mid-way: sent again over a new one, as the client's own commands are (its Retry)
        reply = connection.retry.call_with_retry(send, lambda _error: connection.disconnect())
    except redis.ResponseError:
        raise  # the server's refusal (out of memory, ...), read whole: the connection is fine
    except BaseException:
        connection.disconnect()  # a command or reply half through leaves the connection unusable
        raise
    finally:
        pool.release(connection)
    if reply not in (b"OK", "OK", True):
        raise redis.ResponseError(f"SET answered {reply!r}")
