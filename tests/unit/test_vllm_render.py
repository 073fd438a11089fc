"""vLLM's encoding of a multimodal kwargs item (`stoker.adapters.vllm_render`) against items vLLM wrote itself."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker.adapters.vllm_render import (
    VLLM_VERSION,
    Base64Stream,
    FieldSpec,
    ItemElement,
    ItemTensor,
    Mapped,
    Repeat,
    WireItem,
    WireTensor,
    decode_item,
    encode_item,
    item_bytes,
    item_tensors,
    item_text,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm_render"


def _recorded_items() -> dict[str, Any]:
    items: dict[str, Any] = json.loads(
        gzip.decompress((FIXTURES / "tiny-vlm-v1" / "flat_picture.items.json.gz").read_bytes())
    )
    return items


def _summary() -> dict[str, Any]:
    features: dict[str, Any] = json.loads((FIXTURES / "tiny-vlm-v1" / "flat_picture.json").read_text())["features"]
    return features


def test_recorded_by_the_vllm_this_module_mirrors() -> None:
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    assert manifest["vllm"] == VLLM_VERSION


@pytest.mark.parametrize("part", ["kwargs_data", "mm_metadata"])
def test_an_item_vllm_wrote_decodes_to_its_tensors_and_encodes_to_its_bytes(part: str) -> None:
    encoded = _recorded_items()[part]["image"][0]
    summary = _summary()[part]["image"][0]
    item = decode_item(encoded)
    assert list(item) == summary["keys"]  # the processor's key order, kept
    for key, element in item.items():
        expected = summary["tensors"][key]
        assert element.tensor.dtype == expected["dtype"]
        assert list(element.tensor.shape) == expected["shape"]
        assert hashlib.sha256(element.tensor.data).hexdigest() == expected["sha256"]
        assert element.field.wire() == expected["field"]
    assert encode_item(item) == encoded
    assert hashlib.sha256(item_bytes(item)).hexdigest() == summary["sha256"]


def test_the_flat_pictures_tensors_read_as_numbers() -> None:
    item = decode_item(_recorded_items()["kwargs_data"]["image"][0])
    pixels = item["pixel_values"].tensor.to_numpy()
    assert pixels.shape == (5, 3, 512, 512)
    # grey 128 rescaled and normalised with mean and std 0.5: 128/255*2-1, in bfloat16
    assert float(np.abs(pixels[0, :, :10, :10] - (128 / 255 * 2 - 1)).max()) < 2**-8
    assert int(item["num_patches"].tensor.to_numpy()) == 5


def test_bfloat16_rounds_as_torch_does() -> None:
    rng = np.random.default_rng(3)
    values = np.concatenate(
        [
            rng.normal(0, 1, 10_000).astype(np.float32),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 3.4e38, 1 + 2**-8, 1 + 3 * 2**-8], np.float32),
        ]
    )
    ours = WireTensor.bfloat16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert ours.data == theirs
    assert ours.dtype == "bfloat16"
    assert ours.shape == values.shape


def test_an_item_round_trips() -> None:
    mask = np.ones((2, 4, 4), dtype=np.int64)
    item = {
        "pixel_values": ItemElement(
            WireTensor.bfloat16(np.linspace(-1, 1, 96, dtype=np.float32).reshape(2, 3, 4, 4)),
            FieldSpec("flat", slices=((slice_of(0, 2),),)),
        ),
        "pixel_attention_mask": ItemElement(WireTensor.of(mask), FieldSpec("flat", slices=((slice_of(0, 2),),))),
        "num_patches": ItemElement(WireTensor.of(np.array(2, dtype=np.int64)), FieldSpec("batched", keep_on_cpu=True)),
    }
    back = decode_item(encode_item(item))
    assert back == item
    assert np.array_equal(back["pixel_attention_mask"].tensor.to_numpy(), mask)


def slice_of(start: int, stop: int) -> tuple[int, int, None]:
    """A slice as vLLM encodes one: start, stop, step."""
    return (start, stop, None)


@pytest.mark.parametrize(
    "encoded",
    [
        "not base64!",
        base64.b64encode(b"\x01").decode(),
        base64.b64encode(
            b"\x81\xa1k\x82\xa4data\x93\xa5int64\x91\x02\xd4\x03\x00\xa5field\x92\xa7batched\x80"
        ).decode(),
    ],
)
def test_what_is_not_an_item_is_refused(encoded: str) -> None:
    with pytest.raises(ValueError, match="not a multimodal kwargs item"):
        decode_item(encoded)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4096, 3 * 4096 + 1])
def test_an_item_is_written_in_standard_base64(size: int) -> None:
    noise = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    item = {"pixel_values": ItemElement(WireTensor("uint8", (size,), noise.tobytes()))}
    assert encode_item(item) == base64.b64encode(item_bytes(item)).decode("ascii")
    assert bytes(WireItem.of(item).kwargs_data) == base64.b64encode(item_bytes(item))


def test_a_stream_written_in_parts_is_the_base64_of_the_whole() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        parts = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(0, 9, rng.integers(1, 7))]
        stream = Base64Stream()
        for part in parts:
            stream.write(part)
        assert bytes(stream.text()) == base64.b64encode(b"".join(parts)), [len(p) for p in parts]


@pytest.mark.parametrize("unit", [b"\x01", b"\x01\x00", b"abc", b"\x01" + bytes(7), b"\x05\x06\x07\x08\x09"])
def test_a_repeat_is_the_base64_of_its_unit_spelled_out(unit: bytes) -> None:
    for before in (b"", b"x", b"xy"):  # the stream's carry when the repeat starts: 0, 1 or 2 bytes
        for count in [0, 1, 2, 3, 4, 5, 7, 8, 23, 24, 25, 100]:
            stream = Base64Stream()
            stream.write(before)
            stream.write_repeated(Repeat(unit, count))
            stream.write(b"!")
            assert bytes(stream.text()) == base64.b64encode(before + unit * count + b"!"), (before, count)


@pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 8, 15, 16, 17, 255, 256, 65535, 65536, 70001])
def test_an_items_text_made_in_pieces_is_its_msgpack_in_base64(length: int) -> None:
    # Every form of msgpack's extension head (fixext 1 to 16, ext 8, 16 and 32), as msgspec writes it.
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    item = {
        "pixel_values": ItemElement(WireTensor("uint8", (length,), data), FieldSpec("flat", slices=(((0, 1, None),),))),
        "num_patches": ItemElement(WireTensor.of(np.array(1, dtype=np.int64)), FieldSpec("batched", True)),
    }
    assert bytes(item_text(item_tensors(item))) == base64.b64encode(item_bytes(item))


def test_a_repeated_tensor_is_written_as_its_bytes_spelled_out() -> None:
    ones = np.ones((3, 7, 5), dtype=np.int64)
    item = {"pixel_attention_mask": ItemElement(WireTensor.of(ones), FieldSpec("flat", slices=(((0, 3, None),),)))}
    field = item["pixel_attention_mask"].field.wire()
    repeated = [ItemTensor("pixel_attention_mask", "int64", (3, 7, 5), Repeat(np.int64(1).tobytes(), 105), field)]
    text = item_text(repeated)
    assert bytes(text) == base64.b64encode(item_bytes(item))
    assert len(text.pieces) > 1  # written in pieces, never joined on the way


def test_a_repeat_longer_than_its_shared_pieces_is_written_whole() -> None:
    # A picture's mask, five 512 × 512 tiles of int64 ones and a few more: more text than one shared piece holds.
    unit, count = np.int64(1).tobytes(), 5 * 512 * 512 + 3
    stream = Base64Stream()
    stream.write(b"\x93")
    stream.write_repeated(Repeat(unit, count))
    text = stream.text()
    assert bytes(text) == base64.b64encode(b"\x93" + unit * count)
    assert len(set(map(id, text.pieces))) < len(text.pieces)  # the same piece, written again


@pytest.mark.parametrize(("width", "side"), [(2, (4, 5)), (4, (4, 5)), (2, (3, 5)), (8, (4, 5)), (1, (2, 2))])
def test_mapped_values_are_their_channels_table_entries(width: int, side: tuple[int, int]) -> None:
    # Three tiles of three channels of planes: each plane looked up in its channel's table, channels in turn (two
    # values at a time in planes of even length, one at a time in the others and for 8-byte entries).
    rng = np.random.default_rng(width)
    indices = rng.integers(0, 256, (3, 3, *side), dtype=np.uint8)
    tables = rng.integers(0, 1 << min(8 * width, 63), (3, 256), dtype=np.uint64).astype(f"<u{width}")
    plane = side[0] * side[1]
    mapped = Mapped(memoryview(indices.tobytes()), tables.tobytes(), plane, width)
    expected = tables[np.arange(3)[None, :, None, None], indices].tobytes()
    assert b"".join(bytes(p) for p in mapped.planes()) == expected
    assert len(mapped) == len(expected)
    field = FieldSpec("flat", slices=(((0, 3, None),),)).wire()
    dtype = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "int64"}[width]
    text = item_text([ItemTensor("pixel_values", dtype, (3, 3, *side), mapped, field)])
    spelled = ItemElement(WireTensor(dtype, (3, 3, *side), expected), FieldSpec.from_wire(field))
    assert bytes(text) == base64.b64encode(item_bytes({"pixel_values": spelled}))
