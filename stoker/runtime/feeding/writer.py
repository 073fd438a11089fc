"""The writer: each finished batch's results, stamps and counters, pipelined, then its acks; a batch that broke
outside the model fails its jobs at once (never silently acked)."""

from __future__ import annotations

import logging
from queue import Queue

from stoker.runtime.batches import BatchItem, RanBatch, fail_batch, write_batch
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeding.held import Held
from stoker.runtime.feeding.messages import hand_back
from stoker.runtime.feeding.registry import Registry

log = logging.getLogger(__name__)

#: A batch the device handed over: how it ran (None: it broke outside the model), its items, and what broke it.
Finished = tuple[RanBatch | None, list[BatchItem], BaseException | None]


class Writer:
    """Writes the batches the device hands over, one behind the device at most."""

    def __init__(self, ctx: WorkerContext, held: Held, registry: Registry) -> None:
        self.ctx = ctx
        self.held = held
        self.registry = registry
        self._finished: Queue[Finished] = Queue(maxsize=1)

    def put(self, ran: RanBatch | None, items: list[BatchItem], failure: BaseException | None) -> None:
        """A batch to write; waits only while the batch before is still being written."""
        self._finished.put((ran, items, failure))

    def step(self) -> None:
        """Write the next finished batch (its jobs let go of as it is written), then ack its messages; a batch that
        cannot be written goes back to the queue."""
        ran, items, failure = self._finished.get()
        self.held.writing(items)
        try:
            if ran is not None:
                write_batch(self.ctx, ran, self.registry.consumer)  # lets go of the batch's jobs as it writes them
            else:
                fail_batch(self.ctx, items, failure or RuntimeError("unknown"))
        except Exception:
            log.exception("batch of %d could not be written; its messages go back to the queue", len(items))
            hand_back(items)
        else:
            for item in items:
                if item.message is not None:
                    item.message.acknowledge()
            if ran is None:
                self.registry.release([i.job_id for i in items])
        self.held.writing([])
