"""`stoker worker KIND`: the celery worker command line for each queue group."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stoker.adapters.metricfiles import scratch_dir
from stoker.core.queues import CALLBACK_QUEUE, OCR_BANDS_QUEUE
from stoker.settings import WorkerSettings


@dataclass(frozen=True)
class WorkerKind:
    """A queue group and how its worker runs."""

    queues: tuple[str, ...]
    pool: str
    device: str


def worker_kinds(settings: WorkerSettings) -> dict[str, WorkerKind]:
    """The queue groups: CPU stages and ASR on prefork (where time limits are enforced), inference on one thread.

    `cpu` serves every CPU stage, speech included, so none of its children idles while any CPU stage has work
    waiting (a child loads the speech model the first time it transcribes). `ocr` and `asr` serve one stage each,
    to run them apart on hosts big enough to size each pool on its own.
    """
    return {
        "cpu": WorkerKind(("decode", "ocr", OCR_BANDS_QUEUE, "asr", "tokenize", CALLBACK_QUEUE), "prefork", "cpu"),
        "ocr": WorkerKind(("ocr", OCR_BANDS_QUEUE), "prefork", "cpu"),
        "asr": WorkerKind(("asr",), "prefork", settings.asr_device),
        "infer": WorkerKind(("infer",), settings.infer_pool, settings.device),
    }


#: The synchronous baseline's worker (`stoker worker sync`, benchmarks only): one thread for every stage and the
#: model, so it runs solo (the stages' SIGALRM limits need the main thread).
BASELINE_KINDS = {"sync": WorkerKind(("sync",), "solo", "cpu")}


def worker_argv(kind: str, settings: WorkerSettings, extra: Sequence[str] = ()) -> list[str]:
    """The full `celery worker` command for a worker kind."""
    spec = {**worker_kinds(settings), **BASELINE_KINDS}[kind]
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tasks.worker",
        "worker",
        "--queues",
        ",".join(spec.queues),
        "--pool",
        spec.pool,
        "--hostname",
        f"{kind}@%h",  # %h: this host; add --hostname to run two of a kind on one host
        "--loglevel",
        settings.log_level,
        # stoker revokes nothing through Celery (a cancel goes through the job store), so a starting worker has
        # nothing to sync with the others (mingle: a second of every start), and no worker needs the others'
        # events (gossip: every worker of a fleet woken by every other's heartbeat).
        "--without-mingle",
        "--without-gossip",
    ]
    recycle = [
        "--max-tasks-per-child",
        str(settings.max_tasks_per_child),
        "--max-memory-per-child",
        str(settings.max_memory_per_child_kb),
    ]
    if kind in ("cpu", "ocr"):
        argv += ["--concurrency", str(settings.cpu_pool), *recycle]
    elif kind == "asr":
        argv += ["--concurrency", str(settings.asr_concurrency), *recycle]
    else:  # infer, sync
        # celery-batches acks at flush: the worker must be allowed to hold whole batches (on RabbitMQ; on Redis the
        # consumer's own intake holds as many, `STOKER_PREFETCH_BATCHES` batches, and Celery consumes nothing).
        argv += ["--concurrency", "1", "--prefetch-multiplier", str(settings.infer_prefetch)]
    # Later options win: `stoker worker cpu --concurrency 8` or `--autoscale 16,2` override the defaults above.
    return [*argv, *extra]


#: Default metrics port per worker kind (STOKER_METRICS_PORT overrides; 0 turns metrics off).
METRICS_PORTS = {"cpu": 9101, "asr": 9102, "infer": 9103, "ocr": 9104}


def worker_env(kind: str, base: Mapping[str, str]) -> dict[str, str]:
    """Environment for a worker process: base, plus its kind, thread limits, and where its metrics live."""
    env = dict(base)
    env["STOKER_WORKER_KIND"] = kind
    env.setdefault("STOKER_METRICS_PORT", str(METRICS_PORTS.get(kind, 0)))
    # Prefork children write their metrics to files here; the worker's parent serves the merged view. The process
    # that made the directory removes it: this one, when it becomes the worker (`exec_worker`), or `stoker up`.
    env["PROMETHEUS_MULTIPROC_DIR"] = str(scratch_dir(kind))
    # Tokenizers parallelise internally; after a fork that deadlocks, so prefork children stay single-threaded.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # No OMP_THREAD_LIMIT for the worker itself: tesseract gets its own (`stoker.adapters.tesseract.read_text`), and the
    # speech model under OMP_THREAD_LIMIT=1 with its threads left to choose (CTranslate2) runs about 40x slower and
    # transcribes garbage (docs/bench/log/2026-11-30-stoker-bench-sweep-and-overhead.md); a CPU child may transcribe.
    env.pop("OMP_THREAD_LIMIT", None)
    return env


def exec_worker(kind: str, extra: Sequence[str] = ()) -> None:
    """Replace this process with the worker."""
    argv = worker_argv(kind, WorkerSettings(), extra)
    os.execve(sys.executable, argv, worker_env(kind, os.environ))  # this process's own environment, handed on
