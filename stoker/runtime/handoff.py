"""The hand-over from preprocessing to inference, as the tokenize stage (`stoker.runtime.stages.tokenization`) and
the reaper use it: a tokenized job held while the inference queue is too full (`wait_for_room`), and a job's
unfinished inputs failed when its preprocessing comes to an early end (`fail_unfinished`).
"""

from __future__ import annotations

import logging
import time

from stoker.adapters.store.keys import frame_ref, input_ref
from stoker.core.errors import StokerError
from stoker.core.jobs import ErrorInfo, JobClass
from stoker.core.pressure import room_to_enqueue
from stoker.core.queues import INFER_QUEUES
from stoker.runtime.context import WorkerContext

log = logging.getLogger(__name__)

#: How often a held job looks at the inference queue again, and how long its hold outlives its last look.
HOLD_LOOK_S = 0.2
HOLD_TTL_S = 2.0


def wait_for_room(
    ctx: WorkerContext, job_id: str, deadline: float | None, job_class: JobClass = "interactive"
) -> float:
    """Hold the job while the inference queue is above its high watermark, until it drains to the low one, the
    wait limit passes or the job's deadline does; returns the seconds waited. An interactive job counts the
    interactive queue only (batch lines never hold it back); a batch line counts both.

    While any interactive job is held (the store's `HandoffHold`), a later one that finds the queue between the
    watermarks is held too, so it cannot overtake the earlier ones; the API's own hand-off reads the same hold.

    Holding it here stalls this CPU worker: its prefetch bounds what it takes, and the CPU queues grow in the
    broker (where admission control sees them) instead of the inference queue or any worker's memory.
    """
    s = ctx.settings
    started = time.time()
    until = min(started + s.handoff_max_wait_s, deadline or float("inf"))
    waiting = False
    interactive = job_class != "batch"
    hold = ctx.store.handoff_hold
    queues = ("infer",) if interactive else INFER_QUEUES
    try:
        while True:
            depth = sum(ctx.outbox.queue_depths(queues).values())
            held = waiting or (interactive and hold.held_at(depth, s.infer_low_watermark))
            if room_to_enqueue(depth, s.infer_high_watermark, s.infer_low_watermark, held):
                break
            if time.time() >= until:
                break
            if not waiting:
                why = "others are held" if held else f"> {s.infer_high_watermark}"
                log.info("inference queue at %d (%s): holding job %s", depth, why, job_id)
            if interactive:
                hold.hold(job_id, HOLD_TTL_S)
            waiting = True
            time.sleep(HOLD_LOOK_S)
    finally:
        if waiting and interactive:
            hold.release(job_id)  # in, out of time, or stopped: the jobs held after it still hold
    return time.time() - started


def fail_unfinished(ctx: WorkerContext, job_id: str, error: StokerError) -> bool:
    """Mark every input (and keyframe) still pending as failed with error; False if the job is gone or over."""
    store = ctx.store
    job = store.jobs.load_job(job_id)
    if job is None or job.terminal:
        return False
    info = ErrorInfo(**error.to_dict())
    for record in job.inputs:
        items = [
            (input_ref(record.index), record),
            *((frame_ref(record.index, f.index), f) for f in record.frames or []),
        ]
        for ref, item in items:
            if item.status == "pending":
                store.jobs.put_input(
                    job_id, ref, item.model_copy(update={"status": "failed", "error": info, "frames": None})
                )
    return True
