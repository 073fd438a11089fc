"""The whole stack as a user runs it: `stoker up`, then HTTP and `stoker submit`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import TEST_DBS
from tests.media import speech_wav, text_image, to_mp3
from workers.broker import free_port
from workers.procs import ROOT, running, spawn, stop, tail, wait_for

TERMINAL = {"succeeded", "degraded", "failed"}


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


FLOWER_PORT = free_port()
FLOWER_AUTH = ("operator", "s3cret-for-tests")


def _free_run(length: int) -> int:
    """The first of `length` consecutive free ports (the workers' metrics ports, then the API's)."""
    for _ in range(50):
        first = free_port()
        if first + length <= 65535 and all(_bindable(first + i) for i in range(length)):
            return first
    raise RuntimeError(f"no {length} consecutive free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def _start_stack(env: dict[str, str], log: Path, flower_port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **env,
        "STOKER_PORT": str(port),
        "STOKER_FLOWER_PORT": str(flower_port or free_port()),
        "STOKER_METRICS_BASE_PORT": str(_free_run(4)),
    }
    proc = spawn(["up"], env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: "stoker is ready" in log.read_text(errors="replace"), 240, "stoker up", [proc])
    except (TimeoutError, RuntimeError) as exc:
        stop(proc, signal.SIGINT)
        raise RuntimeError(f"{exc}\n{tail(log)}") from exc
    return proc, base


#: The module's `stoker up` process and its log, for tests that act on the supervisor itself.
SUPERVISOR: dict[str, Any] = {}


@pytest.fixture(scope="module")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`stoker up` against the machine's Redis, on databases of its own."""
    redis_base = os.environ["STOKER_TEST_REDIS"]
    broker_db, store_db, cache_db = TEST_DBS["e2e"]
    for db in (broker_db, store_db, cache_db):
        with redis.Redis.from_url(f"{redis_base}/{db}") as client:
            client.flushdb()
    env = {
        **os.environ,
        "STOKER_BROKER_URL": f"{redis_base}/{broker_db}",
        "STOKER_RESULT_URL": f"{redis_base}/{store_db}",
        "STOKER_CACHE_URL": f"{redis_base}/{cache_db}",
        "STOKER_FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH),
        "STOKER_MAX_TOKENS_CAP": "32",  # the README's snippet asks for 32
    }
    log = tmp_path_factory.mktemp("stack") / "up.log"
    proc, base = _start_stack(env, log, FLOWER_PORT)
    SUPERVISOR.update(proc=proc, log=log)
    yield base
    assert stop(proc, signal.SIGINT, grace_s=60) == 0, tail(log)
    assert not _ready(base), "the API outlived stoker up"


