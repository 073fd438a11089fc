"""A render's answer written the fast way (`RenderedPicture.wire` made from its cache entry, `request_json` copying
the items in) is byte for byte the answer of the way before it: each picture's item decoded back to tensors,
encoded again (`encode_item`) and the whole `GenerateRequest` written by Starlette's `JSONResponse`. For every
recorded case of `tests/fixtures/vllm_render` (its token ids and vLLM's other fields), and for fields whose JSON
needs escaping."""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from starlette.responses import JSONResponse

from stoker.adapters.render import RenderedPicture, Renderer
from stoker.adapters.vllm_render import (
    FieldSpec,
    ItemElement,
    Mapped,
    Repeat,
    WireItem,
    WireTensor,
    encode_item,
    features,
    idefics3_item,
    idefics3_tensors,
    item_bytes,
    metadata_item,
    request_json,
)
from tests.fixtures.vllm_render import corpus

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm_render"
MODELS = Path("~/.cache/stoker/models").expanduser()
SEES = {"smollm2-135m-instruct": False, "tiny-vlm-v1": True}
RECORDED = [(model, case) for model, sees in SEES.items() for case in corpus.cases_for(sees)]


@cache
def rendered_picture(name: str) -> RenderedPicture:
    return Renderer(str(MODELS / "tiny-vlm-v1")).picture(corpus.picture(name))


def slow_features(hashes: list[str], placeholders: list[tuple[int, int]], pictures: list[RenderedPicture]) -> Any:
    """`features` as the API wrote it before: from each item's tensors, encoded again."""
    if not hashes:
        return None
    items = [p.item for p in pictures]
    metadata = [metadata_item(item) for item in items]
    return {
        "mm_hashes": {"image": hashes},
        "mm_placeholders": {"image": [{"offset": offset, "length": length} for offset, length in placeholders]},
        "kwargs_data": {"image": [encode_item(item) for item in items]},
        "mm_metadata": {"image": [encode_item(m) if m else None for m in metadata]} if any(metadata) else None,
    }


def answer(model: str, case: str, mm_features: Any) -> dict[str, Any]:
    """The recorded case's `GenerateRequest` in the field order stoker answers, with these features."""
    recorded = json.loads((FIXTURES / model / f"{case}.json").read_text())
    generate = recorded["generate"]
    order = ["request_id", "token_ids", "token_offsets", "features", *sorted(generate)]
    fields = {**generate, "request_id": f"chatcmpl-{case}", "token_ids": recorded["token_ids"], "features": mm_features}
    return {name: fields[name] for name in dict.fromkeys(order)}


@pytest.mark.parametrize(("model", "case"), RECORDED)
def test_the_answer_is_the_bytes_it_was(model: str, case: str) -> None:
    names = corpus.CASES[case]["pictures"] if SEES[model] else []
    cached = [RenderedPicture.from_bytes(rendered_picture(name).to_bytes()) for name in names]
    hashes = [f"{i:064x}" for i in range(len(names))]
    placeholders = [(10 * i, 7) for i in range(len(names))]
    fast = answer(model, case, features(hashes, placeholders, [p.wire for p in cached]))
    slow = answer(model, case, slow_features(hashes, placeholders, [rendered_picture(name) for name in names]))
    assert request_json(fast) == JSONResponse(slow).body
    if names:
        assert fast["features"]["kwargs_data"]["image"][0].decode() == slow["features"]["kwargs_data"]["image"][0]


def test_fields_that_need_escaping_are_written_as_json_writes_them() -> None:
    item = rendered_picture("flat").wire
    odd = ['quote " backslash \\ newline \n tab \t', "ünïcødé ✓", "\x00\x1f", "stoker-item-0:0", '"stoker-item-x:0"']
    assert item.mm_metadata is not None
    text = WireItem(item.kwargs_data.decode(), item.mm_metadata.decode())  # type: ignore[arg-type]  # as JSON takes it
    body = {"request_id": "r", "sampling_params": {"temperature": 0.7, "top_p": 1e-05}, "stop": odd}
    fast = body | {"features": features(["h"], [(1, 2)], [item, item])}
    assert request_json(fast) == JSONResponse(body | {"features": features(["h"], [(1, 2)], [text, text])}).body
    assert request_json({"features": None, "n": 3}) == JSONResponse({"features": None, "n": 3}).body
    assert request_json({"token_ids": [1, 2]}) == JSONResponse({"token_ids": [1, 2]}).body


def test_a_cache_entry_reads_back_as_it_was_written() -> None:
    picture = rendered_picture("portrait")
    back = RenderedPicture.from_bytes(picture.to_bytes())
    assert back == picture
    assert back.wire == WireItem.of(picture.item)
    assert back.wire.mm_metadata is not None  # num_patches stays on the CPU


def test_an_entry_of_the_earlier_layout_is_not_read_as_a_rendering() -> None:
    """Before, an entry was the layout as a line of JSON, then the item's msgpack bytes."""
    picture = rendered_picture("flat")
    earlier = json.dumps(picture.layout).encode() + b"\n" + msgspec.msgpack.encode({"pixel_values": 1})
    with pytest.raises(ValueError, match=r"Expected|msgpack"):
        RenderedPicture.from_bytes(earlier)


