"""Model-ready image tensors, made by the model's own image processor on a CPU worker.

A vision-language model reads an image as tensors its processor made: SmolVLM / Idefics3 tiles the picture into
512-px crops plus a downscaled whole (`pixel_values`, `pixel_attention_mask`, and `rows` × `cols`, which the prompt
needs to spell out one `<row_i_col_j>` and 64 `<image>` tokens per tile); Qwen2-VL cuts it into patches
(`pixel_values`, `image_grid_thw`). Whatever the processor returns is kept, under its own names and shapes, so the
inference side hands the tensors to the model as the processor would have. Only the image processor's config is
read (`AutoImageProcessor.from_pretrained`): a CPU worker needs no weights.

How the decode stage uses it (`stoker.runtime.stages.decode`, through `WorkerContext.image_preparer`)::

    preparer = ImagePreparer.load(model_dir)          # once per worker process; None for a text-only model
    ...
    rgb = decode_rgb(data, params)                # stoker.core.imaging: EXIF-rotated RGB on white, full size
    prepared = preparer.prepare(rgb)                  # ImageCorrupt (stage "decode") if the processor rejects it
    cache.put_bytes(vision_address, prepared.to_bytes(), part=VISION_TENSORS)  # the address has preparer.identity

and the inference side reads them back (`WorkerContext.pictures.prepared_image(digest, scope)`:
`PreparedImage.from_bytes`), checks `meta["processor"]` against its own processor's identity, and turns `tensors`
into torch tensors (`torch.from_numpy`, cast to the model's dtype).

The bytes are safetensors (arrays and a JSON header, never pickle): floating tensors as float16 (pixel values are
normalised to about [-1, 1]: float16 keeps 3 significant digits, half the bytes of float32), masks as bool.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import numpy.typing as npt
from PIL import Image
from safetensors import SafetensorError
from safetensors.numpy import load, save

from stoker.core.errors import ImageCorrupt
from stoker.core.imaging import error_text

#: The layout of the bytes `PreparedImage.to_bytes` writes; bump when it changes.
FORMAT = "stoker.vision/1"
_META_KEY = "stoker"

#: Keys of a processor's config that name where it was loaded from, not what it does.
_PATH_KEYS = ("name_or_path", "_path", "_dir", "_file", "_commit_hash")

Tensors = dict[str, npt.NDArray[Any]]

#: The image processors' backend (transformers 5): torchvision's resize is the one vLLM's renderer runs (its
#: default wherever torchvision >= 0.27 is installed), so stoker's pixel values equal vLLM's bit for bit.
BACKEND = "torchvision"

#: The files `AutoProcessor` and `AutoImageProcessor` read a processor from.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def declares_processor(model_path: str) -> bool:
    """Whether the model may have a processor (image, audio): a hub id, or a local directory with its config.
    A local text model answers False without importing transformers' processor modules (and with them torch)."""
    model_dir = Path(model_path)
    if not model_dir.is_dir():
        return True
    return any((model_dir / name).is_file() for name in _PROCESSOR_FILES)


def processor_identity(processor: Any) -> str:
    """A stable hash of what the processor does: its class, transformers' version and its config (`to_dict()`,
    sorted keys), without anything that says where it was loaded from. Equal identities make equal tensors."""
    import transformers  # the processor's code: a new release may resize differently

    config = {key: value for key, value in processor.to_dict().items() if not _path_like(key)}
    described = {"class": type(processor).__name__, "transformers": transformers.__version__, "config": config}
    text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
    return blake3.blake3(text.encode()).hexdigest()[:32]


def _path_like(key: str) -> bool:
    return key.startswith("_") or key.endswith(_PATH_KEYS)


@dataclass(frozen=True)
class PreparedImage:
    """One image as the model's processor prepared it: its tensors, and what made them."""

    tensors: Tensors
    meta: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """safetensors bytes: the tensors, and `meta` as JSON in the header."""
        header = {_META_KEY: json.dumps({"format": FORMAT, **self.meta}, sort_keys=True)}
        return save({name: np.ascontiguousarray(array) for name, array in self.tensors.items()}, metadata=header)

    @classmethod
    def from_bytes(cls, data: bytes) -> PreparedImage:
        """The inverse of `to_bytes`: the same tensors (dtype, shape and values) and metadata."""
        try:
            tensors = load(data)
            meta = json.loads(_header(data)[_META_KEY])
        except (SafetensorError, KeyError, ValueError) as exc:
            raise ValueError(f"not prepared image tensors: {exc}") from exc
        if meta.pop("format", None) != FORMAT:
            raise ValueError(f"prepared image tensors are not {FORMAT}")
        return cls(tensors=tensors, meta=meta)


