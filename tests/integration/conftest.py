"""Real Redis, real `celery worker` processes, and the API app in this process."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from stoker.core.jobs import InputRecord
from tasks.pipeline import Submitter
from tests.fakeopenai import FakeServer, fake_openai_server
from tests.fleet import Fleet, kill_all, own_fleet
from workers.broker import free_port
from workers.procs import spawn, stop, tail, wait_for

#: A loopback address of the suite's own that the workers may fetch from (test_urls.py serves media there); every
#: other private address stays refused, 127.0.0.1 included.
URL_TEST_HOST = "127.0.0.2"


#: The most new tokens the session's workers give an answer.
ROOMY_TOKENS = 64


@pytest.fixture(scope="session")
def store_redis() -> Iterator[redis.Redis[bytes]]:
    """The test store database, flushed at start."""
    client = redis.Redis.from_url(os.environ["STOKER_RESULT_URL"])
    others = [redis.Redis.from_url(os.environ[v]) for v in ("STOKER_BROKER_URL", "STOKER_CACHE_URL")]
    for db in (client, *others):
        db.flushdb()
    yield client
    for db in (client, *others):
        db.close()


@dataclass(frozen=True)
class SessionWorkers:
    """The session's worker processes, and each one's log."""

    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]


@pytest.fixture(scope="session")
def session_workers(
    store_redis: redis.Redis[bytes], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SessionWorkers]:
    """A CPU worker (prefork: every CPU stage, speech included, as `stoker up` runs it), an inference worker and
    the reaper, as real processes."""
    from tasks.worker import app

    logs = tmp_path_factory.mktemp("workers")
    # Every span of every process (these workers and the API in this process) lands in one JSON-lines file.
    os.environ["STOKER_TRACE_EXPORTER"] = "file"
    os.environ["STOKER_TRACE_FILE"] = str(logs / "spans.jsonl")
    os.environ.setdefault("STOKER_URL_ALLOWLIST", URL_TEST_HOST)
    os.environ.setdefault("STOKER_CALLBACK_BACKOFF_S", "0.5")  # a retried callback's waits: 0.5 s, 1 s, …
    # The workers allow an answer room for a whole tool call or JSON object (the tests of tools and structured
    # outputs ask for it, through an API of their own that allows it); every other test's API still caps a chat at
    # STOKER_MAX_TOKENS_CAP, and a job without max_tokens still gets STOKER_MAX_NEW_TOKENS.
    # The reaper lifts no stage message past smaller ones within a test (a test holds queues to see their order).
    # Each CPU child loads the speech model as it starts (`STOKER_ASR_PRELOAD`), as the tests of speech expect.
    # A recording's own limit gets a roomier base than the default 10 s: beside the other group's stacks on a slow
    # host, a 6 s recording has taken most of the default's 16 s (the limit's own tests are unit tests).
    env = {
        **os.environ,
        "STOKER_MAX_TOKENS_CAP": str(ROOMY_TOKENS),
        "STOKER_SMALL_FIRST_MAX_AGE_S": "60",
        "STOKER_ASR_PRELOAD": "true",
        "STOKER_TRANSCRIBE_BASE_S": "40",
        # Decoding gets room as well: a 48-megapixel JPEG beside the other group's stacks once took over 3 s.
        "STOKER_DECODE_SOFT_S": "10",
        "STOKER_DECODE_HARD_S": "15",
        # A dense test page is cut into as many bands on any host (by default the count follows the host's cores).
        "STOKER_OCR_BANDS": "3",
    }
    ports = {kind: free_port() for kind in ("cpu", "infer")}
    procs = {
        kind: spawn(["worker", kind, *extra], {**env, "STOKER_METRICS_PORT": str(ports[kind])}, logs / f"{kind}.log")
        for kind, extra in (("cpu", ["--concurrency", "3"]), ("infer", []))
    }

    def all_answer() -> bool:
        # Back as soon as both workers answered, instead of always waiting out the ping's timeout.
        names = {name.split("@")[0] for reply in app.control.ping(timeout=0.5, limit=2) for name in reply}
        return set(procs) - {"reaper"} <= names

    procs["reaper"] = spawn(["reaper"], env, logs / "reaper.log")
    try:
        wait_for(all_answer, 180, "workers", list(procs.values()))
    except (TimeoutError, RuntimeError) as exc:
        details = "\n".join(f"--- {k}\n{tail(logs / f'{k}.log')}" for k in procs)
        for proc in procs.values():
            stop(proc)
        raise RuntimeError(f"{exc}\n{details}") from exc
    os.environ["STOKER_TEST_METRICS"] = ",".join(f"{k}={v}" for k, v in ports.items())
    yield SessionWorkers(procs, {k: logs / f"{k}.log" for k in procs})
    kill_all(list(procs.values()))


@pytest.fixture(scope="session")
def workers(session_workers: SessionWorkers) -> dict[str, Path]:
    """The session's workers, as their logs."""
    return session_workers.logs


