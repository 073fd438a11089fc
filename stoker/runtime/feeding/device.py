"""The device thread: it starts the prepared batch the moment the previous one returns, and does nothing but run the
model."""

from __future__ import annotations

from stoker.runtime.batches import BatchItem, RanBatch, run_batch, settle
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeding.cancellations import Cancellations
from stoker.runtime.feeding.errands import DeviceTurn, Errands
from stoker.runtime.feeding.held import Held
from stoker.runtime.feeding.writer import Writer
from stoker.runtime.watchdog import BatchWatchdog


class Device:
    """Runs prepared batches back to back; answers under way go first in the next, the rest to the writer."""

    def __init__(
        self,
        ctx: WorkerContext,
        watchdog: BatchWatchdog,
        held: Held,
        cancellations: Cancellations,
        errands: Errands,
        writer: Writer,
    ) -> None:
        self.ctx = ctx
        self.watchdog = watchdog
        self.held = held
        self.cancellations = cancellations
        self.errands = errands
        self.writer = writer

    def step(self) -> None:
        """Run the next batch and hand it to the writer."""
        items, gap, turn = self.next_batch()
        if not items:
            return
        going_on: list[BatchItem] = []
        try:
            ran: RanBatch | None
            ran, going_on = settle(run_batch(self.ctx, items, self.watchdog, gap))
            failure: BaseException | None = None
        except Exception as exc:  # not the model's per-item failures (those are outcomes): a broken batch
            ran, failure = None, exc
        turn.end()
        self.held.ran(going_on)
        if ran is None or ran.items:
            self.writer.put(ran, ran.items if ran is not None else items, failure)
        self.held.off_device()

    def next_batch(self) -> tuple[list[BatchItem], float | None, DeviceTurn]:
        """Wait for a prepared batch and its start time; take it (its jobs cancelled or past their deadline meanwhile
        go to the errands). The idle gap counts only if work waited."""
        taken = self.held.take_batch(self.cancellations.among)
        if taken is None:
            return [], None, DeviceTurn()
        turn = self.errands.started(taken.items, taken.at, taken.late, taken.dropped)
        return taken.items, taken.gap, turn
