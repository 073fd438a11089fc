"""Model-ready image tensors: the model's own image processor, on decoded pictures, as safetensors bytes."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.tinyvlm import IMAGE_SEQ_LEN, LONGEST_EDGE, TILE
from stoker.adapters.backends.vision import ImagePreparer, PreparedImage
from stoker.core.errors import ImageCorrupt, ModelUnavailable
from stoker.core.imaging import DecodeParams, decode_rgb
from stoker.settings import BUILTIN_MODEL, CommonSettings
from tests.conftest import missing
from tests.media import encode

PARAMS = DecodeParams()
#: The files an image processor is read from: a CPU worker needs no weights.
PROCESSOR_FILES = ("processor_config.json",)


@pytest.fixture(scope="module")
def preparer(tiny_vlm: Path) -> ImagePreparer:
    loaded = ImagePreparer.load(tiny_vlm)
    assert loaded is not None
    return loaded


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour gradients with noise: what a camera picture compresses like."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def reopened(data: bytes) -> Image.Image:
    """The file's stored pixels as Pillow reads them, with no orientation applied."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def landscape() -> tuple[bytes, Image.Image]:
    data = encode(photo(1000, 400), "JPEG", quality=90)
    return data, reopened(data)


def portrait() -> tuple[bytes, Image.Image]:
    data = encode(photo(400, 1000, seed=1), "PNG")
    return data, reopened(data)


def exif_rotated() -> tuple[bytes, Image.Image]:
    """Stored landscape, shown portrait: orientation 6 says turn it 90° clockwise."""
    stored = photo(1000, 400, seed=2)
    exif = stored.getexif()
    exif[0x0112] = 6
    data = encode(stored, "JPEG", quality=90, exif=exif.tobytes())
    return data, reopened(data).transpose(Image.Transpose.ROTATE_270)


def png_alpha() -> tuple[bytes, Image.Image]:
    """Left half transparent: the picture shows white there, as decode puts it on paper."""
    rgba = photo(600, 300, seed=3).convert("RGBA")
    alpha = np.full((300, 600), 255, dtype=np.uint8)
    alpha[:, :300] = 0
    rgba.putalpha(Image.fromarray(alpha, "L"))
    pixels = np.asarray(rgba.convert("RGB")).copy()
    pixels[:, :300] = 255
    return encode(rgba, "PNG"), Image.fromarray(pixels, "RGB")


def cmyk_jpeg() -> tuple[bytes, Image.Image]:
    data = encode(photo(640, 480, seed=4).convert("CMYK"), "JPEG", quality=90)
    return data, reopened(data).convert("RGB")


def one_pixel() -> tuple[bytes, Image.Image]:
    data = encode(Image.new("RGB", (1, 1), (200, 30, 90)), "PNG")
    return data, reopened(data)


def large_page() -> tuple[bytes, Image.Image]:
    """Bigger than the processor's longest edge: it is shrunk, then tiled."""
    data = encode(photo(1600, 1200, seed=5), "PNG")
    return data, reopened(data)


#: Each picture, and the tiles (rows, cols) SmolVLM's processor cuts it into at 1024 px and 512-px tiles.
PICTURES = {
    "landscape": (landscape, (1, 2)),
    "portrait": (portrait, (2, 1)),
    "exif_rotated": (exif_rotated, (2, 1)),
    "png_alpha": (png_alpha, (1, 2)),
    "cmyk_jpeg": (cmyk_jpeg, (2, 2)),
    "one_pixel": (one_pixel, (2, 2)),
    "large_page": (large_page, (2, 2)),
}


@pytest.mark.parametrize("name", PICTURES)
def test_tensors_equal_the_processor_run_on_the_picture(preparer: ImagePreparer, name: str) -> None:
    make, tiles = PICTURES[name]
    data, picture = make()
    prepared = PreparedImage.from_bytes(preparer.prepare(decode_rgb(data, PARAMS)).to_bytes())
    direct = preparer.processor(images=picture, return_row_col_info=True)

    assert set(prepared.tensors) == {"pixel_values", "pixel_attention_mask", "rows", "cols"}
    np.testing.assert_array_equal(prepared.tensors["pixel_values"], direct["pixel_values"].astype(np.float16))
    np.testing.assert_array_equal(prepared.tensors["pixel_attention_mask"], direct["pixel_attention_mask"] != 0)
    assert (prepared.tensors["rows"].tolist(), prepared.tensors["cols"].tolist()) == (direct["rows"], direct["cols"])
    rows, cols = tiles
    assert (int(prepared.tensors["rows"][0, 0]), int(prepared.tensors["cols"][0, 0])) == (rows, cols)
    # One 512-px crop per tile and the whole picture downscaled: what the prompt's image tokens stand for.
    assert prepared.tensors["pixel_values"].shape == (1, rows * cols + 1, 3, TILE, TILE)
    assert prepared.meta == {
        "processor": preparer.identity,
        "processor_class": "Idefics3ImageProcessorPil",
        "size": list(picture.size),
    }


