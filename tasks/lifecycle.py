"""A worker process's start and stop, in one place: every Celery signal a worker answers is wired here (`wire`).

- configuration (the app's `on_configure`): the process's one `WorkerSettings` is read, and the part of the Celery
  configuration computed from it applied;
- `setup` (worker_init, in the worker's parent before its pool forks): the process's one `WorkerContext`, tracing
  and CPU accounting;
- `start` (celeryd_after_setup, once the consumed queues are known): what those queues need before their first
  message (the tokenizer, tesseract, the model and the inference consumer), and the metrics endpoint;
- a pool child's start and exit (worker_process_init / worker_process_shutdown), each task's accounting
  (task_prerun / task_postrun);
- `shutdown` (worker_shutting_down): the inference consumer hands its messages back; at worker_shutdown the
  process's objects are frozen out of the interpreter's last collections.

Task functions get the context from `context()`, the one accessor; everything below them takes it as a parameter.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import billiard.process
import redis
from celery import Celery
from celery.signals import (
    celeryd_after_setup,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
    worker_shutting_down,
)

from stoker.adapters.heap import keep_freed_memory
from stoker.adapters.metricfiles import forget_process, remove_own_scratch_dir
from stoker.adapters.metrics import serve_worker_metrics
from stoker.adapters.occupancy import PoolOccupancy
from stoker.adapters.rlimits import cap_address_space
from stoker.adapters.tracing import instrument_celery, setup_tracing
from stoker.core.batching import BatchPolicy
from stoker.core.queues import INFER_QUEUE, SYNC_QUEUE
from stoker.runtime.batches import fail_overdue
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeder import Feeder
from stoker.runtime.monitoring import account_cpu, count_cpu, cpu_seconds, watch_device
from stoker.runtime.watchdog import BatchWatchdog, RunningBatch
from stoker.settings import WorkerSettings
from tasks.app import configure
from tasks.pipeline import CeleryOutbox

log = logging.getLogger(__name__)

#: Exit status of an inference worker that gave up on a wedged device; its supervisor starts a fresh one.
WEDGED_EXIT = 75


@dataclass
class _Process:
    """What this process's lifecycle built, in the order it builds it."""

    app: Celery | None = None
    settings: WorkerSettings | None = None
    context: WorkerContext | None = None
    watchdog: BatchWatchdog | None = None
    feeder: Feeder | None = None
    main_pid: int | None = None
    #: The process that started this worker (a supervisor such as `stoker up`), to know when it is orphaned.
    parent: int | None = None
    #: The queues this worker consumes (known at setup; a pool child inherits them).
    queues: frozenset[str] = frozenset()
    #: CPU seconds of this pool child when each of its running tasks started.
    task_cpu: dict[str, float] = field(default_factory=dict)


_process = _Process()


# -- what tasks ask for ---------------------------------------------------------------------------------------
def context() -> WorkerContext:
    """This worker process's context; raises if `setup` did not run (the process is not a started worker)."""
    if _process.context is None:
        raise RuntimeError("no worker context: tasks.lifecycle.setup has not run in this process")
    return _process.context


def feeder() -> Feeder:
    """This worker's inference consumer; raises unless the worker consumes the inference queue."""
    if _process.feeder is None:
        raise RuntimeError("no inference consumer: this worker does not consume the inference queue")
    return _process.feeder


def watchdog() -> BatchWatchdog:
    """The device's watchdog; raises unless this worker runs the model."""
    if _process.watchdog is None:
        raise RuntimeError("no device watchdog: this worker does not run the model")
    return _process.watchdog


# -- start and stop -------------------------------------------------------------------------------------------
def wire(app: Celery) -> None:
    """Connect this module to the workers' app and to every worker signal (once)."""
    _process.app = app
    app.on_configure.connect(_configure, sender=app, weak=False)
    for signal, handler in (
        (worker_init, _on_worker_init),
        (celeryd_after_setup, _on_after_setup),
        (worker_process_init, _on_child_start),
        (worker_process_shutdown, _on_child_exit),
        (task_prerun, _on_task_start),
        (task_postrun, _on_task_end),
        (worker_shutting_down, _on_shutting_down),
        (worker_shutdown, _on_shutdown),
    ):
        signal.connect(handler, weak=False, dispatch_uid=f"stoker.lifecycle.{handler.__name__}")


def settings() -> WorkerSettings:
    """This process's settings, read once (when Celery configures the app, or at setup if that came first)."""
    if _process.settings is None:
        _process.settings = as_its_kind_runs(WorkerSettings())
    return _process.settings


#: The synchronous baseline's worker kind (`workers.launch.BASELINE_KINDS`, benchmarks only).
BASELINE_KIND = "sync"


def as_its_kind_runs(s: WorkerSettings) -> WorkerSettings:
    """A worker's settings as its kind runs with them: the synchronous baseline's decodes no speech fallback ahead
    (`STOKER_ASR_LOOKAHEAD` off), the design of one thread per job that stoker replaces."""
    return s.model_copy(update={"asr_lookahead": False}) if s.worker_kind == BASELINE_KIND else s


