"""Streamed answers: the pieces a streaming backend produced for a job, in order, for the API to pass on."""

from __future__ import annotations

import redis

from stoker.adapters.store.keys import answer_channel, answer_key

#: Pieces kept per answer at most (a runaway stream cannot grow a key without bound).
MAX_PIECES = 20_000


class AnswerStreams:
    """One Redis stream per streamed answer (`keys.answer_key`), announced piece by piece on its channel."""

    def __init__(self, client: redis.Redis[bytes], *, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s

    def append(self, job_id: str, piece: str) -> None:
        """Add one piece of the job's answer and announce it (one round trip)."""
        key = answer_key(job_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(key, {"t": piece}, maxlen=MAX_PIECES, approximate=True)
            pipe.expire(key, self.ttl_s)
            pipe.publish(answer_channel(job_id), "")
            pipe.execute()

    def read(self, job_id: str, after: str = "0-0") -> tuple[list[str], str]:
        """The pieces added after the entry `after`, and the id to read on from."""
        entries = self.redis.xrange(answer_key(job_id), min=f"({after}")
        pieces = [fields[b"t"].decode() for _, fields in entries]
        return pieces, (entries[-1][0].decode() if entries else after)
