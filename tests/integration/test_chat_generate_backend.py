"""A chat through stoker to a server that offers vLLM's generate endpoint (the fake, on loopback): client → stoker's
API → its CPU workers (the picture decoded and rendered into the stage cache) → the `openai` backend's inference
worker (`STOKER_OPENAI_PROTOCOL=generate`) → `/inference/v1/generate`, never a picture."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from api.app import create_app
from stoker.adapters.render import ITEM, Renderer
from stoker.adapters.store.keys import cache_key
from stoker.core.imaging import DecodeParams, decode_rgb
from stoker.core.media import content_hash
from stoker.core.tenancy import DEFAULT_TENANT, cache_scope
from stoker.settings import ApiSettings, WorkerSettings
from tests.fakeopenai import FakeServer, Generated, fake_openai_server
from tests.fleet import Fleet, own_fleet
from tests.media import text_image
from tests.serving import serve

MODEL = ApiSettings().public_model_name
WORKER = WorkerSettings()


@pytest.fixture(scope="module")
def renderer(tiny_vlm: Path) -> Renderer:
    return Renderer(str(tiny_vlm), "bfloat16")


@pytest.fixture(scope="module")
def chain(tiny_vlm: Path) -> Iterator[tuple[FakeServer, Fleet, openai.OpenAI]]:
    """The fake generate server behind a fleet serving the tiny VLM by the `openai` backend in `generate`, and
    stoker's API over HTTP with the official client in front."""
    with fake_openai_server(generate=True) as fake:
        settings = {
            "STOKER_BACKEND": "openai",
            "STOKER_OPENAI_BASE_URL": fake.url,
            "STOKER_OPENAI_MODEL": "vlm",
            "STOKER_OPENAI_PROTOCOL": "generate",
            "STOKER_MODEL": str(tiny_vlm),
            "STOKER_MAX_CONTEXT_TOKENS": "4096",
            "STOKER_DECODE_SOFT_S": "20",  # decode renders the picture too, on a CPU other tests share
            "STOKER_DECODE_HARD_S": "25",
        }
        with own_fleet(settings) as fleet:
            urls: dict[str, Any] = {
                k: fleet.env[f"STOKER_{k.upper()}"] for k in ("broker_url", "result_url", "cache_url")
            }
            with serve(create_app(ApiSettings(**urls, auth=False))) as base:
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
                with client:
                    yield fake, fleet, client


def _sent(fake: FakeServer, renderer: Renderer, marker: str) -> Generated:
    """The generate request whose prompt spells marker."""
    decode = renderer.tokenizer.tokenizer.decode
    return next(g for g in fake.generated if marker in decode(g.body["token_ids"]))


def test_a_picture_reaches_the_server_as_the_processors_tensors_from_the_cache(
    chain: tuple[FakeServer, Fleet, openai.OpenAI], renderer: Renderer
) -> None:
    fake, fleet, client = chain
    upload = text_image("TOTAL 77", size=(1200, 500))
    url = "data:image/png;base64," + base64.b64encode(upload).decode()
    content: Any = [{"type": "text", "text": "Read it (marker-pic)."}, {"type": "image_url", "image_url": {"url": url}}]
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6, seed=4
    )
    assert answer.choices[0].message.content == "fake generated with 1 image(s)"
    assert fake.bodies == []  # never a chat completion, never a picture
    sent = _sent(fake, renderer, "marker-pic")
    params = DecodeParams(max_pixels=WORKER.max_image_pixels, ocr_max_side=WORKER.ocr_max_side)
    expected = renderer.picture(decode_rgb(upload, params))
    assert sent.items == [expected.item]  # each tensor bit-equal to the processor's, cast as vLLM casts it
    prompt = renderer.chat(
        [{"role": "user", "content": [{"type": "text", "text": "Read it (marker-pic)."}, {"type": "image"}]}],
        [expected.layout],
    )
    assert sent.body["token_ids"] == prompt.token_ids
    ((offset, length),) = prompt.placeholders
    assert sent.body["features"]["mm_placeholders"] == {"image": [{"offset": offset, "length": length}]}
    digest = content_hash(upload)
    assert sent.body["features"]["mm_hashes"] == {"image": [renderer.picture_hash(digest)]}
    assert (sent.body["sampling_params"]["max_tokens"], sent.body["sampling_params"]["seed"]) == (6, 4)
    # the CPU stage rendered it into the stage cache, where the inference worker read it
    address = renderer.picture_address(digest, repr(params), cache_scope(DEFAULT_TENANT, shared=False))
    assert redis.Redis.from_url(fleet.env["STOKER_CACHE_URL"]).exists(cache_key(address, ITEM)) == 1


def test_a_streamed_answer_comes_back_piece_by_piece(
    chain: tuple[FakeServer, Fleet, openai.OpenAI], renderer: Renderer
) -> None:
    fake, _, client = chain
    words = "Streamed through generate."
    ids = renderer.tokenizer.tokenizer.encode(words, add_special_tokens=False)
    fake.stream_tokens = [[token] for token in ids]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream it (marker-stream)."}], stream=True
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1
    assert "".join(pieces) == words
    sent = _sent(fake, renderer, "marker-stream")
    assert (sent.body["stream"], sent.body["output_mode"]) == (True, "tokens")


def test_a_tool_call_comes_back_parsed_by_the_server(
    chain: tuple[FakeServer, Fleet, openai.OpenAI], renderer: Renderer
) -> None:
    fake, _, client = chain
    weather: Any = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    forced: Any = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather (marker-tools)?"}],
        tools=[weather],
        tool_choice=forced,
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Bergen"}')
    sent = _sent(fake, renderer, "marker-tools")
    assert (sent.body["output_mode"], sent.body["parse_context"]["tool_choice"]) == ("derender", forced)
    assert sent.body["sampling_params"]["structured_outputs"] == {"json": weather["function"]["parameters"]}
