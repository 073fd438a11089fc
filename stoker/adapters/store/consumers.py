"""Inference consumers' heartbeats: which jobs each one holds, so a consumer's death is known within seconds and
the jobs it held (a batch on the device included) are sent again instead of waiting for the reaper's timeouts."""

from __future__ import annotations

from collections.abc import Collection

import redis

from stoker.adapters.store.keys import CONSUMERS_KEY, consumer_alive_key, consumer_jobs_key

# The jobs a dead consumer held, taken once: whoever calls this second (another reaper) gets nothing.
_TAKE_LOST = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {} end
local jobs = redis.call('SMEMBERS', KEYS[2])
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
return jobs
"""


class ConsumerRegistry:
    """Live inference consumers and the jobs each holds."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._take_lost = client.register_script(_TAKE_LOST)

    def beat(self, consumer: str, ttl_s: float) -> None:
        """This consumer lives, for ttl_s more."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(CONSUMERS_KEY, consumer)
            pipe.set(consumer_alive_key(consumer), 1, px=int(ttl_s * 1000))
            pipe.execute()

    def hold(self, consumer: str, job_ids: Collection[str]) -> None:
        """This consumer now holds these jobs too (named as they arrive: on their own, or with a batch's load)."""
        self.queue_hold(self.redis, consumer, job_ids)

    def queue_hold(self, pipe: redis.Redis[bytes], consumer: str, job_ids: Collection[str]) -> None:
        """`hold` onto a client or pipeline (the consumer sends it with the load of the batch that takes them)."""
        if job_ids:
            pipe.sadd(consumer_jobs_key(consumer), *job_ids)

    def release(self, consumer: str, job_ids: Collection[str]) -> None:
        """This consumer is done with these jobs (ended, expired, or handed back)."""
        self.queue_release(self.redis, consumer, job_ids)

    def queue_release(self, pipe: redis.Redis[bytes], consumer: str, job_ids: Collection[str]) -> None:
        """`release` onto a client or pipeline (the consumer sends it with its batch's endings)."""
        if job_ids:
            pipe.srem(consumer_jobs_key(consumer), *job_ids)

    def leave(self, consumer: str) -> None:
        """A consumer stopping cleanly (it handed its messages back): forget it."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(consumer_alive_key(consumer), consumer_jobs_key(consumer))
            pipe.srem(CONSUMERS_KEY, consumer)
            pipe.execute()

    def take_lost(self) -> dict[str, list[str]]:
        """Consumers whose beat lapsed, each with the jobs it held; each lost consumer is reported once."""
        lost: dict[str, list[str]] = {}
        for raw in self.redis.smembers(CONSUMERS_KEY):
            consumer = raw.decode()
            keys = [consumer_alive_key(consumer), consumer_jobs_key(consumer), CONSUMERS_KEY]
            jobs = self._take_lost(keys=keys, args=[consumer])  # nothing while it lives; a dead one leaves the set
            if jobs:
                lost[consumer] = sorted(j.decode() for j in jobs)
        return lost
