"""vLLM's render protocol on stoker's API (`api.render`), against vLLM's own render recorded for the same bodies
(`tests/fixtures/vllm_render`): a real API over the test Redis; a render enqueues nothing."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from api import render
from api.app import create_app
from stoker.adapters.vllm_render import decode_item
from stoker.settings import ApiSettings
from tests.fixtures.vllm_render import corpus
from tests.integration.conftest import SpySubmitter
from tests.media import truncated

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm_render"
TINY_VLM = Path("~/.cache/stoker/models/tiny-vlm-v1").expanduser()
MODEL = TINY_VLM.name


@pytest.fixture
def api() -> Iterator[TestClient]:
    """The API serving the tiny VLM, its submissions recorded and sent nowhere."""
    with TestClient(create_app(ApiSettings(model=str(TINY_VLM)), submitter=SpySubmitter(forward=False))) as client:
        yield client


def recorded(case: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((FIXTURES / MODEL / f"{case}.json").read_text())
    return found


def schema() -> dict[str, Any]:
    found: dict[str, Any] = json.loads((FIXTURES / "generate_request.schema.json").read_text())
    return found


@pytest.mark.parametrize("case", ["text_only", "system_turns", "one_picture", "pictures_two_turns"])
def test_a_chat_renders_as_vllm_renders_it(api: TestClient, case: str) -> None:
    answer = api.post("/v1/chat/completions/render", json=corpus.body(case, MODEL))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    jsonschema.validate(body, schema())
    expected = recorded(case)
    assert body["token_ids"] == expected["token_ids"]
    assert body["sampling_params"] == expected["generate"]["sampling_params"]
    assert body["parse_context"] == expected["generate"]["parse_context"]
    if expected["features"] is None:
        assert body["features"] is None
        return
    assert body["features"]["mm_placeholders"] == expected["features"]["mm_placeholders"]
    for ours, theirs in zip(
        body["features"]["kwargs_data"]["image"], expected["features"]["kwargs_data"]["image"], strict=True
    ):
        item = decode_item(ours)
        assert list(item) == theirs["keys"]
        assert [list(e.tensor.shape) for e in item.values()] == [theirs["tensors"][k]["shape"] for k in item]


def test_a_completion_renders_as_vllm_renders_it(api: TestClient) -> None:
    answer = api.post("/v1/completions/render", json=corpus.body("completion", MODEL))
    assert answer.status_code == 200, answer.text
    [body] = answer.json()
    jsonschema.validate(body, schema())
    assert body["token_ids"] == recorded("completion")["token_ids"]


def test_a_repeated_picture_is_rendered_from_the_cache(api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    model = render._renderer(str(TINY_VLM), "bfloat16")
    body = corpus.body("one_picture", MODEL)
    body["messages"][0]["content"][1]["text"] = "A question of this test's own."
    first = api.post("/v1/chat/completions/render", json=body)
    assert first.status_code == 200, first.text

    def refuse(*_: Any) -> Any:
        raise AssertionError("the picture was prepared again")

    monkeypatch.setattr(model, "picture", refuse)
    second = api.post("/v1/chat/completions/render", json=body)
    assert second.status_code == 200, second.text
    assert second.json()["features"] == first.json()["features"]


def test_a_broken_picture_is_a_4xx_naming_its_part(api: TestClient) -> None:
    body = corpus.body("one_picture", MODEL)
    broken = truncated(corpus.picture_png("landscape"), 0.3)
    body["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64," + base64.b64encode(broken).decode()
    answer = api.post("/v1/chat/completions/render", json=body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages[0].content[0]"
    assert error["code"] == "image_corrupt"

    body["stoker_on_input_error"] = "degrade"
    degraded = api.post("/v1/chat/completions/render", json=body)
    assert degraded.status_code == 200, degraded.text
    assert degraded.headers["x-stoker-degraded"] == "image_corrupt"
    assert degraded.json()["features"] is None


def test_another_model_is_not_found(api: TestClient) -> None:
    answer = api.post("/v1/chat/completions/render", json=corpus.body("text_only", "gpt-4o"))
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found"
