"""vLLM's render protocol on stoker's API (`api.render`), through the pipeline: a real API (keys and tenants on) over
a fleet of its own (Valkey, a CPU worker's processes and the reaper), each render a job whose pictures the CPU
workers decode and render into the stage cache; the answer checked against vLLM's own render recorded for the same
bodies (`tests/fixtures/vllm_render`)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from stoker.adapters.render import Renderer
from stoker.adapters.store import Store
from stoker.adapters.vllm_render import decode_item
from stoker.core.media import content_hash
from stoker.core.tenancy import issue_key
from tests.fixtures.vllm_render import corpus
from tests.fleet import Fleet, own_fleet
from tests.media import text_image, truncated

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm_render"
JOB_ID = "x-stoker-job-id"


@dataclass(frozen=True)
class Tenant:
    """A tenant of this module, with a key of its own."""

    name: str
    token: str

    @property
    def auth(self) -> dict[str, str]:
        """The request header carrying its key."""
        return {"Authorization": f"Bearer {self.token}"}


@dataclass(frozen=True)
class Stack:
    """The fleet, an API over it serving the tiny VLM with keys on, and two tenants."""

    fleet: Fleet
    api: TestClient
    acme: Tenant
    globex: Tenant
    model: str


@pytest.fixture(scope="module")
def stack(tiny_vlm: Path) -> Iterator[Stack]:
    settings = {
        "STOKER_MODEL": str(tiny_vlm),
        "STOKER_DECODE_SOFT_S": "20",  # decode renders the picture too, on a CPU other tests share
        "STOKER_DECODE_HARD_S": "25",
    }
    with own_fleet(settings, kinds=("cpu",)) as fleet:
        tenants = [_tenant(fleet, name) for name in ("acme", "globex")]
        with fleet.api(model=str(tiny_vlm), auth=True, rate_limit_per_s=1000.0, rate_limit_burst=1000) as api:
            yield Stack(fleet, api, tenants[0], tenants[1], tiny_vlm.name)


def _tenant(fleet: Fleet, name: str) -> Tenant:
    """A new tenant with a key of its own (its limits start empty)."""
    issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
    Store.over(fleet.store(), blob_ttl_s=3600, job_ttl_s=3600).tenants.put_api_key(issued.record)
    return Tenant(issued.record.tenant, issued.token)


@pytest.fixture(scope="module")
def renderer(tiny_vlm: Path) -> Renderer:
    return Renderer(str(tiny_vlm), "bfloat16")


def recorded(model: str, case: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((FIXTURES / model / f"{case}.json").read_text())
    return found


def schema() -> dict[str, Any]:
    found: dict[str, Any] = json.loads((FIXTURES / "generate_request.schema.json").read_text())
    return found


@dataclass(frozen=True)
class Answer:
    """What an answer of the API says: its status, headers (lowercase names) and body."""

    status_code: int
    headers: dict[str, str]
    text: str

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.text)


def _post(api: TestClient, path: str, body: dict[str, Any], tenant: Tenant) -> Answer:
    answer = api.post(path, json=body, headers=tenant.auth)
    return Answer(answer.status_code, {k.lower(): v for k, v in answer.headers.items()}, answer.text)


def _render(stack: Stack, body: dict[str, Any], tenant: Tenant | None = None) -> Answer:
    return _post(stack.api, "/v1/chat/completions/render", body, tenant or stack.acme)


def _record(stack: Stack, answer: Answer, tenant: Tenant | None = None) -> dict[str, Any]:
    """The render's job, read by its id as its tenant."""
    found = stack.api.get(f"/v1/jobs/{answer.headers[JOB_ID]}", headers=(tenant or stack.acme).auth)
    assert found.status_code == 200, found.text
    job: dict[str, Any] = found.json()
    return job


def _picture_body(stack: Stack, picture: bytes, question: str) -> dict[str, Any]:
    """The corpus's one-picture chat with another picture and question."""
    body = corpus.body("one_picture", stack.model)
    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    body["messages"][0]["content"][0]["image_url"]["url"] = url
    body["messages"][0]["content"][1]["text"] = question
    return body


