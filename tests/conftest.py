"""Test tiers by folder, and one real Redis for every test that needs one (started here if none answers)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import redis

from stoker.adapters.kombu_redis import priority_keys
from stoker.adapters.store.clients import redis_answers
from workers.broker import start_embedded

TIERS = ("unit", "integration", "e2e")
#: Fixtures whose tests run in the `real-model` group: the session's workers and `stoker up`'s stack (the real
#: model out of the test process), and the fleet that some of those tests share with lighter ones (`vlm_fleet`:
#: in one group, it starts once).
REAL_MODEL_FIXTURES = frozenset({"session_workers", "real_stack", "vlm_fleet"})
#: A session fleet its tests share across files: they form one group, so it starts on one process only.
SHARED_FLEETS = ("one_at_a_time",)
_embedded: list[subprocess.Popen[bytes]] = []

#: Redis databases the suite owns; the default stack uses 0 and 1.
TEST_DBS = {"integration": (12, 13, 11), "e2e": (14, 15, 10)}


def pytest_configure(config: pytest.Config) -> None:
    """Point every process the tests start at a Redis that answers, before any stoker module reads settings.

    Under pytest-xdist (`make test` runs the files on parallel workers) the first worker uses that Redis and each
    other worker a private one it starts, so no two workers share a database."""
    base = os.environ.get("STOKER_TEST_REDIS", "redis://127.0.0.1:6379")
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or not redis_answers(f"{base}/0"):
        proc, port = start_embedded(persist=False)
        _embedded.append(proc)
        base = f"redis://127.0.0.1:{port}"
    os.environ["STOKER_TEST_REDIS"] = base
    broker_db, store_db, cache_db = TEST_DBS["integration"]
    os.environ["STOKER_BROKER_URL"] = f"{base}/{broker_db}"
    os.environ["STOKER_RESULT_URL"] = f"{base}/{store_db}"
    os.environ["STOKER_CACHE_URL"] = f"{base}/{cache_db}"
    # The two test groups (`make test`) share two cores with every stack they start: a model's second torch thread
    # would only spin while waiting for a core (about 40 % more CPU per answer, measured, and no faster).
    os.environ.setdefault("STOKER_TORCH_THREADS", "1")
    # Short answers keep the suite fast on CPU; every test still checks that the model answered.
    os.environ.setdefault("STOKER_MAX_NEW_TOKENS", "8")
    os.environ.setdefault("STOKER_MAX_TOKENS_CAP", "8")  # what a chat without max_tokens may get
    # The API requires keys by default; tests of auth and tenants build their apps with auth=True themselves.
    os.environ["STOKER_AUTH"] = "off"
    # Apps built in this process serve no metrics listener unless a test gives one a port (many run at once).
    os.environ["STOKER_API_METRICS_PORT"] = "0"


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the Redis this session started, if any."""
    for proc in _embedded:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier, from the folder it lives in, and with its pytest-xdist group (`make test`,
    `--dist loadgroup`: a group runs on one process, in order; a process takes the next group when it runs out).

    `real-model`: every test on the session's workers or on the end-to-end stack (`stoker up` with the real model),
    and files marked `real_model` (the model in the test process). They run the real model and tesseract, which
    two at once on two cores would starve past the tests' time limits, so they are one group, in one process.
    Every other test (stacks of their own on the simulated device, mostly waiting on timeouts, or none) is in a
    group of its file's, `apart-…`, or of the session fleet it shares with other files: the other process takes
    these one after another, and the first process takes the rest once the real model's group is done."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        tier = next((tier for tier in TIERS if tier in parts), "other")
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        item.add_marker(pytest.mark.xdist_group(_group(item, tier, set(getattr(item, "fixturenames", ())))))


def _group(item: pytest.Item, tier: str, fixtures: set[str]) -> str:
    """The test's pytest-xdist group (see `pytest_collection_modifyitems`)."""
    if fixtures & REAL_MODEL_FIXTURES or item.get_closest_marker("real_model") is not None:
        return "real-model"
    shared = next((fleet for fleet in SHARED_FLEETS if fleet in fixtures), None)
    if shared is not None:
        return f"apart-{shared}"
    return f"apart-{tier}-{item.path.stem}"


class _Environments:
    """The environment the real-model group's fixtures set up (its session's workers and the apps beside them write
    spans to a file, allow the URL tests' host, …) is that group's alone. A process that goes on to other tests
    (it takes other groups once the real model's is done; a one-process run interleaves them) gives them the
    environment it had before the group began, and gives the group its own back if it comes back to it."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.saved: dict[str, dict[str, str]] = {}

    def enter(self, item: pytest.Item) -> None:
        """Before `item` is set up (its fixtures included): the environment of its kind of group."""
        kind = "real-model" if _group_of(item) == "real-model" else "apart"
        if self.kind is not None and kind != self.kind:
            current = self.saved[self.kind] = dict(os.environ)
            os.environ.clear()
            os.environ.update(self.saved.get(kind, current))  # a group met for the first time: as things are
        if kind == "real-model" and "apart" not in self.saved:
            self.saved["apart"] = dict(os.environ)  # the environment from before the real model's group began
        self.kind = kind


_ENVIRONMENTS = _Environments()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each test in its group's environment (`_Environments`)."""
    _ENVIRONMENTS.enter(item)


def _group_of(item: pytest.Item) -> str:
    marker = item.get_closest_marker("xdist_group")
    return str(marker.args[0]) if marker is not None and marker.args else ""


def missing(reason: str) -> None:
    """A test's prerequisite is missing: skip on a developer's machine, fail under CI (which runs as root and can
    install what it needs), so no promise goes untested there in silence."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: it must be there)")
    pytest.skip(reason)


def pids_named(command: str, under: int) -> list[int]:
    """The processes running `command` (their comm) below process `under`, e.g. the tesseracts a CPU worker's pool
    started (not those of another test's workers running meanwhile)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == command and under in _ancestors(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _ancestors(pid: int) -> list[int]:
    """pid's parent, its parent, … up to init."""
    chain = []
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state; comm may hold ")" or spaces
        chain.append(pid)
    return chain


@pytest.fixture(scope="session")
def tiny_vlm() -> Path:
    """The SmolVLM-shaped test model, as `make test` builds it into the model cache (`stoker model make-tiny-vlm`)."""
    from stoker.adapters.backends.tinyvlm import tiny_vlm_path
    from stoker.settings import CommonSettings

    path = tiny_vlm_path(CommonSettings().model_cache)
    if not (path / "model.safetensors").exists():
        missing(f"the tiny VLM is not built in {path}: run `make tiny-vlm`")
    return path


def queued(broker: redis.Redis[bytes], queue: str) -> int:
    """Messages waiting in a stage queue on a Redis broker: every priority step's list together."""
    return sum(int(broker.llen(key)) for key in priority_keys(queue))
