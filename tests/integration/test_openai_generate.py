"""The `openai` backend speaking vLLM's generate protocol (`STOKER_OPENAI_PROTOCOL`) to the fake server on loopback:
each request rendered with the tiny VLM's own tokenizer and image processor, checked by the fake against vLLM's
`GenerateRequest` schema, its pictures' tensors decoded and compared with the processor's."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from stoker.adapters.backends.remote import OpenAIPredictor
from stoker.adapters.generate import RequestRenderer
from stoker.adapters.render import RenderedPicture, Renderer
from stoker.core.errors import ContextLengthExceeded, InferenceFailed
from stoker.core.imaging import DecodeParams, decode_rgb, served_picture
from stoker.core.model import GenerationParams, ModelRequest, Prediction, run_predictor
from stoker.core.tools import FunctionName, FunctionSpec, NamedToolChoice, ToolSpec
from tests.fakeopenai import FakeServer, fake_openai_server
from tests.media import text_image

FALLBACKS = "stoker_openai_generate_fallbacks_total"
UPLOAD = text_image("TOTAL 42", size=(900, 300))
#: The picture as the chat path sends it (a data URL of the decoded picture).
SERVED = served_picture(decode_rgb(UPLOAD, DecodeParams()), 4096)
WEATHER = ToolSpec(
    function=FunctionSpec(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    )
)


@pytest.fixture(scope="module")
def renderer(tiny_vlm: Path) -> Renderer:
    return Renderer(str(tiny_vlm), "bfloat16")


@pytest.fixture(scope="module")
def picture(renderer: Renderer) -> RenderedPicture:
    return renderer.picture(decode_rgb(UPLOAD, DecodeParams()))


@pytest.fixture
def predictors() -> Iterator[list[OpenAIPredictor]]:
    opened: list[OpenAIPredictor] = []
    yield opened
    for predictor in opened:
        predictor.close()


def _predictor(
    server: FakeServer,
    renderer: Renderer,
    picture: RenderedPicture,
    opened: list[OpenAIPredictor],
    **options: object,
) -> OpenAIPredictor:
    rendering = RequestRenderer(renderer, lambda digest, _scope: {"pic": picture}.get(digest), "vlm")
    settings: dict[str, object] = {"max_new_tokens": 16, "timeout_s": 10, "attempts": 1, "rendering": rendering}
    settings["images"] = lambda digest, _scope: {"pic": SERVED}.get(digest)
    predictor = OpenAIPredictor(server.url, "vlm", **{**settings, **options})  # type: ignore[arg-type]
    predictor.setup("cpu")
    opened.append(predictor)
    return predictor


def _chat(text: str, images: list[str] | None = None, **params: object) -> ModelRequest:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    return ModelRequest([1], messages, images or [], "scope", GenerationParams(**params))


def _fallbacks() -> float:
    return REGISTRY.get_sample_value(FALLBACKS) or 0.0


def test_a_prompt_over_the_served_models_context_is_refused_as_vllm_refuses_it(renderer: Renderer) -> None:
    rendering = RequestRenderer(renderer, lambda _digest, _scope: None, "vlm")
    words = renderer.max_model_len + 16
    with pytest.raises(ContextLengthExceeded) as refused:
        rendering.body(_chat("word " * words), max_tokens=4, priority=0, stream=False)
    assert (refused.value.code, refused.value.http_status) == ("context_length_exceeded", 400)
    assert f"This model's maximum context length is {renderer.max_model_len} tokens" in refused.value.message


def test_a_picture_goes_rendered_never_as_a_picture_and_its_tensors_are_the_processors(
    renderer: Renderer, picture: RenderedPicture, predictors: list[OpenAIPredictor]
) -> None:
    with fake_openai_server(generate=True) as server:
        predictor = _predictor(server, renderer, picture, predictors, batch_priority=7)
        request = _chat("What is the total?", ["pic"], max_tokens=9, temperature=0.5, seed=3, stop=("END",))
        (answer,) = run_predictor(predictor, [request])
    assert isinstance(answer, Prediction), answer
    assert answer.text == "fake generated with 1 image(s)"
    assert server.bodies == []  # no chat completion, no picture
    (sent,) = server.generated
    expected = renderer.chat(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "What is the total?"}, {"type": "image"}]},
        ],
        [picture.layout],
    )
    body = sent.body
    assert body["token_ids"] == expected.token_ids
    ((offset, length),) = expected.placeholders
    assert body["features"]["mm_placeholders"] == {"image": [{"offset": offset, "length": length}]}
    assert body["features"]["mm_hashes"] == {"image": [renderer.picture_hash("pic")]}
    assert sent.items == [picture.item]  # every tensor bit-equal, with its field
    sampling = body["sampling_params"]
    assert (sampling["max_tokens"], sampling["temperature"], sampling["seed"], sampling["stop"]) == (9, 0.5, 3, ["END"])
    assert (body["output_mode"], body["stream"], body["priority"], body["model"]) == ("derender", False, 0, "vlm")
    assert (answer.prompt_tokens, answer.completion_tokens) == (len(expected.token_ids), 3)


def test_n_logprobs_and_a_batch_lines_priority_go_with_the_render(
    renderer: Renderer, picture: RenderedPicture, predictors: list[OpenAIPredictor]
) -> None:
    with fake_openai_server(generate=True) as server:
        predictor = _predictor(server, renderer, picture, predictors, batch_priority=7)
        line = _chat("two answers", n=2, logprobs=True, top_logprobs=2)
        line = ModelRequest(line.prompt_ids, line.messages, params=line.params, background=True)
        (answer,) = run_predictor(predictor, [line])
    assert isinstance(answer, Prediction), answer
    (sent,) = server.generated
    assert (sent.body["priority"], sent.body["sampling_params"]["n"], sent.body["sampling_params"]["logprobs"]) == (
        7,
        2,
        2,
    )
    assert sent.body["features"] is None
    assert [answer.text, *(m.text for m in answer.more)] == [
        "fake generated with 0 image(s)",
        "fake generated with 0 image(s) (choice 1)",
    ]
    assert answer.logprobs is not None
    assert [e["token"] for e in answer.logprobs] == answer.text.split()
    assert all(len(e["top_logprobs"]) == 2 for e in answer.logprobs)


def test_a_streamed_answer_comes_as_tokens_detokenized_piece_by_piece(
    renderer: Renderer, picture: RenderedPicture, predictors: list[OpenAIPredictor]
) -> None:
    words = "Hello from the fake generate server."
    ids = renderer.tokenizer.tokenizer.encode(words, add_special_tokens=False)
    got: list[str] = []
    with fake_openai_server(generate=True) as server:
        server.stream_tokens = [ids[i : i + 2] for i in range(0, len(ids), 2)]
        predictor = _predictor(server, renderer, picture, predictors, pieces=lambda _job, piece: got.append(piece))
        request = ModelRequest([1], [{"role": "user", "content": "stream"}], ["pic"], stream_to="job-1")
        (answer,) = run_predictor(predictor, [request])
    assert isinstance(answer, Prediction), answer
    (sent,) = server.generated
    assert (sent.body["stream"], sent.body["output_mode"], sent.body["sampling_params"]["output_kind"]) == (
        True,
        "tokens",
        1,
    )
    assert len(got) > 1  # piece by piece, not the whole at the end
    assert "".join(got) == answer.text == words
    assert (answer.finish_reason, answer.completion_tokens) == ("length", len(ids))


def test_tools_go_in_the_parse_context_and_a_forced_call_comes_back_parsed(
    renderer: Renderer, picture: RenderedPicture, predictors: list[OpenAIPredictor]
) -> None:
    forced = NamedToolChoice(function=FunctionName(name="get_weather"))
    with fake_openai_server(generate=True) as server:
        predictor = _predictor(server, renderer, picture, predictors)
        (answer,) = run_predictor(predictor, [_chat("Weather in Bergen?", tools=(WEATHER,), tool_choice=forced)])
    assert isinstance(answer, Prediction), answer
    assert answer.finish_reason == "tool_calls"
    assert answer.tool_calls == [
        {"id": "call_gen", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bergen"}'}}
    ]
    (sent,) = server.generated
    context = sent.body["parse_context"]
    assert context["tools"] == [WEATHER.model_dump(exclude_none=True)]
    assert context["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    sampling = sent.body["sampling_params"]
    assert sampling["structured_outputs"] == {"json": WEATHER.function.parameters}  # the call constrained
    assert sampling["skip_special_tokens"] is False  # the parser reads the call's markers


@pytest.mark.parametrize("scale_out_off", [False, True], ids=["no-route-404", "scale-out-off-403"])
def test_a_server_without_generate_gets_chat_completions_said_once_and_counted(
    renderer: Renderer,
    picture: RenderedPicture,
    predictors: list[OpenAIPredictor],
    caplog: pytest.LogCaptureFixture,
    scale_out_off: bool,
) -> None:
    before = _fallbacks()
    with fake_openai_server(scale_out_off=scale_out_off) as server, caplog.at_level(logging.WARNING):
        predictor = _predictor(server, renderer, picture, predictors)
        first = run_predictor(predictor, [_chat("one", ["pic"])])
        second = run_predictor(predictor, [_chat("two", ["pic"]), _chat("three")])
    assert [a.text for a in (*first, *second)] == ["fake saw 1 image(s)", "fake saw 1 image(s)", "fake saw 0 image(s)"]  # type: ignore[union-attr]
    assert server.generate_calls == 1  # asked once; chat completions from then on
    assert server.pictures[0].uuid == "pic"  # as today: a data URL and its content hash
    assert _fallbacks() - before == 1
    warnings = [r for r in caplog.records if "/inference/v1/generate" in r.getMessage()]
    assert len(warnings) == 1
    assert predictor.protocol == "chat"


def test_chat_never_calls_generate_and_generate_never_falls_back(
    renderer: Renderer, picture: RenderedPicture, predictors: list[OpenAIPredictor]
) -> None:
    with fake_openai_server(generate=True) as server:
        chat = _predictor(server, renderer, picture, predictors, protocol="chat")
        (answer,) = run_predictor(chat, [_chat("hello", ["pic"])])
    assert isinstance(answer, Prediction), answer
    assert answer.text == "fake saw 1 image(s)"
    assert server.generate_calls == 0
    before = _fallbacks()
    with fake_openai_server() as server:
        generate = _predictor(server, renderer, picture, predictors, protocol="generate")
        (failed,) = run_predictor(generate, [_chat("hello")])
    assert isinstance(failed, InferenceFailed)
    assert "--enable-scale-out" in failed.message
    assert (server.generate_calls, server.bodies, _fallbacks() - before) == (1, [], 0)