@pytest.mark.parametrize("case", ["text_only", "system_turns", "one_picture", "pictures_two_turns"])
def test_a_chat_renders_through_the_workers_as_vllm_renders_it(stack: Stack, renderer: Renderer, case: str) -> None:
    body = corpus.body(case, stack.model)
    answer = _render(stack, body)
    assert answer.status_code == 200, answer.text
    rendered = answer.json()
    jsonschema.validate(rendered, schema())
    expected = recorded(stack.model, case)
    assert rendered["token_ids"] == expected["token_ids"]
    assert rendered["sampling_params"] == expected["generate"]["sampling_params"]
    assert rendered["parse_context"] == expected["generate"]["parse_context"]
    job = _record(stack, answer)
    assert job["status"] == "succeeded"
    assert (job["batch"], job["result"]) == (None, None)  # it never reached the model
    if expected["features"] is None:
        assert rendered["features"] is None
        assert job["inputs"] == []
        return
    assert rendered["features"]["mm_placeholders"] == expected["features"]["mm_placeholders"]
    pictures = [
        base64.b64decode(part["image_url"]["url"].partition(",")[2])
        for message in body["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image_url"
    ]
    hashes = [renderer.picture_hash(content_hash(p)) for p in pictures]
    assert rendered["features"]["mm_hashes"] == {"image": hashes}  # stoker's content hash + the processor
    for ours, theirs in zip(
        rendered["features"]["kwargs_data"]["image"], expected["features"]["kwargs_data"]["image"], strict=True
    ):
        item = decode_item(ours)
        assert sorted(item) == sorted(theirs["keys"])  # vLLM's own key order changes between its runs
        assert [list(e.tensor.shape) for e in item.values()] == [theirs["tensors"][k]["shape"] for k in item]
        assert [str(e.tensor.dtype).removeprefix("torch.") for e in item.values()] == [
            theirs["tensors"][k]["dtype"] for k in item
        ]
        # bit-equal to vLLM's, through the workers and the cache as through the renderer alone
        assert {k: hashlib.sha256(e.tensor.data).hexdigest() for k, e in item.items()} == {
            k: t["sha256"] for k, t in theirs["tensors"].items()
        }
    assert [r["timings_ms"].get("decode") is not None for r in job["inputs"]] == [True] * len(pictures)


def test_a_completion_renders_through_a_job_as_vllm_renders_it(stack: Stack) -> None:
    answer = _post(stack.api, "/v1/completions/render", corpus.body("completion", stack.model), stack.acme)
    assert answer.status_code == 200, answer.text
    [rendered] = answer.json()
    jsonschema.validate(rendered, schema())
    assert rendered["token_ids"] == recorded(stack.model, "completion")["token_ids"]
    assert _record(stack, answer)["status"] == "succeeded"


def _cpu_worker(stack: Stack) -> str:
    """The fleet's one worker, by its Celery name."""
    replies = stack.fleet.app.control.ping(timeout=5, limit=1)
    return str(next(name for reply in replies for name in reply if name.startswith("cpu@")))


def _renders_run(stack: Stack) -> int:
    """How many `stoker.render` tasks the CPU worker has run."""
    cpu = _cpu_worker(stack)
    total: dict[str, int] = stack.fleet.app.control.inspect(destination=[cpu], timeout=5).stats()[cpu]["total"]
    return total.get("stoker.render", 0)


def test_a_repeated_picture_is_rendered_from_the_cache_without_a_stage(stack: Stack) -> None:
    picture = text_image(f"repeat {uuid.uuid4().hex[:6]}", size=(640, 480))
    before = _renders_run(stack)
    first = _render(stack, _picture_body(stack, picture, "What does it say?"))
    assert first.status_code == 200, first.text
    [made] = _record(stack, first)["inputs"]
    assert made["cache_hit"] == {"render": False}  # decoded and rendered by the CPU stage
    assert _renders_run(stack) == before + 1
    second = _render(stack, _picture_body(stack, picture, "And now?"))
    assert second.status_code == 200, second.text
    job = _record(stack, second)
    assert job["status"] == "succeeded"
    [read] = job["inputs"]
    assert read["cache_hit"] == {"render": True}  # the API found it rendered: the job ended as it was taken in
    assert read["status"] == "ok"
    assert _renders_run(stack) == before + 1  # no task ran for it: no decode, no processor, no worker
    assert second.json()["features"] == first.json()["features"]
    assert second.json()["token_ids"] != first.json()["token_ids"]  # another question, the same picture


def _running_render(stack: Stack, timeout_s: float = 60.0) -> int:
    """The pid of the CPU worker's pool child running a `stoker.render`, once one is."""
    cpu = _cpu_worker(stack)
    inspect = stack.fleet.app.control.inspect(destination=[cpu], timeout=5)
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        running = [t for t in inspect.active()[cpu] if t["name"] == "stoker.render"]
        if running:
            return int(running[0]["worker_pid"])
    raise AssertionError(f"no render started in {timeout_s} s")


def test_a_render_whose_pool_child_dies_mid_render_is_rendered_again(stack: Stack) -> None:
    # The most pixels a picture may have, at little cost to send: seconds of decoding and resizing, long enough to
    # kill the child in the middle of them.
    picture = text_image(f"killed {uuid.uuid4().hex[:6]}", size=(9000, 9000), fmt="JPEG")
    before = _renders_run(stack)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(_render, stack, _picture_body(stack, picture, "What does it say?"))
        os.kill(_running_render(stack), signal.SIGKILL)
        answer = sent.result(timeout=120)
    assert answer.status_code == 200, answer.text
    job = _record(stack, answer)
    assert job["status"] == "succeeded"
    assert job["inputs"][0]["cache_hit"] == {"render": False}
    assert _renders_run(stack) == before + 2  # the message given back when its child died, and taken again
    assert len(answer.json()["features"]["kwargs_data"]["image"]) == 1


def test_a_broken_picture_is_a_4xx_naming_its_part(stack: Stack) -> None:
    broken = truncated(corpus.picture_png("landscape"), 0.3)
    body = _picture_body(stack, broken, "What is it?")
    answer = _render(stack, body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("messages[0].content[0]", "image_corrupt")
    assert error["message"].startswith("messages[0].content[0]: ")
    job = _record(stack, answer)
    assert job["status"] == "failed"
    assert job["inputs"][0]["error"]["code"] == "image_corrupt"

    body["stoker_on_input_error"] = "degrade"
    degraded = _render(stack, body)
    assert degraded.status_code == 200, degraded.text
    assert degraded.headers["x-stoker-degraded"] == "image_corrupt"
    assert degraded.json()["features"] is None
    assert _record(stack, degraded)["status"] == "degraded"


def _without_ids(answer: Answer) -> dict[str, Any]:
    body: dict[str, Any] = answer.json()
    return {k: v for k, v in body.items() if k != "request_id"}


def test_another_tenant_can_neither_read_a_render_nor_learn_its_picture_was_seen(stack: Stack) -> None:
    picture = text_image(f"secret {uuid.uuid4().hex[:6]}", size=(500, 300))
    body = _picture_body(stack, picture, "Whose is it?")
    first = _render(stack, body, stack.acme)
    again = _render(stack, body, stack.acme)  # acme's repeat: its own cache
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert _record(stack, again)["inputs"][0]["cache_hit"] == {"render": True}
    theirs = _render(stack, body, stack.globex)
    assert theirs.status_code == 200, theirs.text
    # globex's render of a picture acme's scope holds is made as a first sight is: the stage ran for it...
    assert _record(stack, theirs, stack.globex)["inputs"][0]["cache_hit"] == {"render": False}
    # ...and its answer says nothing of it: the same body and the same headers as acme's hit and miss alike
    assert _without_ids(theirs) == _without_ids(again) == _without_ids(first)
    assert sorted(theirs.headers) == sorted(again.headers) == sorted(first.headers)
    # acme's render by its id is globex's 404, as an unknown id is
    for job_id in (first.headers[JOB_ID], uuid.uuid4().hex):
        read = stack.api.get(f"/v1/jobs/{job_id}", headers=stack.globex.auth)
        assert read.status_code == 404
        assert read.json()["error"] == {
            "message": f"no job {job_id}",
            "type": "not_found_error",
            "param": None,
            "code": "job_not_found",
        }


def test_a_render_over_admission_is_429_with_retry_after(stack: Stack, tiny_vlm: Path) -> None:
    body = corpus.body("text_only", stack.model)
    initech = _tenant(stack.fleet, "initech")
    with stack.fleet.api(model=str(tiny_vlm), auth=True, rate_limit_per_s=0.01, rate_limit_burst=1) as api:
        assert api.post("/v1/chat/completions/render", json=body, headers=initech.auth).status_code == 200
        jobs = len(list(stack.fleet.store().scan_iter("stoker:job:*")))
        refused = _post(api, "/v1/chat/completions/render", body, initech)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limited"
        assert int(refused.headers["retry-after"]) >= 1
        assert len(list(stack.fleet.store().scan_iter("stoker:job:*"))) == jobs  # nothing written
