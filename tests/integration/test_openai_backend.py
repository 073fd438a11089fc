"""The `openai` backend against a fake OpenAI-compatible server on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from stoker.adapters.backends.remote import OpenAIPredictor
from stoker.adapters.store.jobs import Pending
from stoker.adapters.store.keys import cache_key
from stoker.core import cachekeys
from stoker.core.errors import InferenceFailed, ModelUnavailable
from stoker.core.imaging import DecodeParams, decode_rgb, served_picture
from stoker.core.jobs import InputRecord, Job
from stoker.core.media import content_hash
from stoker.core.model import GenerationParams, ModelRequest, Prediction, run_predictor
from stoker.core.tenancy import DEFAULT_TENANT, cache_scope
from stoker.runtime.batches import BatchItem
from stoker.settings import WorkerSettings
from tests.fakeopenai import FakeServer, Picture, fake_openai_server
from tests.fakes.outbox import NoOutbox
from tests.media import encode, photo, text_image

PICTURE = served_picture(decode_rgb(text_image("HELLO"), DecodeParams()), 4096)


_OPENED: list[OpenAIPredictor] = []


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with fake_openai_server() as fake:
        yield fake
        while _OPENED:
            _OPENED.pop().close()


def _request(text: str, images: list[str] | None = None) -> ModelRequest:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    return ModelRequest([1, 2, 3], messages, images or [])


def _predictor(server: FakeServer, **kwargs: object) -> OpenAIPredictor:
    options: dict[str, Any] = {
        "max_new_tokens": 16,
        "max_in_flight": 3,
        "timeout_s": 5,
        "images": lambda digest, _scope: {"pic": PICTURE}.get(digest),
    }
    predictor = OpenAIPredictor(server.url, "fake-vlm", **{**options, **kwargs})
    predictor.setup("cpu")
    _OPENED.append(predictor)
    return predictor


def test_each_request_carries_its_text_and_its_preprocessed_picture(server: FakeServer) -> None:
    outcomes = run_predictor(_predictor(server), [_request("what does it say?", ["pic"]), _request("hi")])
    assert isinstance(outcomes[0], Prediction)
    assert outcomes[0].text == "fake saw 1 image(s)"
    assert isinstance(outcomes[1], Prediction)
    assert outcomes[1].text == "fake saw 0 image(s)"
    body = next(b for b in server.bodies if not isinstance(b["messages"][-1]["content"], str))
    parts = body["messages"][-1]["content"]
    assert parts[0] == {"type": "text", "text": "what does it say?"}
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert parts[1]["uuid"] == "pic"  # the content hash, as vLLM's per-item uuid
    assert server.pictures == [Picture("image/png", "PNG", (800, 200), "pic")]
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("fake-vlm", 16, 0)


def test_requests_go_out_concurrently_but_never_more_than_the_bound(server: FakeServer) -> None:
    server.delay_s = 0.3
    outcomes = run_predictor(_predictor(server), [_request(f"q{i}") for i in range(9)])
    assert all(isinstance(o, Prediction) for o in outcomes)
    assert server.most_in_flight == 3


def test_a_server_error_fails_that_request_alone(server: FakeServer) -> None:
    server.fail_on = {"poison": 500}
    outcomes = run_predictor(_predictor(server), [_request("fine"), _request("poison pill"), _request("fine too")])
    assert isinstance(outcomes[0], Prediction)
    assert isinstance(outcomes[1], InferenceFailed)
    assert "500" in outcomes[1].message
    assert isinstance(outcomes[2], Prediction)


def test_an_overloaded_server_is_retried_then_reported_unavailable(server: FakeServer) -> None:
    server.fail_on = {"busy": 503}
    (outcome,) = run_predictor(_predictor(server, attempts=2), [_request("busy now")])
    assert isinstance(outcome, ModelUnavailable)
    assert len(server.bodies) == 2


def test_an_unreachable_server_is_unavailable_not_a_crash(server: FakeServer) -> None:
    predictor = _predictor(server, attempts=1)
    predictor.base_url = "http://127.0.0.1:9"
    predictor.setup("cpu")
    (outcome,) = run_predictor(predictor, [_request("anyone?")])
    assert isinstance(outcome, ModelUnavailable)


def test_a_streamed_request_hands_on_each_piece_and_returns_the_whole(server: FakeServer) -> None:
    got: list[tuple[str, str]] = []
    predictor = _predictor(server, pieces=lambda job, piece: got.append((job, piece)))
    streamed = ModelRequest([1], [{"role": "user", "content": "go"}], stream_to="job-7")
    plain = ModelRequest([1], [{"role": "user", "content": "no stream"}])
    first, second = run_predictor(predictor, [streamed, plain])
    assert got == [("job-7", p) for p in server.pieces]
    assert isinstance(first, Prediction)
    assert first.text == "".join(server.pieces)
    assert (first.finish_reason, first.completion_tokens) == ("length", 5)
    assert isinstance(second, Prediction)
    assert second.finish_reason == "stop"
    asked = {b["messages"][-1]["content"]: b.get("stream", False) for b in server.bodies}
    assert asked == {"go": True, "no stream": False}


def test_each_turn_carries_its_own_pictures_and_the_request_its_parameters(server: FakeServer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "first", "images": ["pic"]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    params = GenerationParams(max_tokens=99, temperature=0.2, top_p=0.8, stop=("Z",), seed=5)
    body = _predictor(server, max_tokens_cap=50).body(ModelRequest([1], messages, ["pic"], params=params))
    first, _, last = body["messages"]
    assert [p["type"] for p in first["content"]] == ["text", "image_url"]
    assert last == {"role": "user", "content": "second"}
    assert {k: body[k] for k in ("max_tokens", "temperature", "top_p", "stop", "seed")} == {
        "max_tokens": 50,
        "temperature": 0.2,
        "top_p": 0.8,
        "stop": ["Z"],
        "seed": 5,
    }


def test_a_batch_line_goes_to_a_priority_scheduling_server_behind_interactive_requests(server: FakeServer) -> None:
    line = Job(id="line", status="inferring", prompt="", inputs=[], job_class="batch")
    asked = Job(id="asked", status="inferring", prompt="", inputs=[])
    request = ModelRequest([1], [{"role": "user", "content": "hi"}])
    background, interactive = (
        BatchItem(job.id, Pending(job, request, None, None, None)).request for job in (line, asked)
    )
    assert (background.background, interactive.background) == (True, False)
    prioritised = _predictor(server, batch_priority=10)
    assert (prioritised.body(background)["priority"], prioritised.body(interactive)["priority"]) == (10, 0)
    assert "priority" not in _predictor(server).body(background)  # a server without priority scheduling


def test_a_photo_too_big_as_png_is_prepared_once_in_a_form_the_cache_keeps_and_the_inference_side_only_reads_it(
    server: FakeServer, store_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stoker.runtime import context as runtime
    from stoker.runtime import pictures
    from stoker.runtime.stages.decode import decode_and_cache

    upload = encode(photo(4096, 3072, seed=21), "PNG")  # a camera's noise: far over the cache's 8 MiB as PNG
    digest, job_id = content_hash(upload), f"served-{uuid.uuid4().hex[:8]}"
    ctx = runtime.WorkerContext(WorkerSettings(backend="openai", openai_base_url=server.url), outbox=NoOutbox())
    decodes = [0]
    real = decode_rgb  # what `pictures` calls

    def counted(data: bytes, params: DecodeParams) -> Any:
        decodes[0] += 1
        return real(data, params)

    monkeypatch.setattr(pictures, "decode_rgb", counted)  # the inference side's one way to decode a picture
    try:
        ctx.store.blobs.put_blob(digest, upload, job_id)  # held for the job: the inference side could decode it
        scope = cache_scope(DEFAULT_TENANT, shared=False)
        address = ctx.decode_address(digest, scope)
        record = InputRecord(index=0, kind="image", content_hash=digest, size_bytes=len(upload))
        decode_and_cache(ctx, record, address)  # the CPU stage
        assert ctx.cache.redis is not None
        stored = ctx.cache.redis.strlen(  # type: ignore[no-untyped-call]  # types-redis 4.6 leaves strlen untyped
            cache_key(address, cachekeys.PICTURE)
        )
        assert 0 < stored <= ctx.settings.cache_max_value_bytes
        predictor = _predictor(server, images=ctx.pictures.picture)
        request = ModelRequest([1], [{"role": "user", "content": "What is it?"}], [digest], scope)
        answers = run_predictor(predictor, [request, request])
    finally:
        ctx.store.blobs.release(job_id)
        ctx.close()
    assert all(isinstance(a, Prediction) for a in answers), answers
    assert decodes[0] == 0  # read from the cache each time, never decoded again
    assert server.pictures == [Picture("image/jpeg", "JPEG", (4096, 3072), digest)] * 2