def _poll(base: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job: dict[str, Any] = httpx.get(f"{base}/v1/jobs/{job_id}", params={"wait": 10}, timeout=30).json()
        if job["status"] in TERMINAL:
            return job
    raise AssertionError(f"job {job_id} did not finish")


def test_invoice_image_is_read_and_answered(real_stack: str) -> None:
    response = httpx.post(
        f"{real_stack}/v1/jobs",
        data={"prompt": "What is the invoice number in the image?"},
        files=[("image", ("invoice.png", text_image("INVOICE 4711"), "image/png"))],
        timeout=30,
    )
    assert response.status_code == 202, response.text
    job = _poll(real_stack, response.json()["id"])
    assert job["status"] == "succeeded", job
    assert "INVOICE" in job["inputs"][0]["text"]
    assert "4711" in job["inputs"][0]["text"]
    assert job["result"]["text"].strip()
    assert job["result"]["model"] == "smollm2-135m-instruct"
    assert job["result"]["completion_tokens"] > 0


def test_flower_watches_the_workers(real_stack: str) -> None:
    flower = f"http://127.0.0.1:{FLOWER_PORT}"
    assert httpx.get(f"{flower}/api/workers", timeout=10).status_code == 401
    response = httpx.get(f"{flower}/api/workers", params={"refresh": "true"}, auth=FLOWER_AUTH, timeout=30)
    assert response.status_code == 200
    workers = response.json()
    assert {name.split("@")[0] for name in workers} >= {"cpu", "infer"}  # one CPU pool serves speech too


def test_the_readmes_python_snippets_run_as_written(real_stack: str, tmp_path: Path) -> None:
    snippets = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert snippets
    (tmp_path / "invoice.png").write_bytes(text_image("INVOICE 4711"))
    catalogue = re.search(r"cat > catalogue.jsonl <<'JSONL'\n(.*?)JSONL\n", (ROOT / "README.md").read_text(), re.S)
    assert catalogue  # the batch file the README writes, as its shell snippet writes it
    (tmp_path / "catalogue.jsonl").write_text(catalogue.group(1))
    printed = []
    for snippet in snippets:
        code = snippet.replace("http://127.0.0.1:8000", real_stack)  # the only change: where this stack listens
        argv = [sys.executable, "-c", code]
        out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
        assert out.returncode == 0, out.stderr
        printed.append(out.stdout)
    chat, batch = printed
    assert "4711" in chat  # the stoker object's account of the picture
    rows = [json.loads(line) for line in batch.splitlines()]
    assert sorted(row["custom_id"] for row in rows) == ["sku-1", "sku-2"]  # the batch's output, a line each
    assert all(row["response"]["status_code"] == 200 for row in rows)


def _banner_command(path: Path) -> list[str]:
    """The command `stoker up` offers to try, as a user pastes it (a real picture for its IMAGE.png)."""
    line = next(line for line in SUPERVISOR["log"].read_text().splitlines() if "try:" in line)
    pasted = shlex.split(line.split("try:", 1)[1])
    assert pasted[0] == "stoker"
    return [sys.executable, "-m", "stoker.cli", *(str(path) if word == "IMAGE.png" else word for word in pasted[1:])]


def _submit_cli(base: str, path: Path, prompt: str) -> subprocess.CompletedProcess[str]:
    """Run `stoker submit` against the stack, as a user would."""
    argv = [sys.executable, "-m", "stoker.cli", "submit", str(path), "--prompt", prompt, "--url", base]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)


def test_submit_command_prints_the_answer_and_timings(real_stack: str, tmp_path: Path) -> None:
    image = tmp_path / "receipt.png"
    image.write_bytes(text_image("RECEIPT 2024"))
    argv = _banner_command(image)
    assert argv[argv.index("--api") + 1] == real_stack
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "status succeeded" in out.stdout
    assert "RECEIPT" in out.stdout
    assert "answer" in out.stdout
    assert "ocr" in out.stdout
    assert "total" in out.stdout


def test_submit_command_prints_a_transcript_and_an_answer(real_stack: str, tmp_path: Path) -> None:
    speech = tmp_path / "speech.mp3"
    speech.write_bytes(to_mp3(speech_wav()))
    out = _submit_cli(real_stack, speech, "Who gets the report?")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "transcript:" in out.stdout
    assert "quarterly" in out.stdout.lower()
    assert "answer" in out.stdout
    assert "transcribe" in out.stdout


