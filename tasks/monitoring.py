"""What workers report about themselves: the metrics endpoint, the device's busy and starved time, and one log
line per finished job."""

from __future__ import annotations

import gc
import logging
import os
import resource
import threading
import time
from typing import Any

from celery.signals import (
    celeryd_after_setup,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_shutdown,
    worker_shutdown,
)

from stoker.adapters.broker import queue_depths
from stoker.adapters.metrics import (
    DEVICE_BUSY_RATIO,
    DEVICE_BUSY_SECONDS,
    QUEUE_DEPTH,
    STARVATION_SECONDS,
    forget_process,
    serve_worker_metrics,
)
from stoker.adapters.tracing import instrument_celery, setup_tracing
from stoker.core.jobs import Job
from stoker.core.queues import CPU_QUEUES, QUEUES
from tasks import resources
from tasks.worker import app

log = logging.getLogger(__name__)


class DeviceClock:
    """Busy time of the device in this process: batches begin and end; `take` reads the busy seconds since the last
    call (a batch still running counts up to now)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None
        self._busy = 0.0

    def begin(self) -> None:
        """A batch went onto the device."""
        with self._lock:
            self._since = self.clock()

    def end(self) -> None:
        """The batch came back."""
        with self._lock:
            if self._since is not None:
                busy = self.clock() - self._since
                self._busy += busy
                DEVICE_BUSY_SECONDS.inc(busy)
            self._since = None

    def take(self) -> float:
        """Busy seconds since the previous take."""
        with self._lock:
            now = self.clock()
            busy = self._busy + (now - self._since if self._since is not None else 0.0)
            self._busy = 0.0
            if self._since is not None:
                DEVICE_BUSY_SECONDS.inc(now - self._since)
                self._since = now
            return busy


def starved_seconds(interval_s: float, busy_s: float, cpu_backlog: int) -> float:
    """Idle device time that counts as starvation: the device waited while work sat in CPU queues."""
    return max(interval_s - busy_s, 0.0) if cpu_backlog > 0 else 0.0


device = DeviceClock()


def sample_depths() -> dict[str, int] | None:
    """Every queue's depth, or None while the broker does not answer (a broken connection is closed, so the pool
    hands out a fresh one next time instead of the same dead one)."""
    try:
        with app.pool.acquire(block=True, timeout=5) as connection:
            try:
                return queue_depths(connection, QUEUES)
            except Exception:
                connection.close()
                raise
    except Exception as exc:
        log.warning("cannot sample queue depths: %s", exc)
        return None


def watch_device(interval_s: float) -> threading.Thread:
    """Sample queue depths, the busy ratio and starvation every interval, in a daemon thread that outlives any
    failed sample."""

    def sample(span: float) -> None:
        busy = device.take()
        depths = sample_depths()
        if depths is None:  # the broker is away: no sample this time
            return
        for queue, depth in depths.items():
            QUEUE_DEPTH.labels(queue).set(depth)
        DEVICE_BUSY_RATIO.set(min(busy / span, 1.0) if span > 0 else 0.0)
        STARVATION_SECONDS.inc(starved_seconds(span, busy, sum(depths[q] for q in CPU_QUEUES)))

    def loop() -> None:
        last = time.monotonic()
        while True:
            time.sleep(interval_s)
            now = time.monotonic()
            span, last = now - last, now
            try:
                sample(span)
            except Exception:
                log.exception("device sample failed")

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


def log_finished(job_id: str) -> None:
    """Log the finished job's line (nothing if the record is gone)."""
    job = resources.store().jobs.load_job(job_id)
    if job is not None:
        log_job(job)


def log_job(job: Job) -> None:
    """Log a finished job's line."""
    if job.terminal:
        log.info(job_line(job))


@celeryd_after_setup.connect
def _serve_metrics(sender: str, instance: Any, **_: Any) -> None:
    """The worker's parent serves the merged metrics of its pool."""
    try:
        s = resources.settings()
        serve_worker_metrics(s.metrics_port, s.prometheus_multiproc_dir, s.metrics_host)
    except OSError as exc:  # a port in use must not take the worker down
        log.warning("metrics port %s unavailable: %s", resources.settings().metrics_port, exc)


@worker_process_shutdown.connect
def _forget_child(pid: int | None = None, **_: Any) -> None:
    """A pool child exits: its live gauges leave the merged view."""
    if pid:
        forget_process(pid, resources.settings().prometheus_multiproc_dir)


@worker_shutdown.connect
def _exit_quickly(**_: Any) -> None:
    """Everything is stopped: the interpreter's last garbage collections over a loaded model (seconds on a busy
    host) would only free memory the process gives back anyway, so its objects are frozen out of them. A worker told
    to stop, or orphaned by its supervisor, is then gone in a moment."""
    gc.freeze()


@worker_init.connect
def _trace(**_: Any) -> None:
    """Tracing for this worker (before the pool forks: children inherit the provider and the instrumentation)."""
    s = resources.settings()
    if setup_tracing(f"stoker-{s.worker_kind}", s.trace_exporter, s.trace_file):
        instrument_celery()


# -- CPU accounting: every worker process counts the CPU it spends, so benchmarks compare designs by work done ---

#: Worker kinds whose tasks run in forked pool children (each child counts its own tasks); the others run tasks
#: in the worker process itself, which then counts everything it and its subprocesses (tesseract) spent.
PREFORK_KINDS = ("cpu", "ocr", "asr")
_main_pid: list[int] = []
#: How often a worker process adds its own CPU time to the count.
CPU_SAMPLE_S = 1.0
_task_cpu: dict[str, float] = {}


def cpu_seconds(children: bool) -> float:
    """User + system CPU seconds of this process so far (and of its waited-for subprocesses, with children)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += kids.ru_utime + kids.ru_stime
    return total


def _count_cpu(seconds: float) -> None:
    if seconds > 0:
        try:
            resources.store().stats.add_cpu_time(resources.settings().worker_kind, seconds)
        except Exception as exc:  # accounting never fails a task
            log.debug("could not count CPU time: %s", exc)


@worker_init.connect
def _account_cpu(**_: Any) -> None:
    """The worker process counts its own CPU every second (for prefork, the parent's; children count their
    tasks), so `/v1/stats` shows CPU seconds per worker kind."""
    _main_pid.append(os.getpid())
    children = resources.settings().worker_kind not in PREFORK_KINDS

    def loop() -> None:
        last = cpu_seconds(children)
        while True:
            time.sleep(CPU_SAMPLE_S)
            now = cpu_seconds(children)
            _count_cpu(now - last)
            last = now

    threading.Thread(target=loop, name="cpu-accounting", daemon=True).start()


@task_prerun.connect
def _task_started(task_id: str | None = None, **_: Any) -> None:
    if task_id and _main_pid and os.getpid() != _main_pid[0]:  # a prefork pool child
        _task_cpu[task_id] = cpu_seconds(children=True)


@task_postrun.connect
def _task_ended(task_id: str | None = None, **_: Any) -> None:
    started = _task_cpu.pop(task_id or "", None)
    if started is not None:
        _count_cpu(cpu_seconds(children=True) - started)
