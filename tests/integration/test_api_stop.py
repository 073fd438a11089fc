"""A stopping API lets the answers it waits on finish, and answers within the stop's grace those that would outlast
it: a stream in flight when `stoker api` is told to stop gets its whole answer; one whose job outlasts the grace is
told so (`server_stopping`, which the openai client raises), as is a chat answered whole, and a `?wait=` submission
gets its job as it stands (202, as when its wait passes first); every such job goes on to its answer, never given up
as if its client had left, and the API exits with every response sent. Real `stoker api` processes stopped with
SIGTERM, as Kubernetes and Compose stop them, in front of a simulated device slow enough to stop them mid-wait; the
official openai client."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest

from stoker.adapters.store.keys import job_key
from stoker.core.idempotency import RETRY_COUNT_HEADER
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
        return (store.hget(job_key(job_id), "status") or b"").decode()


T = TypeVar("T")


def _chat(client: openai.OpenAI) -> Callable[[], openai.types.chat.ChatCompletion]:
    """A chat completion, answered whole, to send."""
    model = client.models.list().data[0].id
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]
    return partial(client.chat.completions.create, model=model, messages=messages, max_tokens=8)


def _once_waiting(fleet: Fleet, request: Callable[[], T]) -> tuple[Future[T], str]:
    """The request sent from a thread of its own, once a client waits on its job (the job is marked `watched`,
    which a waiting request does before it waits), and that job's id."""
    before = _waited_jobs(fleet)
    pool = ThreadPoolExecutor(max_workers=1)
    sent = pool.submit(request)
    pool.shutdown(wait=False)  # the request goes on; the pool's thread ends with it
    wait_for(lambda: bool(_waited_jobs(fleet) - before) or sent.done(), 30, "a client waiting on its job", [])
    new = _waited_jobs(fleet) - before
    assert len(new) == 1, (new, sent.result() if sent.done() else "still waiting")
    return sent, new.pop()


def _waited_jobs(fleet: Fleet) -> set[str]:
    """Jobs a client waits on (or waited on) that have not ended."""
    with fleet.store() as store:
        keys = [k.decode() for k in store.scan_iter(match=job_key("*"), _type="hash")]
        fields = [store.hmget(k, ["watched", "status"]) for k in keys]
    prefix = len(job_key(""))
    return {
        k[prefix:]
        for k, (watched, status) in zip(keys, fields, strict=True)
        if watched and _text(status) not in TERMINAL
    }


def _text(value: bytes | None) -> str:
    assert value is not None
    return value.decode()


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


def test_a_waited_submission_outlasting_the_stop_s_grace_gets_its_job_as_it_stands(
    fleet: Fleet, tmp_path: Path
) -> None:
    proc, base = _api(fleet, tmp_path / "api.log", grace_s=0.5)
    try:
        post = partial(httpx.post, f"{base}/v1/jobs?wait=30", data={"prompt": "Say something."}, timeout=60)
        sent, job_id = _once_waiting(fleet, post)
        os.killpg(proc.pid, signal.SIGTERM)
        answer = sent.result(timeout=30)
        assert answer.status_code == 202, answer.text  # as when its wait passes first: not ended yet
        assert answer.json()["id"] == job_id
        assert answer.json()["status"] not in TERMINAL
        assert answer.headers["location"] == f"/v1/jobs/{job_id}"
        assert proc.wait(30) == -signal.SIGTERM  # every response sent, the API stopped
        wait_for(lambda: _status(fleet, job_id) in TERMINAL, 30, "the job's end", [])
        assert _status(fleet, job_id) == "succeeded"
    finally:
        stop(proc)


def test_a_chat_outlasting_the_stop_s_grace_is_told_and_its_job_goes_on(fleet: Fleet, tmp_path: Path) -> None:
    proc, base = _api(fleet, tmp_path / "api.log", grace_s=0.5)
    try:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            sent, job_id = _once_waiting(fleet, _chat(client))
            os.killpg(proc.pid, signal.SIGTERM)
            with pytest.raises(openai.APIStatusError) as raised:
                sent.result(timeout=30)
        assert raised.value.status_code == 503
        assert raised.value.code == "server_stopping", raised.value.body
        assert raised.value.response.headers["x-stoker-job-id"] == job_id  # where its answer will be
        assert raised.value.response.headers["x-should-retry"] == "true"
        assert proc.wait(30) == -signal.SIGTERM
        wait_for(lambda: _status(fleet, job_id) in TERMINAL, 30, "the job's end", [])
        assert _status(fleet, job_id) == "succeeded"  # not cancelled: the server left, not its client
    finally:
        stop(proc)


class RetriesElsewhere(httpx.BaseTransport):
    """A load balancer as a client sees one in a rolling deploy: a first attempt reaches the API it was sent to,
    the openai client's automatic retries (`x-stainless-retry-count` over 0) another one."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.inner = httpx.HTTPTransport()
        self.retried = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get(RETRY_COUNT_HEADER, "0") != "0":
            self.retried += 1
            request.url = request.url.copy_with(port=self.port)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_a_chat_retried_after_the_stop_gets_its_answer_from_another_api(fleet: Fleet, tmp_path: Path) -> None:
    stopping, base = _api(fleet, tmp_path / "stopping.log", grace_s=0.5)
    other, other_base = _api(fleet, tmp_path / "other.log", grace_s=30)
    try:
        balancer = RetriesElsewhere(httpx.URL(other_base).port or 0)
        http = httpx.Client(transport=balancer)
        with openai.OpenAI(
            base_url=f"{base}/v1",
            api_key="unused",
            max_retries=2,
            timeout=60,
            # openai's stub names httpx2.Client only, yet the client takes a legacy httpx.Client as well
            # (openai._httpx2.is_legacy_httpx_sync_client).
            http_client=http,  # type: ignore[arg-type]
        ) as client:
            sent, job_id = _once_waiting(fleet, _chat(client))
            os.killpg(stopping.pid, signal.SIGTERM)
            answer = sent.result(timeout=60)
        assert balancer.retried == 1  # the 503 was retried, once, by the client itself
        assert answer.id == f"chatcmpl-{job_id}"  # the retry waited on the job the first attempt made
        assert answer.choices[0].finish_reason is not None
        assert stopping.wait(30) == -signal.SIGTERM
        assert _status(fleet, job_id) == "succeeded"
    finally:
        stop(stopping)
        stop(other)