def _descendants(pid: int) -> set[int]:
    """Every process below pid (children in sessions of their own included: they keep their parent)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return "?"


def test_up_starts_an_embedded_broker_and_nothing_it_started_outlives_it(tmp_path: Path) -> None:
    """No broker answers: `stoker up` starts embedded Valkeys (the broker and store's, the cache's) and serves a job
    with them. A second stack on its port is told which port; a SIGKILL of the supervisor takes every process it
    started with it. (The module's own stack shows the clean stop, Ctrl-C, exit 0.)"""
    nobody = f"redis://127.0.0.1:{free_port()}"  # the embedded broker is one more child that must not outlive it
    env = {
        **os.environ,
        "STOKER_BROKER_URL": f"{nobody}/0",
        "STOKER_RESULT_URL": f"{nobody}/1",
        "STOKER_CACHE_URL": f"{nobody}/2",
        "STOKER_BACKEND": "sim",  # what is under test is the supervisor and its children, not the model
    }
    proc, base = _start_stack(env, tmp_path / "up.log")
    started: set[int] = set()
    try:
        log = (tmp_path / "up.log").read_text()
        said = " ".join(log.split())  # the console wraps its lines
        assert "an embedded Valkey for the broker and store" in said
        assert "an embedded Valkey for it (allkeys-lru)" in said  # the cache on a server of its own, which evicts
        assert f"cache    {nobody}/2" not in log
        # A stack in service (its workers' children warm, models loaded), not one still starting up.
        response = httpx.post(f"{base}/v1/jobs", data={"prompt": "Say hi."}, timeout=30)
        assert response.status_code == 202
        assert _poll(base, response.json()["id"])["status"] == "succeeded"
        started = _descendants(proc.pid)
        names = {_cmdline(pid) for pid in started}
        assert any("stoker.cli api" in name for name in names), names
        assert sum("celery" in name and " worker " in name for name in names) >= 2, names  # CPU pool, inference
        valkeys = [pid for pid in started if "valkey-server" in _cmdline(pid)]
        data_dirs = [Path(f"/proc/{pid}/cwd").resolve() for pid in valkeys]  # each works in its --dir
        assert sorted(d.name.startswith("stoker-valkey-cache-") for d in data_dirs) == [False, True], data_dirs
        assert all(d.name.startswith("stoker-valkey-") for d in data_dirs), data_dirs  # the store's, the cache's
        assert [list(d.iterdir()) for d in data_dirs] == [[], []]  # job records and uploads live in memory only
        # A second stack with the same API port is told which port, before it starts anything.
        port = base.rsplit(":", 1)[1]
        second = subprocess.run(
            [sys.executable, "-m", "stoker.cli", "up", "--port", port],
            cwd=ROOT,
            env={**env, "STOKER_FLOWER_PORT": str(free_port()), "STOKER_METRICS_BASE_PORT": str(_free_run(4))},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert second.returncode != 0
        assert f"port {port} (the API) is in use" in second.stderr, second.stderr
        proc.send_signal(signal.SIGKILL)  # no goodbye: the supervisor cannot stop anything itself
        proc.wait(timeout=10)
        try:
            wait_for(lambda: not [pid for pid in started if running(pid)], 10, "the stack's processes to die", [])
        except TimeoutError as exc:
            left = {pid: _cmdline(pid) for pid in started if running(pid)}
            raise AssertionError(f"still running: {left}") from exc
        assert [list(d.rglob("*")) for d in data_dirs] == [[], []]  # even killed, it left none of its jobs on disk
    finally:
        for pid in (pid for pid in started if running(pid)):  # only if the test failed: leave nothing behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stop(proc, signal.SIGINT)
    assert not _ready(base)


def test_up_replaces_a_worker_that_exited(real_stack: str) -> None:
    proc, log = SUPERVISOR["proc"], SUPERVISOR["log"]
    workers = [pid for pid in _descendants(proc.pid) if "cpu@" in _cmdline(pid) and _parent(pid) == proc.pid]
    assert len(workers) == 1, [_cmdline(pid) for pid in _descendants(proc.pid)]
    os.killpg(workers[0], signal.SIGKILL)  # the worker and its pool children, without a word
    wait_for(lambda: "cpu-worker exited (-9); started a new one" in log.read_text(), 30, "a replacement", [proc])
    files = [("image", ("scan.png", text_image("REPLACED 8"), "image/png"))]
    response = httpx.post(f"{real_stack}/v1/jobs", data={"prompt": "What does it say?"}, files=files, timeout=30)
    job = _poll(real_stack, response.json()["id"])  # read by the new worker
    assert job["status"] == "succeeded", job
    assert "REPLACED" in job["inputs"][0]["text"]
    assert proc.poll() is None  # the stack carried on


def _parent(pid: int) -> int:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return 0
