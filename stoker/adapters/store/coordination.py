"""Coordination between workers: how often a task message was delivered, exclusive leases, and the hold on
hand-offs to a full inference queue."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis

from stoker.adapters.store.clients import store_client
from stoker.adapters.store.keys import HANDOFF_HOLD_KEY, deliveries_key
from stoker.settings import CommonSettings

# Take or renew a lease held under a token.
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# Give a lease up, only if this token holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# The hand-off hold's holders: each by its expiry in the server's own clock (milliseconds), so that the hosts'
# clocks never disagree about it. A hold (ARGV[1] the holder, ARGV[2] its TTL) adds or renews one, and keeps the
# key at least as long; a look drops the lapsed (a holder that died) and counts the rest.
_SERVER_MS = """
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
"""
_HOLD = (
    _SERVER_MS
    + """
redis.call('ZADD', KEYS[1], ms + ARGV[2], ARGV[1])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""
)
_HOLDERS = (
    _SERVER_MS
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
return redis.call('ZCARD', KEYS[1])
"""
)


class DeliveryCounter:
    """Deliveries per task message, so a message that keeps killing its worker is given up (poison messages)."""

    def __init__(self, client: redis.Redis[bytes], *, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s

    def count_delivery(self, task_id: str) -> int:
        """Count one more delivery of a task message; returns how many there have been."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(deliveries_key(task_id))
            pipe.expire(deliveries_key(task_id), self.ttl_s)
            count, _ = pipe.execute()
        return int(count)


class Leases:
    """Exclusive, expiring leases held under a token (the one acting reaper)."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._lease = client.register_script(_LEASE)
        self._release = client.register_script(_RELEASE)

    def take_lease(self, key: str, token: str, ttl_s: float) -> bool:
        """Take or renew an exclusive lease; False while someone else holds it."""
        return bool(self._lease(keys=[key], args=[token, int(ttl_s * 1000)]))

    def release_lease(self, key: str, token: str) -> bool:
        """Give up a lease this token holds (a clean stop: the next holder need not wait for it to lapse)."""
        return bool(self._release(keys=[key], args=[token]))


class HandoffHold:
    """Whether interactive jobs are being held for the inference queue's watermarks, for every producer to see.

    A hand-off that finds the queue above its high watermark holds its job until the queue drains to its low one.
    Without a shared hold, every later producer (the API's own hand-off, another tokenize) that finds the queue
    between the two goes straight in, and under sustained load the queue never reaches the low watermark: the held
    job waits out its whole wait limit while later ones overtake it. So each holder is registered here (renewed at
    each look, lapsing on its own `ttl_s` after it stops looking: a killed holder cannot wedge it), and while any
    is, every producer waits for the low watermark too. The first held job to go in leaves the others registered:
    a producer never finds the hold lifted while older jobs still wait for it.
    """

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._hold = client.register_script(_HOLD)
        self._holders = client.register_script(_HOLDERS)

    def hold(self, holder: str, ttl_s: float) -> None:
        """This job is held now (register or renew it)."""
        self._hold(keys=[HANDOFF_HOLD_KEY], args=[holder, max(int(ttl_s * 1000), 1)])

    def release(self, holder: str) -> None:
        """This job is held no more: it went in, or gave up waiting."""
        self.redis.zrem(HANDOFF_HOLD_KEY, holder)

    def held(self) -> bool:
        """Whether some job is held now."""
        return bool(self._holders(keys=[HANDOFF_HOLD_KEY]))

    def held_at(self, depth: int, low: int) -> bool:
        """Whether jobs are held, as a producer that found the inference queue at `depth` needs to know: at or
        below the low watermark nobody waits, so the store is not asked (the common case costs no round trip)."""
        return depth > low and self.held()


def give_up_lease(settings: CommonSettings, key: str, token: str) -> bool:
    """A stopping process's goodbye: its lease released on a client of its own that tries once (the store may be
    gone already, as when the stack stops together), so the stop never waits on retries. False if not released."""
    with contextlib.suppress(redis.RedisError, OSError), store_client(settings, retries=0) as client:
        return Leases(client).release_lease(key, token)
    return False


class DeviceTurns:
    """Turns on one device shared by several processes (the benchmark's sync-pool baseline on one simulated
    device): redis-py's lock, which expires, so a holder that dies stops the others for at most `hold_s`; its
    waiters are woken by the holder's release instead of polling the lock. redis-py's blocking acquire retries every
    `sleep` seconds: at 5 ms, three processes waiting for one device spent more CPU polling than on their jobs
    (docs/bench/log/2026-12-02-device-bound-mix.md). A waiter whose wake-up went to another tries again within
    `recheck_s` anyway."""

    def __init__(self, client: redis.Redis[bytes], key: str, hold_s: float, recheck_s: float = 0.25) -> None:
        self.client = client
        self.key = key
        self.freed_key = f"{key}:freed"
        self.hold_s = hold_s
        self.recheck_s = recheck_s

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for the device, hold it for the block, wake one waiter after."""
        lock = self.client.lock(self.key, timeout=self.hold_s, thread_local=False)
        while not lock.acquire(blocking=False):
            self.client.blpop([self.freed_key], timeout=self.recheck_s)
        try:
            yield
        finally:
            lock.release()
            with self.client.pipeline(transaction=True) as pipe:  # one wake-up waiting at most
                pipe.lpush(self.freed_key, 1)
                pipe.ltrim(self.freed_key, 0, 0)
                pipe.expire(self.freed_key, max(int(self.hold_s), 1))
                pipe.execute()
