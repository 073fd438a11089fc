"""stoker's render (`stoker.adapters.render`) against vLLM 0.33.0's own, recorded for the corpus of
`tests/fixtures/vllm_render` (`make peer` records it again and runs these).

Token ids, placeholder ranges, sampling parameters and parse context equal vLLM's for every case of both models, and
every tensor (`pixel_values`, `pixel_attention_mask`, `num_patches`) is bit-equal for every picture: both sides run
the image processor's torchvision backend (`Idefics3ImageProcessor`: stoker pins it, `stoker.adapters.backends.vision`;
vLLM's venv gets it by default) and cast to bfloat16 with torch. The PIL backend (`Idefics3ImageProcessorPil`) resizes
differently: 1 to 3% of the bfloat16 values differed, by at most 0.0176, when stoker ran it. The transformers
versions (5.20.2 in vLLM's venv, 5.25.0 in stoker's) make no difference to these bits.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from stoker.adapters.render import Renderer
from stoker.adapters.vllm_render import TEMPLATE_DEFAULTS, item_bytes, metadata_item, sampling_params
from tests.fixtures.vllm_render import corpus

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm_render"
MODELS = Path("~/.cache/stoker/models").expanduser()
SEES = {"smollm2-135m-instruct": False, "tiny-vlm-v1": True}
RECORDED = [(model, case) for model, sees in SEES.items() for case in corpus.cases_for(sees)]


@cache
def renderer(model: str) -> Renderer:
    return Renderer(str(MODELS / model))


@cache
def rendered_picture(model: str, name: str) -> Any:
    return renderer(model).picture(corpus.picture(name))


def recorded(model: str, case: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((FIXTURES / model / f"{case}.json").read_text())
    assert found["status"] == 200, found.get("error")
    return found


def render(model: str, case: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The case rendered by stoker: its token ids and placeholder ranges."""
    body = corpus.body(case, model)
    if "prompt" in body:
        return renderer(model).completion(body["prompt"]).token_ids, []
    messages = [_shown(m) for m in body["messages"]]
    layouts = [rendered_picture(model, name).layout for name in corpus.CASES[case]["pictures"]]
    out = renderer(model).chat(
        messages,
        layouts,
        body.get("tools"),
        body.get("add_generation_prompt", True),
        body.get("continue_final_message", False),
    )
    return out.token_ids, out.placeholders


def _shown(message: dict[str, Any]) -> dict[str, Any]:
    content = message["content"]
    if isinstance(content, str):
        return message
    return {**message, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in content]}


@pytest.mark.parametrize(("model", "case"), RECORDED)
def test_token_ids_and_placeholders_equal_vllms(model: str, case: str) -> None:
    expected = recorded(model, case)
    token_ids, placeholders = render(model, case)
    assert token_ids == expected["token_ids"]
    ranges = (expected["features"] or {}).get("mm_placeholders", {}).get("image", [])
    assert placeholders == [(r["offset"], r["length"]) for r in ranges]


@pytest.mark.parametrize(("model", "case"), RECORDED)
def test_sampling_params_and_parse_context_equal_vllms(model: str, case: str) -> None:
    expected = recorded(model, case)["generate"]
    body = corpus.body(case, model)
    stop = body.get("stop")
    ours = sampling_params(
        max_tokens=body["max_tokens"],
        temperature=body.get("temperature", 1.0),
        top_p=body.get("top_p"),
        seed=body.get("seed"),
        stop=[stop] if isinstance(stop, str) else stop,
        tools_parsed=bool(body.get("tools")) and body.get("tool_choice") != "none",
    )
    assert ours == expected["sampling_params"]
    if "messages" in body:
        template = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            **TEMPLATE_DEFAULTS,
        }
        assert expected["parse_context"]["chat_template_kwargs"] == template
        assert expected["parse_context"]["tools"] == body.get("tools")


PICTURED = [(case, i, name) for case in corpus.cases_for(True) for i, name in enumerate(corpus.CASES[case]["pictures"])]


@pytest.mark.parametrize(("case", "index", "name"), PICTURED)
def test_tensors_equal_vllms(case: str, index: int, name: str) -> None:
    expected = recorded("tiny-vlm-v1", case)["features"]["kwargs_data"]["image"][index]
    item = rendered_picture("tiny-vlm-v1", name).item
    # the same keys; their order in vLLM's item is not stable between its runs (two recordings of one corpus on one
    # host, 2026-12-06, listed pixel_values first and last), and a decoder reads a map by key
    assert sorted(item) == sorted(expected["keys"])
    for key, element in item.items():
        want = expected["tensors"][key]
        assert (element.tensor.dtype, list(element.tensor.shape)) == (want["dtype"], want["shape"])
        assert element.field.wire() == want["field"]
        assert hashlib.sha256(element.tensor.data).hexdigest() == want["sha256"], f"{key} of {name}: not bit-equal"
    as_recorded = {key: item[key] for key in expected["keys"]}  # in the recording's order: the bytes vLLM sent
    assert hashlib.sha256(item_bytes(as_recorded)).hexdigest() == expected["sha256"]


def test_the_processor_is_the_torchvision_backend() -> None:
    """The backend vLLM's renderer runs: the PIL one would make other pixel values."""
    assert type(renderer("tiny-vlm-v1").preparer.processor).__name__ == "Idefics3ImageProcessor"  # type: ignore[union-attr]


@pytest.mark.parametrize(("case", "index", "name"), PICTURED)
def test_metadata_equals_vllms(case: str, index: int, name: str) -> None:
    expected = recorded("tiny-vlm-v1", case)["features"]["mm_metadata"]["image"][index]
    metadata = metadata_item(rendered_picture("tiny-vlm-v1", name).item)
    assert hashlib.sha256(item_bytes(metadata)).hexdigest() == expected["sha256"]
