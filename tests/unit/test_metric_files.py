"""A worker's metric files: its pool children's files are folded once they exit, so a long-lived worker's scrape
reads a bounded number of files with the same totals; scratch directories go with the process that made them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from stoker.adapters.metricfiles import (
    ACCUMULATOR_PID,
    SCRATCH_PREFIX,
    CompactingCollector,
    compact,
    dead_files,
    remove_own_scratch_dir,
    sweep_scratch_dirs,
)
from stoker.adapters.metrics import serve_worker_metrics
from workers.broker import free_port

#: A parent that forks `children` processes, as a prefork pool does: each counts, observes and sets a gauge once
#: (child n counts n + 1), then exits. prometheus-client reads its directory from the environment at import.
_POOL = textwrap.dedent(
    """
    import os, sys
    from prometheus_client import Counter, Gauge, Histogram
    done = Counter("done_total", "Tasks.", ["stage"])
    took = Histogram("took_seconds", "Task time.", buckets=(0.1, 1.0))
    depth = Gauge("depth", "Depth.", multiprocess_mode="mostrecent")
    for n in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            done.labels("ocr").inc(n + 1)
            took.observe(0.5)
            depth.set(float(sys.argv[2]) + n)
            os._exit(0)
        os.waitpid(pid, 0)
    """
)


def _pool(directory: Path, children: int, first_depth: int = 0) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    subprocess.run([sys.executable, "-c", _POOL, str(children), str(first_depth)], env=env, check=True)


def _scrape(collector: object) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _plain(directory: Path) -> dict[str, float]:
    return _scrape(MultiProcessCollector(None, path=str(directory)))  # type: ignore[no-untyped-call]


def test_the_files_of_exited_children_fold_into_accumulators_with_the_same_totals(tmp_path: Path) -> None:
    _pool(tmp_path, 5)
    before = _plain(tmp_path)
    assert before["done_total[('stage', 'ocr')]"] == 1 + 2 + 3 + 4 + 5
    assert len(list(tmp_path.glob("*.db"))) == 5 * 3 + 2  # three kinds per child; the parent's two unlabelled ones
    assert compact(tmp_path, dead_files(tmp_path)) == 17
    assert sorted(p.name for p in tmp_path.glob("*.db")) == [
        f"counter_{ACCUMULATOR_PID}.db",
        f"gauge_mostrecent_{ACCUMULATOR_PID}.db",
        f"histogram_{ACCUMULATOR_PID}.db",
    ]
    assert _plain(tmp_path) == before
    _pool(tmp_path, 3, first_depth=100)  # more children exit later: added to what was folded, the newest gauge wins
    compact(tmp_path, dead_files(tmp_path))
    after = _plain(tmp_path)
    assert after["done_total[('stage', 'ocr')]"] == 15 + 1 + 2 + 3
    assert after["took_seconds_count[]"] == 8
    assert after["took_seconds_bucket[('le', '1.0')]"] == 8
    assert after["took_seconds_bucket[('le', '0.1')]"] == 0
    assert after["depth[]"] == 102  # the last child's write
    assert len(list(tmp_path.glob("*.db"))) == 3


def test_a_running_process_s_files_stay_where_they_are(tmp_path: Path) -> None:
    _pool(tmp_path, 2)
    children = sorted(int(p.name.removesuffix(".db").rpartition("_")[2]) for p in tmp_path.glob("counter_*.db"))
    alive = children[0]
    dead = dead_files(tmp_path, running=lambda pid: pid == alive)
    assert len(dead) == 3 + 2  # the other child's and the parent's
    assert all(not p.name.endswith(f"_{alive}.db") for p in dead)
    compact(tmp_path, dead)
    assert len(list(tmp_path.glob(f"*_{alive}.db"))) == 3


def test_a_scrape_folds_once_enough_files_of_exited_children_gathered(tmp_path: Path) -> None:
    collector = CompactingCollector(tmp_path, compact_after=9)
    _pool(tmp_path, 2)  # eight files: not yet
    first = _scrape(collector)
    assert len(list(tmp_path.glob("*.db"))) == 8
    _pool(tmp_path, 1)  # thirteen
    second = _scrape(collector)
    assert len(list(tmp_path.glob("*.db"))) == 3
    assert second["done_total[('stage', 'ocr')]"] == first["done_total[('stage', 'ocr')]"] + 1


def test_a_worker_s_metrics_listener_folds_what_its_exited_children_left(tmp_path: Path) -> None:
    _pool(tmp_path, 6)  # 20 files, more than a listener lets gather
    port = free_port()
    stop = serve_worker_metrics(port, tmp_path, "127.0.0.1")
    assert stop is not None
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        stop()
    assert 'done_total{stage="ocr"} 21.0' in text  # 1 + 2 + ... + 6
    assert len(list(tmp_path.glob("*.db"))) == 3


def test_scratch_directories_go_with_the_process_that_made_them(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead_maker = tmp_path / f"{SCRATCH_PREFIX}cpu-{int(gone.stdout)}-abc"
    own = tmp_path / f"{SCRATCH_PREFIX}infer-{os.getpid()}-def"
    parents = tmp_path / f"{SCRATCH_PREFIX}cpu-{os.getppid()}-ghi"  # a running process made it: a supervisor, say
    someone_else = tmp_path / "stoker-metrics-by-hand"
    for directory in (dead_maker, own, parents, someone_else):
        directory.mkdir()
        (directory / "counter_1.db").write_bytes(b"")
    assert sweep_scratch_dirs(tmp_path) == 1
    assert not dead_maker.exists()
    remove_own_scratch_dir(parents)
    remove_own_scratch_dir(someone_else)
    assert parents.exists()
    assert someone_else.exists()
    remove_own_scratch_dir(own)
    assert not own.exists()
