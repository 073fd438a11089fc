"""What workers report about themselves: the device's busy and starved time, the CPU they spend, and one log line
per finished job. (`tasks.lifecycle` starts these when a worker starts.)"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Iterable

from stoker.adapters.metrics import DEVICE_BUSY_RATIO, QUEUE_DEPTH, STARVATION_SECONDS, DeviceClock
from stoker.adapters.store import Store
from stoker.core.jobs import Job
from stoker.core.pacing import Pace
from stoker.core.queues import CPU_QUEUES, QUEUES
from stoker.runtime.seams import Outbox

log = logging.getLogger(__name__)


def starved_seconds(interval_s: float, busy_s: float, cpu_backlog: int) -> float:
    """Idle device time that counts as starvation: the device waited while work sat in CPU queues."""
    return max(interval_s - busy_s, 0.0) if cpu_backlog > 0 else 0.0


def sample_depths(outbox: Outbox, queues: Iterable[str] = QUEUES, timeout_s: float = 5) -> dict[str, int] | None:
    """Each queue's depth (every queue's by default), or None while the broker does not answer."""
    try:
        return outbox.queue_depths(queues, timeout_s=timeout_s)
    except Exception as exc:
        log.warning("cannot sample queue depths: %s", exc)
        return None


def watch_device(
    device: DeviceClock, outbox: Outbox, interval_s: float, idle_max_s: float | None = None
) -> threading.Thread:
    """Sample queue depths, the busy ratio and starvation every interval, in a daemon thread that outlives any
    failed sample; while the device is idle and every queue empty, less and less often (up to `idle_max_s`)."""
    pace = Pace(interval_s, idle_max_s or interval_s)

    def sample(span: float, waited: float) -> bool:
        busy = device.take()
        depths = sample_depths(outbox)
        if depths is None:  # the broker is away: no sample this time
            return True
        for queue, depth in depths.items():
            QUEUE_DEPTH.labels(queue).set(depth)
        DEVICE_BUSY_RATIO.set(min(busy / span, 1.0) if span > 0 else 0.0)
        # After a slowed-down wait only the last interval counts: the backlog seen now was not there all along.
        counted = span if waited <= interval_s else min(span, interval_s + busy)
        starved = starved_seconds(counted, busy, sum(depths[q] for q in CPU_QUEUES))
        STARVATION_SECONDS.inc(starved)
        return busy > 0 or any(depths.values())

    def loop() -> None:
        last, wait = time.monotonic(), interval_s
        while True:
            time.sleep(wait)
            now = time.monotonic()
            span, last = now - last, now
            try:
                active = sample(span, wait)
            except Exception:
                log.exception("device sample failed")
                active = True
            wait = pace.next_wait(active)

    thread = threading.Thread(target=loop, name="device-monitor", daemon=True)
    thread.start()
    return thread


def job_line(job: Job) -> str:
    """The one log line a finished job leaves: kinds, preprocessing (and whether the cache served it), inference,
    total, and preprocessing's share of the total."""
    kinds = "+".join(sorted({i.kind for i in job.inputs} | {"text"}))
    t = job.timings_ms
    cached = bool(job.inputs) and all(i.cache_hit and all(i.cache_hit.values()) for i in job.inputs)
    pre = f"{t.get('preprocess', 0):.0f}ms" + ("(cache hit)" if cached else "")
    share = f"{job.preprocess_share:.0%}" if job.preprocess_share is not None else "-"
    fields = [
        f"job={job.id}",
        f"status={job.status}",
        f"kinds={kinds}",
        f"preprocess={pre}",
        f"infer={t.get('infer', 0):.0f}ms",
        f"total={t.get('total', 0):.0f}ms",
        f"preprocess_share={share}",
    ]
    if job.error:
        fields.append(f"error={job.error.code}")
    failed = [f"{i.index}:{i.error.code}" for i in job.inputs if i.error]
    if failed:
        fields.append(f"failed_inputs={','.join(failed)}")
    return " ".join(fields)


def log_finished(store: Store, job_id: str) -> None:
    """Log the finished job's line (nothing if the record is gone)."""
    job = store.jobs.load_job(job_id)
    if job is not None:
        log_job(job)


def log_job(job: Job) -> None:
    """Log a finished job's line."""
    if job.terminal:
        log.info(job_line(job))


# -- CPU accounting: every worker process counts the CPU it spends, so benchmarks compare designs by work done ---

#: Worker kinds whose tasks run in forked pool children (each child counts its own tasks); the others run tasks
#: in the worker process itself, which then counts everything it and its subprocesses (tesseract) spent.
PREFORK_KINDS = ("cpu", "ocr", "asr")
#: How often a worker process adds its own CPU time to the count, and the least it writes (less waits for the next
#: sample: an idle process writes once in a while, not every second).
CPU_SAMPLE_S = 1.0
CPU_MIN_WRITE_S = 0.01


def cpu_seconds(children: bool) -> float:
    """User + system CPU seconds of this process so far (and of its waited-for subprocesses, with children)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += kids.ru_utime + kids.ru_stime
    return total


def count_cpu(store: Store, kind: str, seconds: float) -> None:
    """Add CPU seconds spent by this worker kind to the count `/v1/stats` shows."""
    if seconds > 0:
        try:
            store.stats.add_cpu_time(kind, seconds)
        except Exception as exc:  # accounting never fails a task
            log.debug("could not count CPU time: %s", exc)


def account_cpu(store: Store, kind: str) -> threading.Thread:
    """Count this worker process's own CPU every second (for prefork, the parent's; children count their tasks)."""
    children = kind not in PREFORK_KINDS

    def loop() -> None:
        last = cpu_seconds(children)
        while True:
            time.sleep(CPU_SAMPLE_S)
            now = cpu_seconds(children)
            if now - last >= CPU_MIN_WRITE_S:
                count_cpu(store, kind, now - last)
                last = now

    thread = threading.Thread(target=loop, name="cpu-accounting", daemon=True)
    thread.start()
    return thread
