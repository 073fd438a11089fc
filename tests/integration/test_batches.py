"""OpenAI's Files and Batch APIs end to end, through the official `openai` client, on a real stack (Valkey, CPU
and inference workers, the reaper) with the device simulated: the model's words do not matter here, only which
requests reached it, when, and what came back for each `custom_id`."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import Batch, BatchError, BatchRequestCounts

from api.openai_batch_feeder import OpenAIBatchFeeder
from stoker.adapters.store.jobs import NewJob
from stoker.adapters.store.openai_batches import PendingLine
from stoker.core.deadlines import deadline_for
from stoker.core.openai_batches import OpenAIBatch, OpenAIBatchLine, line_job_id, parse_line
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.fleet import QUICK_RECOVERY, SIM_RECOVERY, Fleet, client_context, own_fleet
from tests.media import text_image, truncated
from workers.broker import free_port
from workers.procs import spawn, stop, tail, wait_for

MODEL = ApiSettings().public_model_name
API = "http://testserver/v1"


#: The simulated device: a batch of up to 8 takes 200 ms + 5 ms per item (long beside a message's way through the
#: broker, as a real model's batch is, so the order of device batches says which request went first).
DEVICE = {"STOKER_BACKEND": "sim", "STOKER_SIM_BASE_MS": "200", "STOKER_SIM_PER_ITEM_MS": "5"}


@dataclass
class Stack:
    """The module's stack: workers and an API in this process (which serves, but feeds no batch), and an API
    process of its own that feeds the batches (so a test can SIGKILL it)."""

    fleet: Fleet
    api: TestClient
    port: int
    env: dict[str, str]
    feeder: subprocess.Popen[bytes] = field(init=False)  # started by `start_feeder`

    def start_feeder(self) -> None:
        """Start (or replace) the feeding API process, and wait until it serves."""
        self.feeder = spawn(["api", "--port", str(self.port)], self.env, self.fleet.root / "api.log")
        wait_for(self._serves, 120, "the feeding API", [self.feeder])

    def _serves(self) -> bool:
        """It answers, and has loaded its tokenizer (in the background, after it starts)."""
        if "tokenizer loaded" not in (self.fleet.root / "api.log").read_text(errors="replace"):
            return False
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    files = tmp_path_factory.mktemp("files")
    # A killed worker's messages come back after 10 s (the device simulated, the pictures small: every stage's
    # limit fits under that); a job is re-sent only after the fleet's patient 30 s.
    recovery = {**SIM_RECOVERY, "STOKER_REDRIVE_AFTER_S": QUICK_RECOVERY["STOKER_REDRIVE_AFTER_S"]}
    settings = {**DEVICE, **recovery, "STOKER_MAX_BATCH_SIZE": "8"}
    api = {"files_dir": files, "batch_feeder": False}
    with own_fleet(settings, kinds=("cpu", "infer"), api=api) as fleet:
        env = {**fleet.env, "STOKER_FILES_DIR": str(files), "STOKER_BATCH_FEED_INTERVAL_S": "0.1"}
        crew = Stack(fleet, fleet.client, free_port(), env)
        crew.start_feeder()
        try:
            yield crew
        finally:
            stop(crew.feeder)


@pytest.fixture(scope="module")
def api(stack: Stack) -> TestClient:
    return stack.api


@pytest.fixture(scope="module")
def client(api: TestClient) -> openai.OpenAI:
    """The official client, over the in-process API."""
    return openai.OpenAI(base_url=API, api_key="unused", http_client=api, max_retries=0)


def line(custom_id: str, content: Any, method: str = "POST", model: str = MODEL) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": method, "url": "/v1/chat/completions", "body": body}


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


def run_batch(client: openai.OpenAI, body: bytes) -> Batch:
    uploaded = client.files.create(file=("input.jsonl", body), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client: openai.OpenAI, batch_id: str, until: tuple[str, ...], timeout_s: float = 90) -> Batch:
    found: list[Batch] = []

    def ended() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return bool(found[0].status in until)

    wait_for(ended, timeout_s, f"batch {batch_id} to be {until}", [])
    return found[0]


def request_counts(batch: Batch) -> BatchRequestCounts:
    """A batch's request counts, which the API always gives (openai types them as optional)."""
    assert batch.request_counts is not None, batch
    return batch.request_counts


