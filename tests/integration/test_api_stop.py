"""A stopping API lets the chat answers it streams finish: a stream in flight when `stoker api` is told to stop
gets its whole answer; one whose job outlasts the stop's grace is told so (`server_stopping`, which the openai client
raises) and its job goes on to its answer, never given up as if its client had left. Real `stoker api` processes
stopped with SIGTERM, as Kubernetes and Compose stop them, in front of a simulated device slow enough to stop them
mid-stream; the official openai client."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from stoker.core.jobs import TERMINAL
from tests.fleet import Fleet, own_fleet
from tests.serving import answers
from workers.broker import free_port
from workers.procs import spawn, stop, tail, wait_for

#: The device takes this long for any batch: long enough to stop the API while a job is on it.
DEVICE_MS = 4000
DEVICE = {"STOKER_BACKEND": "sim", "STOKER_SIM_BASE_MS": str(DEVICE_MS), "STOKER_SIM_PER_ITEM_MS": "0"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """A CPU and an inference worker, on the slow simulated device."""
    with own_fleet(DEVICE) as crew:
        yield crew


def _api(fleet: Fleet, log: Path, grace_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """`stoker api` on the fleet, with this stop grace."""
    port = free_port()
    proc = spawn(["api", "--port", str(port)], {**fleet.env, "STOKER_STOP_GRACE_S": str(grace_s)}, log)
    wait_for(lambda: answers(port), 60, f"the API\n{tail(log)}", [proc])
    return proc, f"http://127.0.0.1:{port}"


def _stream(base: str) -> tuple[openai.Stream[openai.types.chat.ChatCompletionChunk], str]:
    """A streamed chat begun (its first chunk read), and its job's id."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=8, stream=True
    )
    stream = raw.parse()
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    return stream, raw.headers["x-stoker-job-id"]


def _status(fleet: Fleet, job_id: str) -> str:
    with fleet.store() as store:
        return (store.hget(f"stoker:job:{job_id}", "status") or b"").decode()


def test_a_stream_in_flight_when_the_api_stops_gets_its_whole_answer(fleet: Fleet, tmp_path: Path) -> None:
    proc, base = _api(fleet, tmp_path / "api.log", grace_s=30)
    try:
        stream, job_id = _stream(base)
        os.killpg(proc.pid, signal.SIGTERM)
        rest = list(stream)
        assert rest, "the stream ended with nothing after its first chunk"
        assert rest[-1].choices[0].finish_reason is not None  # ended as an answer ends, not cut short
        assert _status(fleet, job_id) == "succeeded"
        assert proc.wait(30) == -signal.SIGTERM  # and then the API stopped (uvicorn ends by the signal it handled)
    finally:
        stop(proc)


def test_a_stream_outlasting_the_stop_s_grace_is_told_and_its_job_goes_on(fleet: Fleet, tmp_path: Path) -> None:
    proc, base = _api(fleet, tmp_path / "api.log", grace_s=0.5)
    try:
        stream, job_id = _stream(base)
        os.killpg(proc.pid, signal.SIGTERM)
        with pytest.raises(openai.APIError) as raised:
            list(stream)
        assert raised.value.code == "server_stopping", raised.value.body
        assert proc.wait(30) == -signal.SIGTERM
        wait_for(lambda: _status(fleet, job_id) in TERMINAL, 30, "the job's end", [])
        assert _status(fleet, job_id) == "succeeded"  # not cancelled: the server left, not its client
    finally:
        stop(proc)
