"""Prometheus metrics: what every stoker process exports, and how.

Workers run in multiprocess mode (prefork children write to `PROMETHEUS_MULTIPROC_DIR`, the worker's parent serves
the merged view on its metrics port); the API serves its own registry, plus cluster-wide job counts read from Redis
at scrape time, on a listener of its own (`STOKER_API_METRICS_PORT`), never on the public API port. Every metrics
listener binds to `STOKER_METRICS_HOST` (127.0.0.1 unless a deployment opens it to its scraper).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

#: Seconds: stage run times span 1 ms (a cache hit) to minutes (a long transcription).
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180)

STAGE_SECONDS = Histogram(
    "stoker_stage_duration_seconds", "Run time of one stage on one input.", ["stage", "cache"], buckets=STAGE_BUCKETS
)
QUEUE_WAIT_SECONDS = Histogram(
    "stoker_stage_queue_wait_seconds", "Time a stage message waited in the broker.", ["stage"], buckets=STAGE_BUCKETS
)
CACHE_LOOKUPS = Counter("stoker_cache_lookups_total", "Stage cache lookups.", ["stage", "result"])
STAGE_FAILURES = Counter("stoker_stage_failures_total", "Inputs failed by a stage.", ["stage", "code"])
BATCH_SIZE = Histogram(
    "stoker_batch_size", "Requests per inference batch.", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
)
BATCH_WAIT_SECONDS = Histogram(
    "stoker_batch_wait_seconds", "From a job's prompt being ready to its batch starting.", buckets=STAGE_BUCKETS
)
BATCH_SECONDS = Histogram("stoker_batch_duration_seconds", "Device time of one batch.", buckets=STAGE_BUCKETS)
DEVICE_IDLE_GAP_SECONDS = Histogram(
    "stoker_device_idle_gap_seconds",
    "The device's idle time between consecutive batches while work was waiting for it (the consumer's overhead).",
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
)
QUEUE_DEPTH = Gauge("stoker_queue_depth", "Messages waiting in a queue.", ["queue"], multiprocess_mode="mostrecent")
DEVICE_BUSY_RATIO = Gauge(
    "stoker_device_busy_ratio",
    "Share of the last interval the device spent on batches.",
    multiprocess_mode="mostrecent",
)
DEVICE_BUSY_SECONDS = Counter("stoker_device_busy_seconds_total", "Seconds the device spent on batches.")
#: Seconds: a vision encoder runs one picture in milliseconds (a GPU) to seconds (a big page on a CPU).
ENCODER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
VISION_EMBEDDING_LOOKUPS = Counter(
    "stoker_vision_embeddings_lookups_total",
    "Vision-embeddings cache lookups, by tier (`local`: this worker's memory, `shared`: the fleet's store) and "
    "result (a picture that misses both runs the vision encoder).",
    ["tier", "result"],
)
VISION_ENCODER_SECONDS = Histogram(
    "stoker_vision_encoder_seconds", "Vision encoder (and connector) time of one picture.", buckets=ENCODER_BUCKETS
)
VISION_EMBEDDING_EVICTIONS = Counter(
    "stoker_vision_embeddings_evictions_total",
    "Vision embeddings dropped to keep a tier under its size cap.",
    ["tier"],
)
VISION_EMBEDDING_STORE_FAILURES = Counter(
    "stoker_vision_embeddings_store_failures_total",
    "Reads or writes of the shared vision-embeddings store that failed (each costs a recomputation at most).",
    ["op"],
)
STARVATION_SECONDS = Counter(
    "stoker_device_starved_seconds_total",
    "Seconds the device sat idle while jobs waited in CPU queues: add CPU workers when this grows.",
)

# The API process.
REQUESTS = Histogram(
    "stoker_api_request_duration_seconds", "API request latency.", ["method", "route", "status"], buckets=STAGE_BUCKETS
)
ADMISSIONS = Counter("stoker_api_admissions_total", "Job submissions by outcome.", ["outcome"])


def cache_label(hit: bool | None) -> str:
    """The `cache` label of a stage observation."""
    return "none" if hit is None else ("hit" if hit else "miss")


def serve_worker_metrics(port: int, directory: Path | None, host: str = "127.0.0.1") -> Callable[[], None] | None:
    """Serve this worker's merged multiprocess metrics (files in directory) on host:port (`STOKER_METRICS_HOST`,
    loopback unless a deployment opens it to its scraper); returns what stops it, or None when not configured."""
    if not port or not directory:
        return None
    registry = CollectorRegistry()
    registry.register(CompactingCollector(directory))
    server, _ = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on %s:%d/metrics (from %s)", host, port, directory)
    return _stopper(server)


def serve_api_metrics(port: int, host: str, *collectors: Collector) -> Callable[[], None] | None:
    """Serve this API process's own metrics and `collectors` on host:port, a listener apart from the API's (so
    nothing public reaches them); returns what stops it, or None when port is 0 or cannot be bound (logged: the
    API serves on without its metrics rather than not at all)."""
    if not port:
        return None
    registry = CollectorRegistry()
    for collector in (_ProcessMetrics(), *collectors):
        registry.register(collector)
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("API metrics not served: %s:%d unavailable (%s)", host, port, exc.strerror)
        return None
    log.info("API metrics on %s:%d/metrics", host, port)
    return _stopper(server)


def _stopper(server: WSGIServer) -> Callable[[], None]:
    """What stops a metrics listener and frees its port."""

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return stop


class _ProcessMetrics(Collector):
    """This process's default registry (what the API's routes count), as one collector of another registry."""

    def collect(self) -> Iterator[Metric]:
        """The default registry's metrics, read at scrape time."""
        yield from REGISTRY.collect()


