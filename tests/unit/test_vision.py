"""Model-ready image tensors: the model's own image processor, on decoded pictures, as safetensors bytes."""

from __future__ import annotations

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
from tests.fakes.outbox import NoOutbox
from tests.media import PICTURES, encode, exif_rotated, large_page, photo, png_alpha

PARAMS = DecodeParams()
#: The files an image processor is read from: a CPU worker needs no weights.
PROCESSOR_FILES = ("processor_config.json",)


@pytest.fixture(scope="module")
def preparer(tiny_vlm: Path) -> ImagePreparer:
    loaded = ImagePreparer.load(tiny_vlm)
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("name", PICTURES)
def test_tensors_equal_the_processor_run_on_the_picture(preparer: ImagePreparer, name: str) -> None:
    make, tiles = PICTURES[name]
    data, picture = make()
    prepared = PreparedImage.from_bytes(preparer.prepare(decode_rgb(data, PARAMS)).to_bytes())
    direct = preparer.processor(images=picture, return_row_col_info=True)

    assert set(prepared.tensors) == {"pixel_values", "pixel_attention_mask", "rows", "cols"}
    np.testing.assert_array_equal(
        prepared.tensors["pixel_values"], np.asarray(direct["pixel_values"]).astype(np.float16)
    )
    np.testing.assert_array_equal(prepared.tensors["pixel_attention_mask"], direct["pixel_attention_mask"] != 0)
    assert (prepared.tensors["rows"].tolist(), prepared.tensors["cols"].tolist()) == (direct["rows"], direct["cols"])
    rows, cols = tiles
    assert (int(prepared.tensors["rows"][0, 0]), int(prepared.tensors["cols"][0, 0])) == (rows, cols)
    # One 512-px crop per tile and the whole picture downscaled: what the prompt's image tokens stand for.
    assert prepared.tensors["pixel_values"].shape == (1, rows * cols + 1, 3, TILE, TILE)
    assert prepared.meta == {
        "processor": preparer.identity,
        "processor_class": "Idefics3ImageProcessor",
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
    np.testing.assert_array_equal(
        prepared.tensors["pixel_values"], np.asarray(direct["pixel_values"]).astype(np.float16)
    )
    np.testing.assert_array_equal(prepared.tensors["image_grid_thw"], direct["image_grid_thw"])
    _, rows, cols = prepared.tensors["image_grid_thw"][0].tolist()
    assert rows > cols  # the grid of a portrait: the EXIF rotation was applied
    assert prepared.meta["processor_class"] == "Qwen2VLImageProcessor"


def _plain(where: Path | str) -> Any:
    """The model's image processor as transformers loads it, on its torchvision backend, untouched."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(where), backend="torchvision")


def _random_pictures(count: int) -> list[Image.Image]:
    rng = np.random.default_rng(64)
    sizes = [(1280, 960), (600, 1400), (1, 1), (3, 700), (2100, 37)]
    sizes += [(int(w), int(h)) for w, h in rng.integers(1, 1700, (count - len(sizes), 2))]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


@pytest.mark.parametrize("model", ["tiny-vlm", "qwen2-vl"])
def test_pictures_handed_over_pixel_by_pixel_make_the_processors_own_bits(
    model: str, tiny_vlm: Path, qwen2_vl: ImagePreparer, tmp_path: Path
) -> None:
    # Idefics3 resizes with Lanczos, Qwen2-VL with bicubic: both on pictures of random sizes, against the processor as
    # transformers runs it (each picture copied into planes first).
    preparer = ImagePreparer.load(tiny_vlm) if model == "tiny-vlm" else qwen2_vl
    assert preparer is not None
    where: Path | str = tiny_vlm
    if model == "qwen2-vl":
        preparer.processor.save_pretrained(tmp_path)
        where = tmp_path
    plain = _plain(where)
    for picture in _random_pictures(12):
        try:
            theirs = plain(images=picture, **preparer._extra())
        except ValueError:  # Qwen2-VL refuses a sliver: so does the preparer
            with pytest.raises(ImageCorrupt):
                preparer.prepare(picture)
            continue
        mine = preparer.prepare(picture).tensors
        for name, value in mine.items():
            np.testing.assert_array_equal(value, np.asarray(theirs[name]).astype(value.dtype), err_msg=name)


def _same_bits(mine: Any, theirs: Any) -> None:
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        a, b = np.asarray(mine[name]), np.asarray(value)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        if a.dtype == np.float32:  # bit for bit: -0.0 is not 0.0 here
            a, b = a.view(np.uint32), b.view(np.uint32)
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_one_pictures_tiles_written_in_place_are_the_processors_own_bits(tiny_vlm: Path) -> None:
    preparer = ImagePreparer.load(tiny_vlm, floats="float32")
    assert preparer is not None
    plain = _plain(tiny_vlm)
    for picture in _random_pictures(16):
        mine = preparer.processor(images=picture, return_row_col_info=True)
        # Written in place (its mask a view of one value), not by transformers' own code.
        assert mine["pixel_attention_mask"].stride() == (0, 0, 0, 0)
        _same_bits(mine, plain(images=picture, return_row_col_info=True))
        _same_bits(preparer.processor(images=picture), plain(images=picture))


def test_eight_bit_tiles_looked_up_in_their_tables_are_the_processors_own_bits(tiny_vlm: Path) -> None:
    eight = ImagePreparer.load(tiny_vlm, floats="float32", eight_bit=True)
    floats = ImagePreparer.load(tiny_vlm, floats="float32")
    assert eight is not None
    assert floats is not None
    assert eight.identity != floats.identity
    for picture in _random_pictures(8):
        mine, theirs = eight.prepare(picture).tensors, floats.prepare(picture).tensors
        pixels, tables = mine.pop("pixel_values"), mine.pop("pixel_values_table")
        assert pixels.dtype == np.dtype(np.uint8)
        assert tables.shape == (3, 1, 256)
        looked_up = tables[np.arange(3)[None, None, :, None, None], 0, pixels]
        np.testing.assert_array_equal(looked_up.view(np.uint32), theirs.pop("pixel_values").view(np.uint32))
        assert mine.keys() == theirs.keys()
        for name, value in theirs.items():
            np.testing.assert_array_equal(mine[name], value, err_msg=name)


def test_pictures_the_tiles_path_does_not_take_go_through_the_processors_own_code(tiny_vlm: Path) -> None:
    preparer = ImagePreparer.load(tiny_vlm, floats="float32")
    assert preparer is not None
    plain = _plain(tiny_vlm)
    two = _random_pictures(7)[5:]
    asks: list[tuple[Any, dict[str, Any]]] = [
        (two, {}),  # two pictures in one call
        (two[0], {"do_pad": False}),
        (two[0], {"do_image_splitting": False}),
        (two[0], {"do_normalize": False}),
        (np.asarray(two[0]).astype(np.float32) / 255, {"do_rescale": False}),  # not 8-bit
    ]
    for images, options in asks:
        mine = preparer.processor(images=images, return_row_col_info=True, **options)
        if options.get("do_pad") is False:  # no mask at all, as transformers' own code answers
            assert "pixel_attention_mask" not in mine
        else:
            assert mine["pixel_attention_mask"].stride() != (0, 0, 0, 0)
        _same_bits(mine, plain(images=images, return_row_col_info=True, **options))


def test_the_processor_is_handed_a_picture_as_it_lies_in_memory(preparer: ImagePreparer, tiny_vlm: Path) -> None:
    picture = Image.fromarray(np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3))
    handed = preparer.processor.process_image(picture, do_convert_rgb=True)
    assert tuple(handed.shape) == (3, 5, 7)
    assert handed.permute(1, 2, 0).is_contiguous()  # pixels, not planes: the resize copies nothing
    np.testing.assert_array_equal(handed.permute(1, 2, 0).numpy(), np.asarray(picture))
    copied = _plain(tiny_vlm).process_image(picture, do_convert_rgb=True)
    assert copied.is_contiguous()  # transformers' own: planes
    assert not copied.permute(1, 2, 0).is_contiguous()


def test_a_picture_the_processor_rejects_is_a_structured_error(qwen2_vl: ImagePreparer) -> None:
    # Qwen2-VL refuses an aspect ratio over 200: a 1×500 sliver is the picture's fault, not the model's.
    sliver = encode(Image.new("RGB", (1, 500), "white"), "PNG")
    with pytest.raises(ImageCorrupt, match="aspect ratio") as caught:
        qwen2_vl.prepare(decode_rgb(sliver, PARAMS))
    assert (caught.value.code, caught.value.stage) == ("image_corrupt", "decode")
    assert caught.value.message.startswith("the model's image processor (Qwen2VLImageProcessor) cannot read this")
    assert "1×500 picture" in caught.value.message


class RefusingProcessor:
    """An image processor that refuses every picture the way a library's can: naming an object by its heap address,
    then quoting a long array."""

    def __call__(self, images: Image.Image) -> dict[str, Any]:
        raise ValueError(f"cannot use <numpy.ndarray object at 0x7f3a9c1b2d40>: values {list(range(2000))}")


def test_a_processors_refusal_reaches_the_client_without_addresses_or_arrays() -> None:
    preparer = ImagePreparer(RefusingProcessor(), identity="refusing")
    with pytest.raises(ImageCorrupt) as caught:
        preparer.prepare(Image.new("RGB", (30, 20), "white"))
    message = caught.value.message
    assert message.startswith("the model's image processor (RefusingProcessor) cannot read this 30×20 picture: ")
    assert "0x7f3a" not in message
    assert "cannot use : values [0, 1, 2" in message
    assert len(message) < 300
    assert message.endswith("…")
    assert "1999" in str(caught.value.__cause__)  # the whole reason stays on the cause, for the worker's log


@pytest.mark.parametrize(
    ("vlm", "mode", "backend", "ocr", "picture"),
    [
        (True, "auto", "transformers", False, None),  # a model that sees looks for itself
        (True, "on", "transformers", True, None),
        (False, "auto", "transformers", True, None),  # a text-only model reads pictures as their OCR text
        (False, "off", "transformers", False, None),
        (True, "auto", "openai", False, (LONGEST_EDGE, 0)),  # the served model's own size
        (False, "auto", "openai", True, (4096, 0)),  # no processor to ask: the bound alone
    ],
)
def test_what_decode_makes_follows_the_model_and_the_ocr_mode(
    tiny_vlm: Path, vlm: bool, mode: str, backend: str, ocr: bool, picture: tuple[int, int] | None
) -> None:
    from stoker.runtime.context import WorkerContext
    from stoker.settings import WorkerSettings

    model = str(tiny_vlm) if vlm else BUILTIN_MODEL
    ctx = WorkerContext(WorkerSettings(model=model, ocr=mode, backend=backend), outbox=NoOutbox())
    try:
        ctx.model_path  # noqa: B018 (the built-in model must be fetched)
    except ModelUnavailable as exc:
        missing(str(exc))
    assert (ctx.image_preparer is not None, ctx.ocr_runs, ctx.picture_bounds) == (vlm, ocr, picture)
    assert ctx.decode_needs.picture == (vlm or picture is not None)
    assert ctx.decode_outputs.processor == (ctx.image_preparer.identity if ctx.image_preparer else "")
