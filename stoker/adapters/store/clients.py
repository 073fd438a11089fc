"""The one place Redis clients are made, sync and async, from a process's settings.

Timeouts, retries and TLS (`CommonSettings.redis_tls`) are decided here, so no client of stoker's connects without
them: workers ride out a Redis restart (many retries, backoff capped at 1 s), the API learns of an outage in time
to answer 503, and the cache gives up fast (a cache that does not answer is a miss, never a wait).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from stoker.settings import CommonSettings

#: Seconds to connect to the job store at most (the read timeout is `store_timeout_s`).
STORE_CONNECT_TIMEOUT_S = 2.0
#: The cache is never worth waiting for.
CACHE_CONNECT_TIMEOUT_S = 1.0
CACHE_READ_TIMEOUT_S = 2.0
#: Bytes the cache client reads from its socket at a time (`cache_client`).
CACHE_READ_BYTES = 1 << 20
#: Connections at most of each of an API process's asyncio clients for requests' calls (`async_request_client`).
REQUEST_CONNECTIONS = 40


def store_client(settings: CommonSettings, *, retries: int = 1) -> redis.Redis[bytes]:
    """A client of the job store; each command rides out a broken connection `retries` times."""
    return redis.Redis.from_url(
        settings.result_url,
        socket_connect_timeout=min(STORE_CONNECT_TIMEOUT_S, settings.store_timeout_s),
        socket_timeout=settings.store_timeout_s,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **settings.redis_tls(settings.result_url),
    )


def async_store_client(settings: CommonSettings) -> aioredis.Redis[bytes]:
    """An asyncio client of the job store (the API's long-polls listen on it)."""
    return aioredis.Redis.from_url(
        settings.result_url,
        socket_connect_timeout=STORE_CONNECT_TIMEOUT_S,
        **settings.redis_tls(settings.result_url),
    )


def async_request_client(settings: CommonSettings) -> aioredis.Redis[bytes]:
    """An asyncio client of the job store for the calls a request makes on the API's loop: the same timeouts and
    one retry as `store_client`'s, so a store that is away is answered 503 in time. At most
    `REQUEST_CONNECTIONS` connections: a request past them waits for one (up to the store's timeout) instead of
    failing, as 150 long-polls beginning at once would otherwise (the synchronous reads were bounded by the thread
    pool's 40 threads)."""
    return _bounded(
        settings,
        settings.result_url,
        settings.store_timeout_s,
        min(STORE_CONNECT_TIMEOUT_S, settings.store_timeout_s),
        retry=AsyncRetry(ExponentialBackoff(cap=1.0, base=0.05), 1),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def async_broker_client(settings: CommonSettings) -> aioredis.Redis[bytes] | None:
    """An asyncio client of the broker's Redis, for the API's pushes of prepared messages on its loop
    (`tasks.publish.DirectPublisher.send_on`), bounded as the store's; None for a broker it cannot reach so
    (RabbitMQ, Sentinel, a Unix socket URL of kombu's own spelling): those publish from the thread pool."""
    url = settings.broker_url
    if not url.startswith(("redis://", "rediss://")):
        return None
    return _bounded(settings, url, settings.store_timeout_s, settings.store_timeout_s)


def cache_client(settings: CommonSettings) -> redis.Redis[bytes] | None:
    """A client of the stage cache; None when caching is off. It reads from its socket a MiB at a time (redis-py's
    default is 64 KiB): a picture's tensors are megabytes, which its reply parser otherwise gathers in a hundred
    pieces (an 8 MB read: 9 CPU ms against 6)."""
    if not settings.cache_enabled:
        return None
    return redis.Redis.from_url(
        settings.cache_url,
        socket_connect_timeout=CACHE_CONNECT_TIMEOUT_S,
        socket_timeout=CACHE_READ_TIMEOUT_S,
        **settings.redis_tls(settings.cache_url) | {"socket_read_size": CACHE_READ_BYTES},
    )


def async_cache_client(settings: CommonSettings) -> aioredis.Redis[bytes] | None:
    """An asyncio client of the stage cache for the API's lookups on its loop, with `cache_client`'s timeouts and
    bounded as the store's request client; None when caching is off."""
    if not settings.cache_enabled:
        return None
    return _bounded(settings, settings.cache_url, CACHE_READ_TIMEOUT_S, CACHE_CONNECT_TIMEOUT_S)


def _bounded(
    settings: CommonSettings, url: str, timeout_s: float, connect_s: float, **options: Any
) -> aioredis.Redis[bytes]:
    """An asyncio client of `url` over at most `REQUEST_CONNECTIONS` connections: a call past them waits for one
    (up to `timeout_s`, also its read timeout) instead of failing."""
    pool: aioredis.BlockingConnectionPool[aioredis.Connection] = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=REQUEST_CONNECTIONS,
        timeout=timeout_s,
        socket_connect_timeout=connect_s,
        socket_timeout=timeout_s,
        **options,
        **settings.redis_tls(url),
    )
    return aioredis.Redis(connection_pool=pool)


def redis_answers(url: str, timeout: float = 1.0, tls: Mapping[str, Any] | None = None) -> bool:
    """Whether a Redis server answers PING at url (`tls`: the options of a `rediss://` url)."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout, **(tls or {}))
        with client:
            return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


#: What a store at its `maxmemory` answers a write with (noeviction); redis-py's type stubs predate it.
StoreOutOfMemory: type[redis.RedisError] = redis.exceptions.OutOfMemoryError  # type: ignore[attr-defined]
