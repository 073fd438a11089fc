"""Deployment-wide counters: messages drained and jobs refused per queue, jobs per status, device time."""

from __future__ import annotations

import redis

from stoker.adapters.store.keys import DEVICE_KEY, DRAINED_KEY, JOB_COUNTS_KEY, REFUSED_KEY


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
        drained = {k: float(v) for k, v in self.drained().items()}
        return {"drained": drained, "refused": refused, "device": device}

    def add_device_time(self, busy_s: float) -> None:
        """Seconds the inference device spent on batches."""
        self.redis.hincrbyfloat(DEVICE_KEY, "busy_s", busy_s)