def forget_process(pid: int, directory: Path | None) -> None:
    """A pool child exited: drop its live gauges from the merged view (kept in directory)."""
    if directory:
        mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


# -- a worker's metric files --------------------------------------------------------------------------------------
# prometheus-client's multiprocess mode writes one file per metric type and process, and its collector reads every
# file on every scrape. A CPU worker recycles its pool children (every `max_tasks_per_child` tasks), so the files
# of dead children pile up for as long as the worker lives, and every scrape grows slower
# (prometheus/client_python#367). The library leaves them by design: deleting them would make counters go back. No
# library folds them, so this module does: a dead process's counts are added into an accumulator file (pid 0, a
# name the collector reads like any other) and its own files removed, under the lock every scrape holds.

#: `stoker worker` gives each worker a directory of its own under the system's temporary directory, named with this
#: prefix, its kind and the pid of the process that made it.
SCRATCH_PREFIX = "stoker-metrics-"
_SCRATCH_NAME = re.compile(rf"^{SCRATCH_PREFIX}[a-z-]+?-(\d+)-")
#: Files whose values add up across processes; `gauge_mostrecent` keeps the latest write. Other gauge modes are
#: left alone (`live*` ones go with their process; `all` keeps a series per pid).
_SUMMED = ("counter", "histogram", "summary")
_FOLDED = (*_SUMMED, "gauge_mostrecent")
#: Fold once this many files of dead processes have gathered (a few children's worth), not on every scrape.
COMPACT_AFTER = 12
#: The accumulators' "pid": no process of the worker's has it.
ACCUMULATOR_PID = 0


def scratch_dir(kind: str) -> Path:
    """A new, empty directory for one worker's metric files; scratch directories whose maker is gone are removed
    first (a worker or a stack killed outright leaves its own behind)."""
    sweep_scratch_dirs()
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{kind}-{os.getpid()}-"))


