"""Prometheus metrics: what every stoker process exports, and how.

Workers run in multiprocess mode (prefork children write to `PROMETHEUS_MULTIPROC_DIR`, the worker's parent serves
the merged view on its metrics port); the API serves its own registry, plus cluster-wide job counts read from Redis
at scrape time, on a listener of its own (`STOKER_API_METRICS_PORT`), never on the public API port. Every metrics
listener binds to `STOKER_METRICS_HOST` (127.0.0.1 unless a deployment opens it to its scraper).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from stoker.adapters.metricfiles import CompactingCollector

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
ASR_LOOKAHEAD = Counter(
    "stoker_asr_lookahead_decodes_total",
    "Fallback tries of the speech model started ahead on its second replica, and those faster-whisper then took.",
    ["outcome"],
)
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
OPENAI_GENERATE_FALLBACKS = Counter(
    "stoker_openai_generate_fallbacks_total",
    "Requests the `openai` backend sent as chat completions because its server answered 404 for "
    "/inference/v1/generate (`STOKER_OPENAI_PROTOCOL=auto`; the rest of the process's requests go there at once).",
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


class OpenAIBatchLines(Collector):
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