def _header(data: bytes) -> dict[str, str]:
    """The safetensors header's metadata: an 8-byte little-endian length, then that much JSON."""
    size = int.from_bytes(data[:8], "little")
    metadata: dict[str, str] = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    return metadata


@dataclass(frozen=True)
class ImagePreparer:
    """A model's image processor, ready to turn decoded pictures into that model's tensors."""

    processor: Any
    identity: str
    #: The dtype floating tensors are kept in: float16 (half the bytes; the local model and the embeddings read
    #: them), or float32, the processor's own values, which a render casts to the served model's dtype exactly as
    #: vLLM does (`stoker.adapters.render`). Part of `identity`, so the two never share a cache entry.
    floats: str = "float16"
    #: Idefics3's pixel values as the tiles' 8-bit pixels before rescaling and normalising, with each channel's
    #: table of what those make of its 256 values (`pixel_values_table`, in `floats`): a render looks them up where
    #: it writes its answer (`stoker.adapters.backends.tiling`). Part of `identity`.
    eight_bit: bool = False

    @classmethod
    def load(cls, model_dir: str | Path, floats: str = "float16", eight_bit: bool = False) -> ImagePreparer | None:
        """The image processor a model directory (or hub id) declares; None when the model reads no images."""
        if not declares_processor(str(model_dir)):
            return None
        from transformers import AutoImageProcessor  # heavy (torch): only in the processes that prepare images

        try:
            # The torchvision backend, pinned: vLLM's renderer runs it (the same pixels, bit for bit), at less CPU
            # than the PIL one; without torchvision, transformers falls back to the PIL backend (a warning).
            processor = AutoImageProcessor.from_pretrained(str(model_dir), backend=BACKEND)
        except OSError:  # no preprocessor_config.json: a text-only model
            return None
        identity = processor_identity(processor)
        _hand_over_channels_last(processor, eight_bit)
        identity += "" if floats == "float16" else f".{floats}"
        return cls(processor, identity + (".8bit" if eight_bit else ""), floats, eight_bit)

    def prepare(self, rgb: Image.Image) -> PreparedImage:
        """The model's tensors for one decoded picture (RGB, already EXIF-rotated, as decode makes it)."""
        if rgb.mode != "RGB":
            raise ValueError(f"prepare takes a decoded RGB picture, not {rgb.mode}")
        try:
            output = self.processor(images=rgb, **self._extra())
        except ValueError as exc:
            raise ImageCorrupt(_refusal(self.processor, rgb, exc), stage="decode") from exc
        tensors = {name: _stored(name, value, self.floats, self.eight_bit) for name, value in output.items()}
        meta = {"processor": self.identity, "processor_class": type(self.processor).__name__, "size": list(rgb.size)}
        return PreparedImage(tensors=tensors, meta=meta)

    def layout(self, prepared: PreparedImage) -> dict[str, Any]:
        """What the prompt needs of a prepared picture to spell out its placeholder tokens: its integer tensors
        (tile `rows` and `cols`, a patch grid `image_grid_thw`), as the processor returned them (nested lists)."""
        return {
            name: value.tolist()
            for name, value in prepared.tensors.items()
            if value.dtype == np.int64 and not name.endswith("_mask")
        }

    def size_policy(self) -> tuple[int | None, int | None]:
        """The largest picture the processor keeps before it resizes (longest side, pixels; None where it sets no
        bound): Idefics3 / SmolVLM resize the longest edge to `size["longest_edge"]`; Qwen2-VL to at most
        `max_pixels` (its `size["longest_edge"]` counts pixels)."""
        processor = self.processor
        size = getattr(processor, "size", None) or {}
        pixels = getattr(processor, "max_pixels", None)
        if pixels or getattr(processor, "merge_size", None):  # Qwen2-VL and kin: a pixel budget
            return None, int(pixels or size.get("longest_edge") or 0) or None
        side = size.get("longest_edge") if hasattr(size, "get") else None
        return (int(side) if side else None), None

    def _extra(self) -> dict[str, Any]:
        # Idefics3 / SmolVLM tell how the picture was tiled only when asked; the prompt needs it.
        accepted = getattr(getattr(self.processor, "valid_kwargs", None), "__annotations__", {})
        return {"return_row_col_info": True} if "return_row_col_info" in accepted else {}