def setup(kind: str) -> WorkerContext:
    """Build this process's context, and start tracing and CPU accounting for a worker of this kind."""
    if _process.app is None:
        raise RuntimeError("tasks.lifecycle.wire(app) must run before setup")
    ctx = _process.context = WorkerContext(settings(), CeleryOutbox(_process.app))
    _process.main_pid = os.getpid()
    _process.parent = os.getppid()
    if setup_tracing(f"stoker-{kind}", ctx.settings.trace_exporter, ctx.settings.trace_file):
        instrument_celery()  # before the pool forks: children inherit the provider and the instrumentation
    account_cpu(ctx.store, kind)
    return ctx


def start(ctx: WorkerContext, queues: set[str]) -> None:
    """Load what this worker's queues need before the first message arrives, so no task pays for it."""
    started = time.perf_counter()
    _process.queues = frozenset(queues)
    if "tokenize" in queues:
        ctx.cache.publish_context(ctx.pipeline_context())  # the API can tokenize cheap jobs from now on
    if {"decode", "ocr"} & queues:
        _ = ctx.decode_outputs  # the served model's image processor (or that it has none): OCR runs or not
        if ctx.image_preparer is not None:
            # A render job's pictures are rendered here (`stages.decode`): its renderer (tokenizer, 8-bit image
            # processor) loaded once before the pool forks, not by each child on its first render and again by
            # every child that replaces a recycled one (`max_tasks_per_child`).
            _ = ctx.renderer
    if "ocr" in queues:
        _ = ctx.tesseract
    if SYNC_QUEUE in queues:
        ctx.pipeline_context()  # the sync worker runs every stage, tokenize included
        _ = ctx.tesseract
        if ctx.settings.asr_preload:  # and transcribes, in this process (solo): no pool child to load it
            _ = ctx.speech_model
    if {"infer", SYNC_QUEUE} & queues:
        _start_device(ctx, consume="infer" in queues)
    log.info("worker resources preloaded in %.1fs", time.perf_counter() - started)
    _serve_metrics(ctx.settings)


def shutdown() -> None:
    """A clean stop: the inference consumer's messages go back to the queue, and it stops beating."""
    if _process.feeder is not None:
        _process.feeder.give_back()


def _start_device(ctx: WorkerContext, consume: bool) -> None:
    """The model, its watchdog and the device monitor; with `consume`, the inference consumer too."""
    s = ctx.settings
    _ = ctx.predictor
    dog = _process.watchdog = BatchWatchdog(
        s.infer_batch_timeout_s, s.infer_wedge_grace_s, lambda batch: _fail_overdue(ctx, batch), _replace_worker
    )
    dog.watch()
    watch_device(ctx.device_clock, ctx.outbox, s.device_sample_s, s.idle_max_wait_s)
    if consume:
        policy = BatchPolicy(
            max_batch_size=s.max_batch_size, max_batch_tokens=s.max_batch_tokens, max_wait_s=s.max_wait_ms / 1000
        )
        _process.feeder = Feeder(ctx, policy, dog, lines=ctx.batch_lines, intake=ctx.intake)
        _process.feeder.start()


def _fail_overdue(ctx: WorkerContext, batch: RunningBatch) -> None:
    fail_overdue(ctx, batch, watchdog().budget_s)


def _replace_worker(batch: RunningBatch) -> None:
    """The device is wedged: hand the queued messages back and exit, so a fresh process takes over (the batch on
    the device is acked: the watchdog already ended its jobs)."""
    try:
        if _process.feeder is not None:
            _process.feeder.give_back(wedged=True)
    finally:
        logging.shutdown()
        os._exit(WEDGED_EXIT)


def _serve_metrics(s: WorkerSettings) -> None:
    """The worker's parent serves the merged metrics of its pool."""
    try:
        serve_worker_metrics(s.metrics_port, s.prometheus_multiproc_dir, s.metrics_host)
    except OSError as exc:  # a port in use must not take the worker down
        log.warning("metrics port %s unavailable: %s", s.metrics_port, exc)


# -- the signals ----------------------------------------------------------------------------------------------
def _configure(sender: Celery, **_: Any) -> None:
    configure(sender, settings())


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    keep_freed_memory(settings().heap_keep_mb, settings().heap_arenas)  # before the pool forks: every child inherits it
    ctx = setup(settings().worker_kind)
    ctx.pool_children = getattr(sender, "concurrency", None) or 1  # under --autoscale, its most children
    ctx.occupancy = PoolOccupancy(ctx.pool_children)  # before the pool forks: every child shares it


def _on_after_setup(sender: str, instance: Any, **_: Any) -> None:
    queues = set(instance.app.amqp.queues.consume_from or {})
    if INFER_QUEUE in queues and context().intake is not None:
        # On Redis the inference consumer reads its queue itself (`RedisIntake`), many messages per round trip:
        # Celery's consumer leaves it alone (and consumes nothing else on an inference-only worker).
        instance.app.amqp.queues.deselect([INFER_QUEUE])
    start(context(), queues)


