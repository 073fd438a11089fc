"""A stoker stack on a Valkey of its own, for tests that kill, stop or reconfigure its processes."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.app import create_app
from api.context import ApiContext, context_of
from stoker.settings import ApiSettings, CommonSettings
from tasks.app import make_app
from tasks.pipeline import Submitter
from workers.broker import start_embedded
from workers.procs import spawn, tail, wait_for

KINDS = ("cpu", "infer")

#: Settings for stacks whose tests kill things: a dead worker's messages come back after 20 s, a lost inference
#: message is re-sent after 30 (every hard limit kept under the visibility timeout, as settings require).
QUICK_RECOVERY = {
    "STOKER_VISIBILITY_TIMEOUT_S": "20",
    "STOKER_TRANSCRIBE_SOFT_S": "12",
    "STOKER_TRANSCRIBE_HARD_S": "15",
    "STOKER_INFER_BATCH_TIMEOUT_S": "12",
    "STOKER_INFER_WEDGE_GRACE_S": "5",
    "STOKER_REDRIVE_AFTER_S": "30",
    "STOKER_HANDOFF_MAX_WAIT_S": "10",
}
#: The same for stacks on the simulated device whose stages see only small pictures and text: a dead worker's
#: messages come back after 10 s, a lost inference message is re-sent after 10 (every stage's hard limit under
#: the visibility timeout, the device's batches far under theirs).
SIM_RECOVERY = {
    **QUICK_RECOVERY,
    "STOKER_VISIBILITY_TIMEOUT_S": "10",
    **{f"STOKER_{stage}_SOFT_S": "6" for stage in ("OCR", "KEYFRAMES", "FETCH", "TRANSCRIBE")},
    **{f"STOKER_{stage}_HARD_S": "8" for stage in ("OCR", "KEYFRAMES", "FETCH", "TRANSCRIBE")},
    "STOKER_INFER_BATCH_TIMEOUT_S": "4",
    "STOKER_INFER_WEDGE_GRACE_S": "2",
    "STOKER_HANDOFF_MAX_WAIT_S": "5",
    "STOKER_REDRIVE_AFTER_S": "10",
}


@dataclass
class Fleet:
    """Valkey, workers, a reaper and an API, each replaceable by a test."""

    root: Path
    port: int
    env: dict[str, str]
    app: Celery
    client: TestClient
    valkey: subprocess.Popen[bytes]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, kind: str, **env: str) -> None:
        """Start (or replace) a worker or the reaper, with optional extra settings."""
        args = ["reaper"] if kind == "reaper" else ["worker", kind]
        log = self.root / f"{kind}.log"
        if log.exists():  # a replaced process's log is kept beside its successor's, for a failure's post-mortem
            log.rename(log.with_suffix(f".{time.time_ns()}.log"))
        self.procs[kind] = spawn(args, {**self.env, **env}, log)

    def kill(self, kind: str, sig: int = signal.SIGKILL) -> None:
        """Signal a worker's whole process group (SIGKILL: parent and pool children, no goodbye) and reap it."""
        os.killpg(self.procs[kind].pid, sig)
        self.procs[kind].wait(30)

    def wait_workers(self, kinds: tuple[str, ...] = KINDS) -> None:
        """Until every named worker answers a ping."""

        def answer() -> bool:
            # A fresh connection each time: pooled ones may date from before a Redis restart. The ping returns as
            # soon as every worker process of the fleet has answered, instead of always waiting out its timeout.
            running = sum(1 for k, p in self.procs.items() if k != "reaper" and p.poll() is None)
            with self.app.connection_for_write() as connection:
                replies = self.app.control.ping(timeout=0.5, limit=max(running, 1), connection=connection)
            return set(kinds) <= {n.split("@")[0] for reply in replies for n in reply}

        wait_for(answer, 180, f"workers {kinds}", [self.procs[k] for k in kinds])

    def api(self, submitter: Submitter | None = None, **settings: Any) -> TestClient:
        """Another API on this fleet, with other settings (enter it as a context manager); its Celery producer
        from these settings unless a `submitter` is given."""
        urls = {k: self.env[f"STOKER_{k.upper()}"] for k in ("broker_url", "result_url", "cache_url")}
        chosen = ApiSettings(**{**urls, **settings})
        return TestClient(create_app(chosen, submitter=submitter))

    def store(self) -> redis.Redis[bytes]:
        """A client on the fleet's job store."""
        return redis.Redis.from_url(self.env["STOKER_RESULT_URL"])

    def logs(self) -> str:
        """The end of every log, for failure messages."""
        return "\n".join(f"--- {k}\n{tail(self.root / f'{k}.log')}" for k in self.procs)


def client_context(client: TestClient) -> ApiContext:
    """The context of the app a TestClient drives (Starlette types `client.app` as any ASGI app)."""
    app = client.app
    assert isinstance(app, FastAPI), app
    return context_of(app)


@contextmanager
def own_fleet(
    settings: dict[str, str], kinds: tuple[str, ...] = KINDS, api: dict[str, Any] | None = None
) -> Iterator[Fleet]:
    """Valkey (AOF) on a free port, the given workers and a reaper, and an API in this process (with `api`
    settings on top of the fleet's addresses)."""
    root = Path(tempfile.mkdtemp(prefix="stoker-fleet-"))
    valkey, port = start_embedded(data_dir=root)
    base = f"redis://127.0.0.1:{port}"
    env = {
        **os.environ,
        "STOKER_BROKER_URL": f"{base}/0",
        "STOKER_RESULT_URL": f"{base}/1",
        "STOKER_CACHE_URL": f"{base}/2",
        "STOKER_METRICS_PORT": "0",
        **settings,
    }
    app = make_app(CommonSettings(broker_url=env["STOKER_BROKER_URL"], result_url=env["STOKER_RESULT_URL"]))
    crew = Fleet(root, port, env, app, None, valkey)  # type: ignore[arg-type]
    try:
        with crew.api(**(api or {})) as client:
            crew.client = client
            for kind in (*kinds, "reaper"):
                crew.start(kind)
            crew.wait_workers(kinds)
            yield crew
    except Exception as exc:
        raise RuntimeError(crew.logs()) from exc
    finally:
        kill_all(list(crew.procs.values()))
        crew.valkey.kill()
        crew.valkey.wait(10)


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every process group (a worker with its pool children) and reap them: the end of a test stack, which
    owes nobody a clean goodbye (the tests of clean stops stop their own processes)."""
    for proc in procs:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait(30)