def _hand_over_channels_last(processor: Any, eight_bit: bool = False) -> None:
    """Hand a torchvision-backed processor each decoded RGB picture as it lies in memory, pixel by pixel
    (channels last, a view of its array), not copied into planes first.

    Written here because no setting of transformers does it: its torchvision backend copies every picture into a
    channels-first tensor, and torch's antialiased resize of 8-bit pictures is about three times faster on
    channels-last ones (a 1280×960 picture to 1024×768 with Lanczos: 10.9 against 3.1 ms on one thread), with the
    same bits (`tests/unit/test_vision.py` compares both ways on pictures of random sizes, Idefics3's Lanczos and
    Qwen2-VL's bicubic; the render conformance tests compare with vLLM's). Idefics3 on a 1280×960 photo: 27 to 30
    ms a picture down to 18 to 20."""
    if getattr(processor, "backend", None) == BACKEND:
        kind: Any = type(processor)
        processor.__class__ = _channels_last(kind, eight_bit)


@functools.cache
def _channels_last(base: Any, eight_bit: bool = False) -> Any:
    """`base` whose `process_image` hands an RGB picture over as a view of its pixels (and, for Idefics3, whose
    `_preprocess` writes one picture's tiles in place: `stoker.adapters.backends.tiling`); under `base`'s own name,
    so what the processor says of itself (its config, its identity) is unchanged."""
    import torch  # heavy: loaded with the processor

    def process_image(self: Any, image: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(image, Image.Image) and image.mode == "RGB" and kwargs.get("device") is None:
            return torch.from_numpy(np.array(image)).permute(2, 0, 1)
        return base.process_image(self, image, *args, **kwargs)

    methods: dict[str, Any] = {"process_image": process_image, "__module__": base.__module__}
    if any(kind.__name__ == "Idefics3ImageProcessor" for kind in base.__mro__):
        from stoker.adapters.backends.tiling import preprocess_tiles

        methods["_preprocess"] = preprocess_tiles(base, eight_bit)  # its tiles written in place: fewer copies
    return type(base.__name__, (base,), methods)


#: The most of an image processor's own reason a client is shown: a processor's message may quote whole arrays.
MAX_REASON_CHARS = 200


def _refusal(processor: Any, rgb: Image.Image, exc: ValueError) -> str:
    """Why the model's image processor refused a picture, as a client may read it: the processor and the picture's
    size, then the processor's reason without any object it names by heap address, cut short (the whole of it stays
    on the exception's cause, for the worker's log)."""
    reason = error_text(exc)
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 1].rstrip() + "…"
    width, height = rgb.size
    name = type(processor).__name__
    return f"the model's image processor ({name}) cannot read this {width}×{height} picture: {reason}"


def _stored(name: str, value: Any, floats: str = "float16", eight_bit: bool = False) -> npt.NDArray[Any]:
    """The dtype a tensor travels in: `floats` for values, bool for masks, int64 for counts and grids; 8-bit pixels
    as they are (`eight_bit`)."""
    array = np.asarray(value)
    if name.endswith("_mask") and array.size and not any(array.strides):
        # one value seen everywhere (a mask of whole tiles: `tiling`'s view of a single one): filled, not cast
        # element by element from int64 (1.0 ms a 1280×960 picture, 0.06 filled)
        return np.full(array.shape, bool(array.flat[0]))
    if name.endswith("_mask"):
        return array.astype(np.bool_)
    if eight_bit and array.dtype == np.uint8:
        return array
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(floats, copy=False)  # the processor's own float32 kept as it is: no copy of megabytes
    return array.astype(np.int64, copy=False)
