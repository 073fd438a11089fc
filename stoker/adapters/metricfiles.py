"""A worker's metric files (prometheus-client's multiprocess mode): the directory each worker gets, the files its
pool children leave when they exit, and the collector that serves them merged.

prometheus-client writes one file per metric type and process, and its collector reads every file on every
scrape. A CPU worker recycles its pool children (every `max_tasks_per_child` tasks), so the files of dead children
pile up for as long as the worker lives, and every scrape grows slower (prometheus/client_python#367). The library
leaves them by design: deleting them would make counters go back. No library folds them, so this module does: a
dead process's counts are added into an accumulator file (pid 0, a name the collector reads like any other) and its
own files removed, under the lock every scrape holds.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

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


def _kind_and_pid(path: Path) -> tuple[str, int | None]:
    """A metric file's kind and its writer's pid (`counter_123.db`, `gauge_mostrecent_123.db`); None for a pid
    where the file is not one this module folds."""
    kind, _, pid = path.name.removesuffix(".db").rpartition("_")
    return kind, int(pid) if kind in _FOLDED and pid.isdigit() else None


def dead_files(directory: Path, running: Callable[[int], bool] = _running) -> list[Path]:
    """Metric files of processes that are gone, the accumulators excluded."""
    found = []
    for path in directory.glob("*.db"):
        _, pid = _kind_and_pid(path)
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
        by_kind.setdefault(_kind_and_pid(path)[0], []).append(path)
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


def forget_process(pid: int, directory: Path | None) -> None:
    """A pool child exited: drop its live gauges from the merged view (kept in directory)."""
    if directory:
        mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