def sweep_scratch_dirs(root: Path | None = None) -> int:
    """Remove the scratch directories in root (the temporary directory) whose maker's pid is no longer running."""
    removed = 0
    for directory in Path(root or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        maker = _maker(directory)
        if maker is not None and not _running(maker):
            shutil.rmtree(directory, ignore_errors=True)
            removed += 1
    return removed


def remove_own_scratch_dir(directory: Path | None) -> None:
    """A stopping worker removes its metric files' directory if this process made it (`stoker worker`, which
    becomes the worker); one a supervisor made is the supervisor's to remove, and another name is not stoker's."""
    if directory is not None and _maker(directory) == os.getpid():
        shutil.rmtree(directory, ignore_errors=True)


def _maker(directory: Path) -> int | None:
    match = _SCRATCH_NAME.match(directory.name)
    return int(match.group(1)) if match else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has that pid now
        return True
    return True


def _file_pid(path: Path) -> int | None:
    """The writer's pid of one metric file (`counter_123.db`, `gauge_mostrecent_123.db`)."""
    stem = path.name.removesuffix(".db")
    prefix, _, pid = stem.rpartition("_")
    return int(pid) if prefix in _FOLDED and pid.isdigit() else None


def dead_files(directory: Path, running: Callable[[int], bool] = _running) -> list[Path]:
    """Metric files of processes that are gone, the accumulators excluded."""
    found = []
    for path in directory.glob("*.db"):
        pid = _file_pid(path)
        if pid is not None and pid != ACCUMULATOR_PID and not running(pid):
            found.append(path)
    return found


def compact(directory: Path, dead: Iterable[Path]) -> int:
    """Fold the given files of dead processes into the accumulators and remove them; returns how many. The caller
    holds the lock the scrapes hold: a scrape never sees a count in both places, or in neither.

    A pid the kernel gives again to a new process between the check and the fold would lose that process's later
    counts from view (it writes to a removed file): a window of milliseconds, after a whole turn of the pid space."""
    by_kind: dict[str, list[Path]] = {}
    for path in dead:
        by_kind.setdefault(path.name.removesuffix(".db").rpartition("_")[0], []).append(path)
    for kind, paths in by_kind.items():
        accumulator = directory / f"{kind}_{ACCUMULATOR_PID}.db"
        values = _read(accumulator) if accumulator.exists() else {}
        for path in paths:
            _fold(values, _read(path), summed=kind in _SUMMED)
        _write_atomically(accumulator, values)
        for path in paths:
            path.unlink(missing_ok=True)
    return sum(len(paths) for paths in by_kind.values())


def _read(path: Path) -> dict[str, tuple[float, float]]:
    return {
        key: (value, stamp)
        for key, value, stamp, _ in MmapedDict.read_all_values_from_file(str(path))  # type: ignore[no-untyped-call]
    }


def _fold(into: dict[str, tuple[float, float]], values: dict[str, tuple[float, float]], summed: bool) -> None:
    """Counters, histograms' buckets and sums add up; a most-recent gauge keeps its latest write."""
    for key, (value, stamp) in values.items():
        old_value, old_stamp = into.get(key, (0.0, 0.0))
        if summed:
            into[key] = (old_value + value, max(old_stamp, stamp))
        elif stamp >= old_stamp:
            into[key] = (value, stamp)


def _write_atomically(path: Path, values: dict[str, tuple[float, float]]) -> None:
    """The accumulator written whole beside its place (a name no scrape reads), then moved over it."""
    partial = path.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    file = MmapedDict(str(partial))  # type: ignore[no-untyped-call]
    try:
        for key, (value, stamp) in values.items():
            file.write_value(key, value, stamp)  # type: ignore[no-untyped-call]
    finally:
        file.close()  # type: ignore[no-untyped-call]
    partial.replace(path)


class CompactingCollector(Collector):
    """prometheus-client's multiprocess collector over one worker's directory, which first folds the files of dead
    pool children once enough have gathered; scrapes and folds take turns (one lock)."""

    def __init__(self, directory: Path, compact_after: int = COMPACT_AFTER) -> None:
        self.directory = directory
        self.compact_after = compact_after
        self._merged = MultiProcessCollector(None, path=str(directory))  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()

    def collect(self) -> list[Metric]:
        """Every process's metrics, merged (the dead ones' from the accumulators)."""
        with self._lock:
            dead = dead_files(self.directory)
            if len(dead) >= self.compact_after:
                log.debug("folded %d metric files of exited processes", compact(self.directory, dead))
            return list(self._merged.collect())  # type: ignore[no-untyped-call]


class JobCounts(Collector):
    """Jobs accepted and finished by status, across the whole deployment (counted in Redis)."""

    def __init__(self, read: object) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        """Read the counters at scrape time."""
        family = CounterMetricFamily("stoker_jobs", "Jobs by status, all API and worker processes.", labels=["status"])
        try:
            counts = self.read()  # type: ignore[operator]
        except Exception:  # the store is away: the scrape still answers
            counts = {}
        for status, value in sorted(counts.items()):
            family.add_metric([status], float(value))
        yield family


class BatchLines(Collector):
    """Batch lines (jobs of class `batch`) across the deployment, from the store at scrape time: fed, completed and
    failed (counters), waiting to be fed and in the pipeline (gauges)."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Read the counts at scrape time."""
        done = CounterMetricFamily("stoker_batch_lines", "Batch lines fed, completed, failed.", labels=["outcome"])
        queued = GaugeMetricFamily("stoker_batch_lines_queued", "Batch lines waiting or in flight.", labels=["state"])
        try:
            counts = self.read()
        except Exception:  # the store is away: the scrape still answers
            counts = {}
        for outcome in ("fed", "completed", "failed"):
            done.add_metric([outcome], float(counts.get(outcome, 0)))
        for state in ("waiting", "in_flight"):
            queued.add_metric([state], float(counts.get(state, 0)))
        yield done
        yield queued


class DeviceClock:
    """Busy time of the device in this process: batches begin and end; `take` reads the busy seconds since the last
    call (a batch still running counts up to now)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
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
