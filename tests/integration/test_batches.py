"""OpenAI's Files and Batch APIs end to end, through the official `openai` client, on a real stack (Valkey, CPU
and inference workers, the reaper) with the device simulated: the model's words do not matter here, only which
requests reached it, when, and what came back for each `custom_id`."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.media import text_image, truncated
from workers.procs import wait_for

MODEL = ApiSettings().public_model_name
API = "http://testserver/v1"
DEVICE = {
    "STOKER_BACKEND": "sim",
    "STOKER_SIM_BASE_MS": "40",
    "STOKER_SIM_PER_ITEM_MS": "2",
    "STOKER_MAX_BATCH_SIZE": "8",
}


@pytest.fixture(scope="module")
def api(workers: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The API in this process, over the suite's workers; it feeds batches every 0.1 s."""
    settings = ApiSettings(files_dir=tmp_path_factory.mktemp("files"), batch_feed_interval_s=0.1)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def client(api: TestClient) -> openai.OpenAI:
    """The official client, over that API."""
    return openai.OpenAI(base_url=API, api_key="unused", http_client=api, max_retries=0)


def line(custom_id: str, content: Any, method: str = "POST", model: str = MODEL) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": method, "url": "/v1/chat/completions", "body": body}


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in lines)


def run_batch(client: openai.OpenAI, body: bytes) -> Any:
    uploaded = client.files.create(file=("input.jsonl", body), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client: openai.OpenAI, batch_id: str, until: tuple[str, ...], timeout_s: float = 90) -> Any:
    found: list[Any] = []

    def ended() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return bool(found[0].status in until)

    wait_for(ended, timeout_s, f"batch {batch_id} to be {until}", [])
    return found[0]


def read_lines(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    rows = [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()]
    by_id = {row["custom_id"]: row for row in rows}
    assert len(by_id) == len(rows), "a custom_id appears twice"
    return by_id


def test_a_mixed_batch_completes_with_one_answer_per_line(client: openai.OpenAI, api: TestClient) -> None:
    """120 lines: text, images as data URLs (two distinct pictures), one truncated image (answered, degraded), one
    with an unknown content part (refused at intake, in the error file with its code)."""
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
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (120, 119, 1)
    assert done.in_progress_at is not None
    assert done.finalizing_at is not None
    assert done.completed_at is not None
    outputs, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert set(outputs) == {item["custom_id"] for item in lines} - {"odd"}
    assert set(errors) == {"odd"}
    assert errors["odd"]["response"]["status_code"] == 422
    assert errors["odd"]["response"]["body"]["error"]["code"] == "invalid_request"
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
    found = {(e.code, e.line) for e in failed.errors.data}
    assert found == {
        ("duplicate_custom_id", 2),
        ("invalid_method", 3),
        ("mismatched_model", 4),
        ("invalid_json_line", 5),
    }
    assert failed.output_file_id is None


def test_another_tenant_sees_no_file_batch_or_output(api: TestClient) -> None:
    files_dir = api.app.state.context.settings.files_dir
    with TestClient(create_app(ApiSettings(auth=True, batch_feeder=False, files_dir=files_dir))) as secured:
        store = secured.app.state.context.store
        clients = []
        for name in ("acme", "globex"):
            issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
            store.tenants.put_api_key(issued.record)
            clients.append(openai.OpenAI(base_url=API, api_key=issued.token, http_client=secured, max_retries=0))
        acme, globex = clients
        batch = run_batch(acme, jsonl([line("x", "Say x.")]))
        done = wait_batch(acme, batch.id, ("completed",))  # fed by the module's API, whoever's it is
        owned = [batch.input_file_id, done.output_file_id]
        for call in (
            *(lambda f=f: globex.files.retrieve(f) for f in owned),
            *(lambda f=f: globex.files.content(f) for f in owned),
            lambda: globex.files.delete(batch.input_file_id),
            lambda: globex.batches.retrieve(batch.id),
            lambda: globex.batches.cancel(batch.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert globex.files.list().data == []
        assert globex.batches.list().data == []
        assert json.loads(acme.files.content(done.output_file_id).text)["custom_id"] == "x"
