"""The pipeline's inference consumer: work-conserving and double-buffered, so the device never waits on Redis.

On a Redis broker the **intake** thread takes interactive requests straight from their queue, as many as the
consumer has room for (the prefetch) per round trip (`stoker.adapters.redis_intake.RedisIntake`); on RabbitMQ
celery-batches hands each message over the moment it arrives (`tasks.inference.Feed`, flush_every=1: no polling
tick). Three threads do the rest:

- the **collector** takes what waits into the next batch (arrival order; size and token budget; deadlines dropped)
  and loads its requests, one pipelined round trip per top-up, while the device runs the batch before;
- the **device** thread starts the prepared batch the moment the previous one returns (with `STOKER_MAX_WAIT_MS`,
  once its first request has waited that long, or it is full) and does nothing but run the model;
- the **writer** writes each finished batch (results, stamps, counters, pipelined), ends its spans, logs its jobs
  and acks its messages; a batch that broke outside the model fails its jobs at once (never silently acked). A
  batch still running `STAMP_AFTER_S` after it started has its jobs' start stamped meanwhile (the errands thread);
  a shorter one's start is written with its results.

At most one batch is prepared ahead and one written behind: memory stays bounded by the prefetch. The consumer
beats while it lives and names the jobs it holds as they come and go, so when it dies the reaper sends them again
within seconds: the collector names the jobs that arrived in the round trip that loads their batch, or on their own
while no batch can take them (the device busy, the next batch full).

`Feeder` composes its collaborators (`stoker.runtime.feeding`), a thread's loop each: what it holds under the one
lock its threads share (`Held`), the `Collector`, the `Device`, the `Writer`, the `Errands`, the `IntakeTaker` and
`LineTaker`, the `Heartbeat`, the `Registry` of the jobs it holds and the `Cancellations` it hears.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from stoker.core.batching import BatchPolicy
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeding.cancellations import Cancellations
from stoker.runtime.feeding.collector import Collector
from stoker.runtime.feeding.device import Device
from stoker.runtime.feeding.errands import STAMP_AFTER_S, Errands
from stoker.runtime.feeding.heartbeat import Heartbeat
from stoker.runtime.feeding.held import Held
from stoker.runtime.feeding.intake import IntakeTaker
from stoker.runtime.feeding.lines import LineTaker
from stoker.runtime.feeding.messages import as_waiting, hand_back_messages, take_arrived
from stoker.runtime.feeding.registry import Registry
from stoker.runtime.feeding.writer import Writer
from stoker.runtime.seams import Intake, LineSource, Message
from stoker.runtime.watchdog import BatchWatchdog

__all__ = ["STAMP_AFTER_S", "Feeder", "as_waiting", "take_arrived"]

log = logging.getLogger(__name__)

#: How long after the last interactive request batch lines still run in small batches (`Held._line_bound`).
INTERACTIVE_QUIET_S = 2.0


class Feeder:
    """Collects arriving inference messages into batches and keeps the device running them back to back."""

    def __init__(
        self,
        ctx: WorkerContext,
        policy: BatchPolicy,
        watchdog: BatchWatchdog,
        beat_s: float = 1.0,
        lines: LineSource | None = None,
        interactive_quiet_s: float = INTERACTIVE_QUIET_S,
        intake: Intake | None = None,
    ) -> None:
        self.ctx = ctx
        self.policy = policy
        #: Where batch lines are taken from (their own queue), into room interactive requests leave.
        self.lines = lines
        #: Where interactive requests are taken from, up to the prefetch held at once (None: handed over by Celery).
        self.intake = intake
        self._stopping = threading.Event()
        settings = ctx.settings
        self.registry = Registry(ctx)
        self.consumer = self.registry.consumer
        line_batch = min(settings.line_batch_size, policy.max_batch_size)
        self.held = Held(policy, line_batch, interactive_quiet_s, self._stopping)
        self.heartbeat = Heartbeat(self.registry, beat_s, settings.idle_max_wait_s, self.held.holding)
        self.cancellations = Cancellations(ctx, self._stopping)
        self.errands = Errands(ctx, self.registry, self._stopping)
        self.writer = Writer(ctx, self.held, self.registry)
        self.device = Device(ctx, watchdog, self.held, self.cancellations, self.errands, self.writer)
        self.collector = Collector(ctx, self.held, self.registry)
        self.line_taker = (
            LineTaker(lines, self.held, self.add, settings.idle_max_wait_s, self._stopping) if lines else None
        )
        self.intake_taker = IntakeTaker(intake, settings.infer_prefetch, self.add, self._stopping) if intake else None

    def add(self, requests: Sequence[Message]) -> None:
        """Messages that just arrived (celery's consumer thread, or the takers'): they wait for the collector, which
        names them as held at once (with their batch's load when it can take them now: no round trip of their own
        on this thread)."""
        self.heartbeat.arrival()
        if not self.held.arrive(requests, time.time()):  # stopped: `give_back` has emptied what waits already
            hand_back_messages(requests)

    def start(self) -> None:
        """Start the collector, device, writer and heartbeat threads (and the batch lines' taker, with lines)."""
        loops = [
            ("collector", self.collector.step),
            ("device", self.device.step),
            ("writer", self.writer.step),
            ("errands", self.errands.step),
            ("heartbeat", self.heartbeat.step),
            ("cancellations", self.cancellations.step),
        ]
        if self.line_taker is not None:
            loops.append(("lines", self.line_taker.step))
        if self.intake_taker is not None:
            loops.append(("intake", self.intake_taker.step))
        yield_to = getattr(self.ctx.predictor, "yield_to", None)
        if callable(yield_to):  # a backend whose calls can stop between decoding steps for waiting requests
            yield_to(self.held.interactive_waiting, self.policy.max_batch_size, self.cancellations.holds)
        for name, loop in loops:
            threading.Thread(target=_forever(loop, self._stopping), name=f"infer-{name}", daemon=True).start()

    def give_back(self, wedged: bool = False) -> None:
        """Before this process goes: every message it holds goes back to the queue (a job whose batch finishes
        meanwhile is skipped when it comes back). `wedged`: the batch on the device is acked instead, since the
        watchdog already ended its jobs."""
        self._stopping.set()
        self.heartbeat.wake()
        self.errands.wake()
        running, others = self.held.empty()
        for message in running:
            if wedged:
                message.acknowledge()
            else:
                message.reject(requeue=True)
        hand_back_messages(others)
        if self.lines is not None:
            self.lines.close()
        if self.intake is not None:
            self.intake.close()
        self.registry.leave()


def _forever(step: Callable[[], None], stopping: threading.Event) -> Callable[[], None]:
    """A thread's body: the step again and again until the feeder stops."""

    def loop() -> None:
        while not stopping.is_set():
            try:
                step()
            except Exception:  # a thread of the consumer must outlive any one failure
                log.exception("inference consumer: %s failed", threading.current_thread().name)
                time.sleep(0.5)

    return loop