def batch_errors(batch: Batch) -> list[BatchError]:
    """The errors of a batch that failed validation (openai types them as optional)."""
    assert batch.errors is not None, batch
    assert batch.errors.data is not None, batch
    return batch.errors.data


def read_lines(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    rows = [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()]
    by_id = {row["custom_id"]: row for row in rows}
    assert len(by_id) == len(rows), "a custom_id appears twice"
    return by_id


def test_a_mixed_batch_completes_with_one_answer_per_line(client: openai.OpenAI, api: TestClient) -> None:
    """120 lines: text, images as data URLs (two distinct pictures), one truncated image (answered, degraded), one
    with an unknown content part (refused at intake as chat completions refuse it, in the error file with its code)."""
    pictures = [data_url(text_image(f"BOX {n}", size=(240, 60), font_size=32), "image/png") for n in range(2)]
    torn = data_url(truncated(text_image("TORN", size=(240, 60), font_size=32, fmt="JPEG")), "image/jpeg")
    lines = [line(f"text-{n}", f"Say {n}.") for n in range(110)]
    lines += [line(f"image-{n}", [{"type": "image_url", "image_url": {"url": pictures[n % 2]}}]) for n in range(8)]
    lines.append(
        line("torn", [{"type": "text", "text": "Read it."}, {"type": "image_url", "image_url": {"url": torn}}])
    )
    lines.append(line("odd", [{"type": "hologram", "hologram": {"x": 1}}]))
    batch = run_batch(client, jsonl(lines))
    assert batch.status == "validating"
    done = wait_batch(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done.errors
    counts = request_counts(done)
    assert (counts.total, counts.completed, counts.failed) == (120, 119, 1)
    assert done.in_progress_at is not None
    assert done.finalizing_at is not None
    assert done.completed_at is not None
    outputs, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert set(outputs) == {item["custom_id"] for item in lines} - {"odd"}
    assert set(errors) == {"odd"}
    assert errors["odd"]["response"]["status_code"] == 400
    assert errors["odd"]["response"]["body"]["error"]["code"] == "unsupported_parameter"
    assert "hologram" in errors["odd"]["response"]["body"]["error"]["message"]
    answer = outputs["text-3"]["response"]
    assert answer["status_code"] == 200
    assert answer["body"]["object"] == "chat.completion"
    assert answer["body"]["choices"][0]["message"]["content"]
    assert outputs["torn"]["response"]["body"]["stoker"]["status"] == "degraded"
    image = outputs["image-1"]["response"]["body"]["stoker"]["inputs"][0]
    assert (image["status"], image["error_code"]) == ("ok", None)
    job = api.get(f"/v1/jobs/{answer['request_id']}").json()
    assert (job["job_class"], job["batch_id"]) == ("batch", batch.id)
    stats = api.get("/v1/stats").json()["classes"]["batch"]
    assert stats["completed"] >= 119


def test_validation_refuses_bad_files_with_line_numbers(client: openai.OpenAI) -> None:
    lines = [line("a", "hi"), line("a", "again"), line("b", "hi", method="GET"), line("c", "hi", model="other")]
    body = jsonl(lines) + b"{not json\n"
    failed = wait_batch(client, run_batch(client, body).id, ("failed", "completed"), timeout_s=30)
    assert failed.status == "failed"
    assert failed.failed_at is not None
    found = {(e.code, e.line) for e in batch_errors(failed)}
    assert found == {
        ("duplicate_custom_id", 2),
        ("invalid_method", 3),
        ("mismatched_model", 4),
        ("invalid_json_line", 5),
    }
    assert failed.output_file_id is None


def test_another_tenant_sees_no_file_batch_or_output(stack: Stack) -> None:
    files_dir = client_context(stack.api).settings.files_dir
    with stack.fleet.api(auth=True, batch_feeder=False, files_dir=files_dir) as secured:
        store = client_context(secured).store
        clients = []
        for name in ("acme", "globex"):
            issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
            store.tenants.put_api_key(issued.record)
            clients.append(openai.OpenAI(base_url=API, api_key=issued.token, http_client=secured, max_retries=0))
        acme, globex = clients
        batch = run_batch(acme, jsonl([line("x", "Say x.")]))
        done = wait_batch(acme, batch.id, ("completed",))  # fed by the module's API, whoever's it is
        owned = [batch.input_file_id, done.output_file_id]
        calls: tuple[Callable[[], object], ...] = (
            *(lambda f=f: globex.files.retrieve(f) for f in owned),
            *(lambda f=f: globex.files.content(f) for f in owned),
            lambda: globex.files.delete(batch.input_file_id),
            lambda: globex.batches.retrieve(batch.id),
            lambda: globex.batches.cancel(batch.id),
        )
        for call in calls:
            with pytest.raises(openai.NotFoundError):
                call()
        assert globex.files.list().data == []
        assert globex.batches.list().data == []
        assert done.output_file_id is not None
        assert json.loads(acme.files.content(done.output_file_id).text)["custom_id"] == "x"


def test_interactive_requests_go_first_and_a_cancel_keeps_what_finished(client: openai.OpenAI, stack: Stack) -> None:
    """While a batch of 300 lines waits, 20 interactive requests each run before the batch lines that were waiting
    for the device when they joined its queue (at most the device batch prepared when one reached the consumer,
    and one more while it travelled there through the broker, go first). Then the batch is cancelled: what finished is
    kept, the rest is in the error file, and nothing of it reaches the device any more."""
    batch = run_batch(client, jsonl([line(f"p{n}", f"Line {n}.") for n in range(300)]))
    wait_for(lambda: request_counts(client.batches.retrieve(batch.id)).completed >= 10, 60, "the batch running", [])
    api, store = stack.api, stack.fleet.store()
    ids = []
    for n in range(20):
        answer = api.post("/v1/jobs", json={"prompt": f"Interactive {n}, quickly."})
        assert answer.status_code == 202, answer.text
        ids.append(answer.json()["id"])
    wait_for(lambda: all(store.hget(f"stoker:job:{i}", "ts:done") for i in ids), 60, "interactive jobs done", [])
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_batch(client, batch.id, ("cancelled",))
    ended = time.time()
    outputs, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert len(outputs) >= 10
    assert set(outputs) | set(errors) == {f"p{n}" for n in range(300)}
    assert not set(outputs) & set(errors)
    assert {row["error"]["code"] for row in errors.values()} == {"batch_cancelled"}
    counts = request_counts(done)
    assert (counts.completed, counts.failed) == (len(outputs), len(errors))
    assert done.cancelling_at is not None
    assert done.cancelled_at is not None
    assert stack.api.post(f"/v1/batches/{batch.id}/cancel").status_code == 409

    def stamps(job_id: str) -> tuple[float, float | None]:
        """When the job was handed to the inference queue (its prompt ready), and when its device batch began."""
        queued, started = store.hmget(f"stoker:job:{job_id}", ["ts:preprocessed", "ts:infer_start"])
        return float(queued or "inf"), float(started) if started else None

    lines = [stamps(row["id"].removeprefix("batch_req_")) for row in (*outputs.values(), *errors.values())]
    assert all(at is None or at <= ended for _, at in lines)  # nothing reached the device once it was cancelled
    waiting = []
    for job_id in ids:
        arrived, started = stamps(job_id)
        assert started is not None
        assert api.get(f"/v1/jobs/{job_id}").json()["job_class"] == "interactive"
        queued = [at for handed, at in lines if handed < arrived and (at is None or at > arrived)]
        ahead = {at for at in queued if at is not None and at < started}
        # the device batch prepared when it reached the consumer, and one more while it travelled from the API
        assert len(ahead) <= 2, (job_id, len(queued), sorted(ahead))
        waiting.append(len(queued))
    assert max(waiting) > 2 * 8  # more lines waited than two device batches hold: first-come would have failed


def test_a_batch_past_its_window_expires_with_its_unfinished_lines_in_the_error_file(
    client: openai.OpenAI, stack: Stack
) -> None:
    batch = run_batch(client, jsonl([line(f"e{n}", f"Late {n}.") for n in range(150)]))
    wait_for(lambda: request_counts(client.batches.retrieve(batch.id)).completed >= 5, 60, "the batch running", [])
    client_context(stack.api).store.openai_batches.update(batch.id, expires_at=int(time.time()))  # its window is over
    done = wait_batch(client, batch.id, ("expired", "completed"))
    assert done.status == "expired"
    assert done.expired_at is not None
    outputs, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert len(outputs) >= 5
    assert len(errors) > 0
    assert set(outputs) | set(errors) == {f"e{n}" for n in range(150)}
    assert {row["error"]["code"] for row in errors.values()} == {"batch_expired"}


def test_an_upload_over_the_limit_or_cut_short_is_refused_and_not_kept(stack: Stack) -> None:
    files_dir = client_context(stack.api).settings.files_dir
    with stack.fleet.api(files_max_bytes=2048, batch_feeder=False, files_dir=files_dir) as small:
        official = openai.OpenAI(base_url=API, api_key="unused", http_client=small, max_retries=0)
        known = {f.id for f in official.files.list().data}
        with pytest.raises(openai.APIStatusError) as refused:
            official.files.create(file=("big.jsonl", b"x" * 4096), purpose="batch")
        assert refused.value.status_code == 413
        head = b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        cut = head + b'--bb\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"a": 1}\n'
        answer = small.post("/v1/files", content=cut, headers={"Content-Type": "multipart/form-data; boundary=bb"})
        assert answer.status_code == 400
        with pytest.raises(openai.UnprocessableEntityError):  # stoker's invalid_request, as for a bad chat
            official.files.create(file=("a.jsonl", b"{}\n"), purpose="assistants")
        assert {f.id for f in official.files.list().data} == known
    assert not [p for p in files_dir.iterdir() if p.name.startswith(".")]  # no partial file left behind


def test_a_200_mb_upload_streams_through_the_api(stack: Stack) -> None:
    """The feeding API process takes a 200 MB file: its peak memory grows by a few MB, not by the file."""
    row = json.dumps(line("r", "x" * 3900)).encode() + b"\n"
    count = 200_000_000 // len(row)

    def body() -> Iterator[bytes]:
        boundary = b"--stokerboundary"
        yield boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        yield b"Content-Type: application/jsonl\r\n\r\n"
        for _ in range(count // 64):
            yield row * 64
        yield b"\r\n" + boundary + b"--\r\n"

    before = _peak_kib(stack.feeder.pid)
    headers = {"Content-Type": "multipart/form-data; boundary=stokerboundary"}
    url = f"http://127.0.0.1:{stack.port}/v1/files"
    answer = httpx.post(url, content=body(), headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["bytes"] == len(row) * (count // 64) * 64 >= 190_000_000
    growth_mib = (_peak_kib(stack.feeder.pid) - before) / 1024
    assert growth_mib < 8, growth_mib
    httpx.delete(f"{url}/{answer.json()['id']}")


def _peak_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmHWM:")))


def test_stoker_batch_submit_writes_the_output_next_to_the_input(stack: Stack, tmp_path: Path) -> None:
    source = tmp_path / "catalogue.jsonl"
    source.write_bytes(jsonl([line(f"s{n}", f"Item {n}.") for n in range(3)] + [line("bad", [{"type": "x"}])]))
    url = f"http://127.0.0.1:{stack.port}"
    ran = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "batch", "submit", str(source), "--url", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "3 completed, 1 failed" in ran.stdout
    outputs = [json.loads(row) for row in (tmp_path / "catalogue.output.jsonl").read_text().splitlines()]
    assert sorted(row["custom_id"] for row in outputs) == ["s0", "s1", "s2"]
    (error,) = [json.loads(row) for row in (tmp_path / "catalogue.errors.jsonl").read_text().splitlines()]
    assert error["custom_id"] == "bad"
    batch_id = next(word for word in ran.stdout.split() if word.startswith("batch_"))
    shown = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "batch", "status", batch_id, "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "completed" in shown.stdout


def test_a_batch_survives_its_feeder_and_workers_being_killed(client: openai.OpenAI, stack: Stack) -> None:
    """SIGKILL the feeding API, the inference and the CPU workers mid-batch; restarted (the feeder now as a process
    of its own, `stoker batch-feeder`, as `stoker up` runs it), the batch completes with every custom_id exactly
    once, and the feeder stops cleanly on SIGTERM."""
    picture = data_url(text_image("KILL 7", size=(240, 60), font_size=32), "image/png")
    lines = [line(f"k{n}", f"Kill {n}.") for n in range(50)]
    lines += [
        line(f"ki{n}", [{"type": "text", "text": f"{n}"}, {"type": "image_url", "image_url": {"url": picture}}])
        for n in range(10)
    ]
    batch = run_batch(client, jsonl(lines))
    wait_for(lambda: request_counts(client.batches.retrieve(batch.id)).completed >= 5, 60, "the batch running", [])
    stack.feeder.send_signal(signal.SIGKILL)
    stack.feeder.wait(10)
    stack.fleet.kill("infer")
    stack.fleet.kill("cpu")
    halfway = client.batches.retrieve(batch.id)
    assert halfway.status == "in_progress"
    assert request_counts(halfway).completed < 60
    for kind in ("cpu", "infer"):
        stack.fleet.start(kind)
    log = stack.fleet.root / "batch-feeder.log"
    stack.feeder = spawn(["batch-feeder"], stack.env, log)
    done = wait_batch(client, batch.id, ("completed",), timeout_s=120)
    outputs = read_lines(client, done.output_file_id)  # fails on a custom_id written twice
    assert set(outputs) == {item["custom_id"] for item in lines}
    assert request_counts(done).completed == 60
    assert done.error_file_id is None
    lowered = os.getpriority(os.PRIO_PROCESS, stack.feeder.pid) - os.getpriority(os.PRIO_PROCESS, 0)
    assert lowered == ApiSettings().batch_feeder_nice > 0  # it runs on CPU time interactive work leaves
    stack.feeder.send_signal(signal.SIGTERM)
    assert stack.feeder.wait(30) == 0, tail(log)
    assert "stopped" in tail(log)


def test_a_line_whose_job_was_made_but_never_sent_is_made_again(api: TestClient) -> None:
    """The state a feeder SIGKILLed between a line's record and its publish leaves (the line noted, its job queued,
    no message anywhere): the next feeder unmakes that job and makes it again. A line noted as sent, or whose job a
    stage started, is left to be collected."""
    context = client_context(api)
    store = context.store
    now = time.time()
    record = OpenAIBatch(
        id=f"batch_{uuid.uuid4().hex}",
        endpoint="/v1/chat/completions",
        input_file_id="file-unused",
        completion_window="24h",
        status="in_progress",
        created_at=int(now),
        expires_at=int(now) + 3600,
    )
    parsed = parse_line(json.dumps(line("orphan", "Hello.")).encode(), 1, record.endpoint)
    assert isinstance(parsed, OpenAIBatchLine)
    pending = PendingLine(line_job_id(record.id, 1), "orphan", 1)
    feeder = OpenAIBatchFeeder(context)

    def made_not_sent(sent: bool = False) -> None:
        store.openai_batches.pend(record.id, replace(pending, sent=sent))
        deadline = deadline_for(now, 60_000, 5_000)
        store.jobs.create(pending.job_id, NewJob("Hello.", [], now, deadline, 60_000, tenant=record.tenant))

    made_not_sent()
    assert feeder._prepare(record, pending, parsed) is not None  # to be made again
    assert store.jobs.load_job(pending.job_id) is None  # the orphan record is gone first
    assert store.openai_batches.pended(record.id, pending.job_id) == pending  # still in flight, not yet sent

    made_not_sent(sent=True)
    assert feeder._prepare(record, pending, parsed) is None  # its message went out: collected like any other
    assert store.jobs.load_job(pending.job_id) is not None

    store.jobs.delete_job(pending.job_id)
    made_not_sent()
    assert store.jobs.mark_started(pending.job_id)  # a stage has it, so a message was sent after all
    assert feeder._prepare(record, pending, parsed) is None
    job = store.jobs.load_job(pending.job_id)
    assert job is not None
    assert job.status == "preprocessing"