def test_an_entry_of_the_base64_layout_is_not_read_as_a_rendering() -> None:
    """Before, an entry was the layout and the item's base64 text as sent (`[layout, kwargs_data, mm_metadata]`)."""
    picture = rendered_picture("flat")
    wire = picture.wire
    assert wire.mm_metadata is not None
    earlier = msgspec.msgpack.encode([picture.layout, wire.kwargs_data.decode(), wire.mm_metadata.decode()])
    with pytest.raises(ValueError, match="Expected"):
        RenderedPicture.from_bytes(earlier)


def test_the_mask_is_cached_as_bits_and_read_back_as_vllms_int64() -> None:
    picture = rendered_picture("portrait")
    mask = picture.item["pixel_attention_mask"].tensor
    assert mask.dtype == "int64"
    entry = picture.to_bytes()
    # the pixel values as they are, the mask at one bit a value (8 bytes a value as vLLM sends it)
    assert len(entry) < len(picture.item["pixel_values"].tensor.data) + len(mask.data) // 60
    assert RenderedPicture.from_bytes(entry).item["pixel_attention_mask"].tensor == mask


@pytest.mark.parametrize("count", [8, 13, 64])
@pytest.mark.parametrize("zero", [None, 0, 7, -1])
def test_a_mask_reads_back_and_is_sent_whole_whether_all_ones_or_not(count: int, zero: int | None) -> None:
    # All ones (a picture's whole tiles) is written in one pass, any other unpacked bit by bit: both give the mask
    # as it was, whatever its length in bits (a last byte in part).
    values = np.ones(count, dtype="<i8")
    if zero is not None:
        values[zero] = 0
    mask = ItemElement(WireTensor.of(values), FieldSpec("batched"))
    picture = RenderedPicture.of({"rows": 1}, {"pixel_attention_mask": mask})
    back = RenderedPicture.from_bytes(picture.to_bytes())
    assert back.item["pixel_attention_mask"] == mask
    # as sent: all ones as a repeat of one value's text, any other spelled out; the same text either way
    assert bytes(back.wire.kwargs_data) == base64.b64encode(item_bytes({"pixel_attention_mask": mask}))


@pytest.mark.parametrize("odd", [-1, 2, 256])
def test_an_integer_tensor_not_of_0s_and_1s_is_cached_as_it_is(odd: int) -> None:
    values = np.ones(64, dtype="<i8")
    values[5] = odd  # -1 is all ones in two's complement, 256 a 1 in its second byte: neither is a bit
    mask = ItemElement(WireTensor.of(values), FieldSpec("batched"))
    entry = RenderedPicture.of({"rows": 1}, {"pixel_attention_mask": mask}).to_bytes()
    assert len(entry) > values.nbytes  # the values as they are, not bits
    back = RenderedPicture.from_bytes(entry)
    assert back.item["pixel_attention_mask"] == mask
    assert bytes(back.wire.kwargs_data) == base64.b64encode(item_bytes({"pixel_attention_mask": mask}))


@pytest.mark.parametrize("whole", [True, False])
def test_a_rendering_made_from_the_processors_tensors_is_its_item(whole: bool) -> None:
    # A mask of ones (whole tiles) travels as a repeat of one value, from the processor to the answer; any other
    # mask as vLLM's int64 values. Either way: the same item, the same cache entry read back, the same text sent.
    rng = np.random.default_rng(5)
    mask = np.ones((1, 2, 4, 4), dtype=bool)
    if not whole:
        mask[0, 1, 3, :] = False
    tensors = {"pixel_values": rng.standard_normal((1, 2, 3, 4, 4)).astype(np.float32), "pixel_attention_mask": mask}
    made = idefics3_tensors(tensors)
    assert isinstance(made[1].data, Repeat) is whole
    picture = RenderedPicture.of_tensors({"rows": 1}, made)
    item = idefics3_item(tensors)
    assert picture.item == item
    back = RenderedPicture.from_bytes(picture.to_bytes())
    assert back == RenderedPicture.of({"rows": 1}, item)
    assert back.wire == WireItem.of(item)


def test_a_rendering_of_8_bit_pixels_is_the_item_of_their_looked_up_values() -> None:
    # Pixel values kept as 8-bit pixels and their channels' tables make the item of the values the tables give, and
    # travel through the cache as 8 bits a value.
    rng = np.random.default_rng(8)
    pixels = rng.integers(0, 256, (1, 2, 3, 4, 4), dtype=np.uint8)
    tables = rng.standard_normal((3, 1, 256)).astype(np.float32)
    mask = np.ones((1, 2, 4, 4), dtype=bool)
    eight: dict[str, np.ndarray[Any, Any]] = {
        "pixel_values": pixels,
        "pixel_values_table": tables,
        "pixel_attention_mask": mask,
    }
    values = tables[np.arange(3)[None, None, :, None, None], 0, pixels]
    made = idefics3_tensors(eight)
    assert isinstance(made[0].data, Mapped)
    item = idefics3_item({"pixel_values": values, "pixel_attention_mask": mask})
    picture = RenderedPicture.of_tensors({"rows": 1}, made)
    assert picture.item == item
    entry = picture.to_bytes()
    assert len(entry) < pixels.nbytes + tables.nbytes  # 8 bits a value and the tables (as bfloat16), not 16 bits
    back = RenderedPicture.from_bytes(entry)
    assert back == RenderedPicture.of({"rows": 1}, item)
    assert back.wire == WireItem.of(item)
