"""Deployment-wide counters: messages drained and jobs refused per queue, jobs per status, device time."""

from __future__ import annotations

import time

import redis

from stoker.adapters.store.keys import (
    CPU_KEY,
    DEVICE_GAPS_KEY,
    DEVICE_KEY,
    DRAINED_KEY,
    JOB_COUNTS_KEY,
    REFUSED_KEY,
)

#: Idle gaps kept for `/v1/stats` percentiles.
GAPS_KEPT = 1000


class StatsRepository:
    """Counters every process adds to and the API reads (drain rates, `/v1/stats`, Prometheus)."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client

    def count_drained(self, queue: str, n: int = 1) -> None:
        """n more messages taken off a queue and done with: the drain rate is measured from this counter."""
        self.redis.hincrby(DRAINED_KEY, queue, n)

    def drained(self) -> dict[str, int]:
        """How many messages each queue has drained, ever."""
        return {k.decode(): int(v) for k, v in self.redis.hgetall(DRAINED_KEY).items()}

    def job_counts(self) -> dict[str, int]:
        """Jobs accepted, and finished per terminal status, ever."""
        return {k.decode(): int(v) for k, v in self.redis.hgetall(JOB_COUNTS_KEY).items()}

    def count_refusal(self, queue: str) -> None:
        """One more job refused (429) because of this queue."""
        self.redis.hincrby(REFUSED_KEY, queue, 1)

    def counters(self) -> dict[str, dict[str, float]]:
        """Operator counters: messages drained and jobs refused per queue, device seconds busy."""
        refused = {k.decode(): float(v) for k, v in self.redis.hgetall(REFUSED_KEY).items()}
        device = {k.decode(): float(v) for k, v in self.redis.hgetall(DEVICE_KEY).items()}
        running_since = device.pop("running_since", None)
        if running_since is not None:  # the batch on the device now counts up to now
            device["busy_s"] = device.get("busy_s", 0.0) + max(time.time() - running_since, 0.0)
        drained = {k: float(v) for k, v in self.drained().items()}
        return {"drained": drained, "refused": refused, "device": device, "cpu_s": self.cpu_time()}

    def queue_batch(
        self, pipe: redis.Redis[bytes], queue: str, size: int, busy_s: float, gap_s: float | None, calls: int = 1
    ) -> None:
        """One batch done, queued onto `pipe` (the consumer sends it with the batch's endings): its messages
        drained, the device's busy seconds and backend calls, and the device's idle gap before it (when work was
        waiting), kept among the most recent `GAPS_KEPT`."""
        pipe.hincrby(DRAINED_KEY, queue, size)
        pipe.hincrbyfloat(DEVICE_KEY, "busy_s", busy_s)
        pipe.hdel(DEVICE_KEY, "running_since")
        pipe.hincrby(DEVICE_KEY, "batches", 1)
        pipe.hincrby(DEVICE_KEY, "calls", calls)
        pipe.hincrby(DEVICE_KEY, "items", size)
        if gap_s is not None:
            pipe.lpush(DEVICE_GAPS_KEY, repr(gap_s))
            pipe.ltrim(DEVICE_GAPS_KEY, 0, GAPS_KEPT - 1)

    def queue_device_started(self, pipe: redis.Redis[bytes], at: float) -> None:
        """A batch went onto the device at `at`, queued onto `pipe` (the consumer sends it with the batch's start
        stamps): until the batch is recorded, readers count its time so far as busy."""
        pipe.hset(DEVICE_KEY, "running_since", repr(at))

    def device_gaps(self) -> list[float]:
        """The device's most recent idle gaps between batches while work waited, in seconds."""
        return [float(raw) for raw in self.redis.lrange(DEVICE_GAPS_KEY, 0, -1)]

    def add_cpu_time(self, kind: str, seconds: float) -> None:
        """CPU seconds a worker process of this kind spent (its own accounting: user + system, children included)."""
        self.redis.hincrbyfloat(CPU_KEY, kind, seconds)

    def cpu_time(self) -> dict[str, float]:
        """CPU seconds per worker kind, ever."""
        return {k.decode(): float(v) for k, v in self.redis.hgetall(CPU_KEY).items()}

    def add_device_time(self, busy_s: float) -> None:
        """Seconds the inference device spent on batches."""
        self.redis.hincrbyfloat(DEVICE_KEY, "busy_s", busy_s)