def test_transparency_is_white_and_rotation_is_applied(preparer: ImagePreparer) -> None:
    # The global view (last crop) of the alpha picture: its left half is paper white, 1.0 once normalised.
    alpha = preparer.prepare(decode_rgb(png_alpha()[0], PARAMS)).tensors["pixel_values"][0, -1]
    assert float(alpha[:, :, : TILE // 4].min()) == 1.0
    assert float(alpha[:, :, -TILE // 4 :].min()) < 1.0
    stored_landscape = encode(photo(1000, 400, seed=2), "JPEG", quality=90)
    plain = preparer.prepare(decode_rgb(stored_landscape, PARAMS))
    turned = preparer.prepare(decode_rgb(exif_rotated()[0], PARAMS))
    assert (plain.meta["size"], turned.meta["size"]) == ([1000, 400], [400, 1000])


def test_round_trip_through_bytes_is_exact(preparer: ImagePreparer) -> None:
    prepared = preparer.prepare(decode_rgb(large_page()[0], PARAMS))
    data = prepared.to_bytes()
    back = PreparedImage.from_bytes(data)
    assert back.meta == prepared.meta
    assert set(back.tensors) == set(prepared.tensors)
    for name, array in prepared.tensors.items():
        assert back.tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(back.tensors[name], array)
    assert prepared.tensors["pixel_values"].dtype == np.float16
    assert prepared.tensors["pixel_attention_mask"].dtype == np.bool_
    # safetensors: an 8-byte header length, then a JSON header naming every tensor and the metadata.
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert json.loads(header["__metadata__"]["stoker"])["format"] == "stoker.vision/1"
    assert set(header) == {"__metadata__", *prepared.tensors}


@pytest.mark.parametrize("data", [b"", b"\x80\x04K\x01.", b"\x10" + b"\0" * 7 + b'{"a": 1}'])
def test_bytes_that_are_not_prepared_tensors_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="prepared image tensors"):
        PreparedImage.from_bytes(data)


def _processor_copy(tiny_vlm: Path, where: Path, **image_config: Any) -> Path:
    where.mkdir()
    for name in PROCESSOR_FILES:
        shutil.copy(tiny_vlm / name, where / name)
    if image_config:
        config = json.loads((where / "processor_config.json").read_text())
        config["image_processor"].update(image_config)
        (where / "processor_config.json").write_text(json.dumps(config))
    return where


def test_identity_follows_the_processor_config_only(tiny_vlm: Path, preparer: ImagePreparer, tmp_path: Path) -> None:
    def identity(directory: Path) -> str:
        loaded = ImagePreparer.load(directory)
        assert loaded is not None
        return loaded.identity

    # Loaded again, or from another directory holding only the processor's config (no weights): the same.
    assert identity(tiny_vlm) == preparer.identity
    assert identity(_processor_copy(tiny_vlm, tmp_path / "copy")) == preparer.identity
    assert identity(_processor_copy(tiny_vlm, tmp_path / "tiles", max_image_size={"longest_edge": 384})) != (
        preparer.identity
    )
    assert identity(_processor_copy(tiny_vlm, tmp_path / "edge", size={"longest_edge": LONGEST_EDGE * 2})) != (
        preparer.identity
    )
    assert identity(_processor_copy(tiny_vlm, tmp_path / "split", do_image_splitting=False)) != preparer.identity


def test_a_config_change_changes_the_tensors_it_stands_for(tiny_vlm: Path, tmp_path: Path) -> None:
    unsplit = ImagePreparer.load(_processor_copy(tiny_vlm, tmp_path / "split", do_image_splitting=False))
    assert unsplit is not None
    prepared = unsplit.prepare(decode_rgb(large_page()[0], PARAMS))
    assert prepared.tensors["pixel_values"].shape == (1, 1, 3, TILE, TILE)
    assert prepared.tensors["rows"].tolist() == [[0]]
    assert prepared.meta["processor"] == unsplit.identity
    assert IMAGE_SEQ_LEN == 64


def test_a_text_only_model_has_no_image_processor() -> None:
    try:
        text_model = resolve_model(BUILTIN_MODEL, CommonSettings().model_cache, fetch=False)
    except ModelUnavailable:
        missing("the built-in model is not fetched: run `make model`")
    assert ImagePreparer.load(text_model) is None


def test_prepare_takes_decoded_rgb_only(preparer: ImagePreparer) -> None:
    with pytest.raises(ValueError, match="RGB"):
        preparer.prepare(Image.new("RGBA", (4, 4)))


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> ImagePreparer:
    """Qwen2-VL's image processor (config only, as a CPU worker loads it): patches and a grid, no tiles."""
    from transformers import Qwen2VLImageProcessorPil

    where = tmp_path_factory.mktemp("qwen2-vl")
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448).save_pretrained(where)
    loaded = ImagePreparer.load(where)
    assert loaded is not None
    return loaded


def test_qwen2_vl_tensors_are_its_patches_and_grid(qwen2_vl: ImagePreparer) -> None:
    data, picture = exif_rotated()
    prepared = PreparedImage.from_bytes(qwen2_vl.prepare(decode_rgb(data, PARAMS)).to_bytes())
    direct = qwen2_vl.processor(images=picture)
    assert set(prepared.tensors) == {"pixel_values", "image_grid_thw"}
    np.testing.assert_array_equal(prepared.tensors["pixel_values"], direct["pixel_values"].astype(np.float16))
    np.testing.assert_array_equal(prepared.tensors["image_grid_thw"], direct["image_grid_thw"])
    _, rows, cols = prepared.tensors["image_grid_thw"][0].tolist()
    assert rows > cols  # the grid of a portrait: the EXIF rotation was applied
    assert prepared.meta["processor_class"] == "Qwen2VLImageProcessorPil"


def test_a_picture_the_processor_rejects_is_a_structured_error(qwen2_vl: ImagePreparer) -> None:
    # Qwen2-VL refuses an aspect ratio over 200: a 1×500 sliver is the picture's fault, not the model's.
    sliver = encode(Image.new("RGB", (1, 500), "white"), "PNG")
    with pytest.raises(ImageCorrupt, match="aspect ratio") as caught:
        qwen2_vl.prepare(decode_rgb(sliver, PARAMS))
    assert (caught.value.code, caught.value.stage) == ("image_corrupt", "decode")
