"""The collector: it takes what waits into the next batch (arrival order; size and token budget; deadlines dropped)
and loads its requests, one pipelined round trip per top-up, while the device runs the batch before. It names the
jobs that arrived in the round trip that loads their batch, or on their own while no batch can take them."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from stoker.runtime.batches import BatchItem, expire, load_batch
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeding.held import Held
from stoker.runtime.feeding.messages import job_of
from stoker.runtime.feeding.registry import Registry
from stoker.runtime.seams import Message

log = logging.getLogger(__name__)


class Collector:
    """Tops the prepared batch up from the requests that wait."""

    def __init__(self, ctx: WorkerContext, held: Held, registry: Registry) -> None:
        self.ctx = ctx
        self.held = held
        self.registry = registry

    def step(self) -> None:
        """One top-up: what joins the prepared batch is loaded (arrivals named as held in the same round trip), what
        expired is ended; arrivals no batch can take now are named as held on their own, loaded later."""
        top_up = self.held.take_top_up()
        if top_up is None:
            return
        if top_up.plan is None:
            self.registry.hold(top_up.unheld)
            return
        for message in top_up.expired:
            expire(self.ctx, job_of(message), time.time())
            self.registry.done_with(message)
        arrived = {w.key: w.arrived for w in top_up.plan.run}
        loaded = self._load(top_up.take, top_up.unheld)
        self.held.prepare([replace(item, arrived=arrived[item.message.id]) for item in loaded if item.message])

    def _load(self, messages: list[Message], unheld: list[str]) -> list[BatchItem]:
        """The messages' jobs, loaded in one round trip that also names `unheld` as held; messages with nothing
        left to do are done with."""
        by_job = {job_of(m): m for m in messages}
        also = [self.registry.queue_hold(unheld)] if unheld else []
        try:
            loaded = {item.job_id: item for item in load_batch(self.ctx, list(by_job), also)}
        except Exception:
            log.exception("could not load %d inference requests; handing them back", len(messages))
            for message in messages:
                message.reject(requeue=True)
            self.held.unheld_again([j for j in unheld if j not in by_job])  # named by the next round
            time.sleep(1.0)  # the store is away: do not spin on it
            return []
        for message in messages:
            if by_job.get(job_of(message)) is not message or job_of(message) not in loaded:
                self.registry.done_with(message)  # a duplicate, or a job that ended or expired
        return [replace(item, message=by_job[job_id]) for job_id, item in loaded.items()]
