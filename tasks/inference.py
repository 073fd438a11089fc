"""The inference queue's receiver: the `stoker.infer` task, whose messages go straight to the inference consumer.

On a Redis broker the consumer reads the queue itself (`stoker.adapters.redis_intake.RedisIntake`, many messages per
round trip) and Celery's consumer leaves it alone (`tasks.lifecycle`); on RabbitMQ, Celery's consumer receives them
here.

How batches are formed and kept flowing so the device never waits is `stoker.runtime.feeder`; how a batch is
loaded, run and written is `stoker.runtime.batches`; `tasks.lifecycle` starts the consumer and its watchdog.
"""

from __future__ import annotations

from celery_batches import Batches, SimpleRequest

from stoker.runtime.feeder import take_arrived
from tasks.lifecycle import feeder
from tasks.worker import app


class Feed(Batches):  # type: ignore[misc]
    """celery-batches as the inference queue's receiver: every message goes to the feeder the moment it arrives
    (flush_every=1), so arrival wakes the consumer; no polling tick stands between a job and the device."""

    abstract = True

    def _do_flush(self) -> None:
        arrived = take_arrived(self._buffer, self._buffer.qsize())
        if arrived:
            feeder().add(arrived)


# flush_every=1 flushes on every arrival; the interval's timer is only celery-batches' fallback, so it ticks rarely.
@app.task(base=Feed, name="stoker.infer", flush_every=1, flush_interval=10.0, acks_late=True, ignore_result=True)
def infer(requests: list[SimpleRequest]) -> None:
    """Never called: the feeder runs the batches (`Feed._do_flush` hands every message to it)."""
    raise RuntimeError("stoker.infer messages are served by the feeder")