def _one_torch_thread() -> None:
    """A CPU pool child is one core's worth of work (the pool is the parallelism): torch's intra-op pool, which the
    image processor's torchvision backend runs on, at one thread. Left at one per core, each child's threads fight
    the others' for the same cores (measured: 233 CPU ms a 1280×960 picture through the processor on two busy cores,
    59 ms at one thread). torch is imported before the fork where pictures are prepared; elsewhere nothing to do."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _on_child_start(**_: Any) -> None:
    """Each CPU and ASR pool child gets an address-space cap, so a decompression bomb (an image, or media whose
    decode balloons) fails alone instead of taking the host's memory; one that may transcribe starts loading the
    speech model (`STOKER_ASR_PRELOAD`)."""
    _mark_busy(False)  # a child that replaces one killed mid-task takes its slot
    s = context().settings
    # A `cpu` child may transcribe too (it serves every CPU stage): it gets the room the speech model needs.
    both = (s.cpu_address_space_mb, s.asr_address_space_mb)
    cap = {"cpu": 0 if 0 in both else max(both), "ocr": s.cpu_address_space_mb, "asr": s.asr_address_space_mb}
    if cap.get(s.worker_kind):
        cap_address_space(cap[s.worker_kind])
    if s.worker_kind in ("cpu", "ocr"):
        _one_torch_thread()
    if "asr" in _process.queues and s.asr_preload:
        threading.Thread(target=_preload_speech, name="asr-preload", daemon=True).start()


def _preload_speech() -> None:
    """A pool child that may transcribe loads the speech model beside its first tasks (a thread: the child takes
    OCR and other work meanwhile, and a recording that comes first waits for this load, not a second one)."""
    started = time.perf_counter()
    try:
        _ = context().speech_model
    except Exception as exc:  # a recording's own attempt reports it, as a structured error, on its job
        log.warning("could not preload the speech model: %s", exc)
        return
    log.info("speech model preloaded in %.1fs", time.perf_counter() - started)


def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    """A pool child exits: its live gauges leave the merged view."""
    if pid:
        forget_process(pid, context().settings.prometheus_multiproc_dir)


def _on_task_start(task_id: str | None = None, **_: Any) -> None:
    """A prefork pool child counts the CPU of each task it runs (the parent counts its own), and is busy."""
    if task_id and _in_pool_child():
        _process.task_cpu[task_id] = cpu_seconds(children=True)
        _mark_busy(True)


def _in_pool_child() -> bool:
    """This process is a child of the worker's prefork pool (not the worker itself, nor a solo or threads pool)."""
    return _process.main_pid is not None and os.getpid() != _process.main_pid


def _mark_busy(busy: bool) -> None:
    """This pool child's slot in the pool's occupancy (`WorkerContext.core_is_idle`)."""
    occupancy, index = context().occupancy, getattr(billiard.process.current_process(), "index", None)
    if occupancy is not None and index is not None:
        occupancy.mark(index, busy)


def _on_task_end(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    ctx = context()
    if _in_pool_child():
        _mark_busy(False)
    started = _process.task_cpu.pop(task_id or "", None)
    if started is not None:
        count_cpu(ctx.store, ctx.settings.worker_kind, cpu_seconds(children=True) - started)
    _count_drained(ctx, task)


def _count_drained(ctx: WorkerContext, task: Any) -> None:
    """Count every stage message done with, per queue: the API derives drain rates (and Retry-After) from it."""
    if task is None or task.name == "stoker.infer":  # the inference consumer counts whole batches itself
        return
    queue = (task.request.delivery_info or {}).get("routing_key")
    if not queue:
        return
    try:
        ctx.store.stats.count_drained(str(queue))
    except redis.RedisError:
        log.warning("could not count a drained %s message", queue)


#: How long a worker orphaned by its supervisor may take to stop before it exits regardless.
ORPHAN_GRACE_S = 3.0


def _on_shutting_down(**_: Any) -> None:
    if _process.parent is not None and os.getppid() != _process.parent:
        # Told to stop because its supervisor died (the tether's signal): the stack is going, an embedded broker and
        # store with it, so a goodbye that rides out their loss (store retries, a publish to a dead broker) must
        # not keep this process alive; what it still held comes back by visibility timeout and the reaper.
        log.warning("supervisor gone: stopping within %.0fs", ORPHAN_GRACE_S)
        deadline = threading.Timer(ORPHAN_GRACE_S, _exit_now)
        deadline.daemon = True  # a stop that finishes sooner is not held back by it
        deadline.start()
    shutdown()


def _exit_now() -> None:
    logging.shutdown()
    os._exit(0)


def _on_shutdown(**_: Any) -> None:
    """Everything is stopped: the interpreter's last garbage collections over a loaded model (seconds on a busy
    host) would only free memory the process gives back anyway, so its objects are frozen out of them. A worker
    told to stop, or orphaned by its supervisor, is then gone in a moment. Its metric files go with it, where it
    made their directory itself."""
    remove_own_scratch_dir(settings().prometheus_multiproc_dir)
    gc.freeze()