class SpySubmitter(Submitter):
    """Records submissions and passes them on to Celery (or nowhere); from the API's loop, in a worker thread (the
    seam's default)."""

    def __init__(self, forward: bool = True) -> None:
        from stoker.settings import CommonSettings
        from tasks.app import make_app
        from tasks.pipeline import CelerySubmitter

        self.calls: list[tuple[str, list[InputRecord]]] = []
        self.starts: dict[str, str] = {}
        self._next = CelerySubmitter(make_app(CommonSettings())) if forward else None

    def submit(
        self,
        job_id: str,
        inputs: Any,
        start: Any = "preprocess",
        deadline: float | None = None,
        prompt_tokens: int | None = None,
        job_class: Any = "interactive",
    ) -> None:
        """Record, then forward."""
        self.calls.append((job_id, list(inputs)))
        self.starts[job_id] = start
        if self._next:
            self._next.submit(job_id, inputs, start, deadline, prompt_tokens, job_class)


@pytest.fixture
def spy() -> SpySubmitter:
    """A submitter that records what was enqueued."""
    return SpySubmitter()


@pytest.fixture
def client(workers: dict[str, Path], spy: SpySubmitter) -> Iterator[TestClient]:
    """The API, in this process, submitting to the real workers."""
    from api.app import create_app
    from stoker.settings import ApiSettings

    with TestClient(create_app(ApiSettings(), submitter=spy)) as test_client:
        yield test_client


@pytest.fixture(scope="session")
def one_at_a_time() -> Iterator[Fleet]:
    """CPU and inference workers on a simulated device that runs one job at a time, for a second: a test can hold
    the device with one job and act while others wait for it. One fleet for every such test."""
    settings = {"STOKER_BACKEND": "sim", "STOKER_SIM_BASE_MS": "1000", "STOKER_MAX_BATCH_SIZE": "1"}
    with own_fleet(settings, kinds=("cpu", "infer")) as fleet:
        yield fleet


@pytest.fixture(scope="session")
def vlm_fleet(tiny_vlm: Path) -> Iterator[tuple[FakeServer, Fleet]]:
    """The fake OpenAI-compatible server, and a fleet whose inference worker is the `openai` backend pointed at it,
    serving the tiny VLM (`STOKER_MODEL`: its image processor prepares the pictures, its processor's template builds
    the prompts; OCR `auto`, so off), with a context long enough for four pictures. One fleet for every test of the
    image path with a model that sees."""
    with fake_openai_server() as fake:
        settings = {
            "STOKER_BACKEND": "openai",
            "STOKER_OPENAI_BASE_URL": fake.url,
            "STOKER_OPENAI_MODEL": "vlm",
            "STOKER_MODEL": str(tiny_vlm),
            "STOKER_MAX_CONTEXT_TOKENS": "4096",
            # Decode runs the model's image processor too (resize, tile, normalise): on a CPU other tests share,
            # a picture can take longer than the default 3 s.
            "STOKER_DECODE_SOFT_S": "20",
            "STOKER_DECODE_HARD_S": "25",
        }
        with own_fleet(settings) as fleet:  # the CPU pool serves speech too
            yield fake, fleet
