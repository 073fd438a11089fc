"""Image decode: bytes in, a model-ready array, an OCR-ready grayscale image and structured features out."""

from __future__ import annotations

import io
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, UnidentifiedImageError
from pillow_heif import register_heif_opener

from stoker.core.errors import ImageCorrupt, ImageTooLarge
from stoker.core.media import IMAGE_FORMATS

# HEIF/HEIC pictures (phones) open like any other format, under the same pixel cap (Pillow checks it on open);
# no thumbnails: only the primary picture is decoded.
register_heif_opener(thumbnails=False)

#: Bump when decode's output changes for the same input and parameters: cached results then miss.
VERSION = "1"

# CLIP's normalisation: what most vision encoders expect.
_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


@dataclass(frozen=True)
class DecodeParams:
    """Everything that changes what decode produces."""

    max_pixels: int = 90_000_000
    image_size: int = 224
    ocr_max_side: int = 2048


@dataclass(frozen=True)
class ImageFeatures:
    """Structured facts about an image, small enough to travel in a message or a prompt."""

    format: str
    width: int
    height: int
    mode: str
    animated: bool
    megapixels: float

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form for JSON."""
        return asdict(self)


@dataclass(frozen=True)
class DecodedImage:
    """What the decode stage hands on."""

    features: ImageFeatures
    ocr_image: npt.NDArray[np.uint8]  # H×W grayscale, longest side ≤ ocr_max_side
    model_input: npt.NDArray[np.float16]  # 3×S×S, normalised


#: What Pillow raises on bytes it cannot decode once the header was read: OSError (a truncated or broken stream),
#: ValueError, SyntaxError (chunks out of order, e.g. an APNG's frame controls: "APNG contains frame sequence
#: errors") and EOFError (data that ends early). Each is the image's fault: `image_corrupt`.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError)


def decode_image(data: bytes, params: DecodeParams) -> DecodedImage:
    """Decode image bytes safely: allowlisted formats, a pixel cap, fast downscale, EXIF orientation."""
    image = _open(data, params.max_pixels)
    try:
        # Reading the features may decode already: Pillow reaches a PNG's EXIF by loading the frame before it.
        features = _features(image)
        rgb = _load_downscaled(image, params.ocr_max_side)
    except DECODE_ERRORS as exc:
        raise ImageCorrupt(f"cannot decode image: {exc}", stage="decode") from exc
    return DecodedImage(
        features=features,
        ocr_image=np.asarray(rgb.convert("L"), dtype=np.uint8),
        model_input=model_ready(rgb, params.image_size),
    )


def decode_rgb(data: bytes, params: DecodeParams) -> Image.Image:
    """The picture decode works from: EXIF-rotated RGB on white, longest side ≤ ocr_max_side (the same checks and
    errors as `decode_image`). A model's image processor takes it from here."""
    image = _open(data, params.max_pixels)
    try:
        return _load_downscaled(image, params.ocr_max_side)
    except DECODE_ERRORS as exc:
        raise ImageCorrupt(f"cannot decode image: {exc}", stage="decode") from exc


def _open(data: bytes, max_pixels: int) -> Image.Image:
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            # Pillow only warns between 1× and 2× the cap; a bomb is an error at any size over it.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image exceeds {max_pixels} pixels", stage="decode") from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageCorrupt(f"cannot identify image: {exc}", stage="decode") from exc
    if image.width * image.height > max_pixels:
        raise ImageTooLarge(f"{image.width}×{image.height} exceeds {max_pixels} pixels", stage="decode")
    if image.width < 1 or image.height < 1:
        raise ImageCorrupt("image has no pixels", stage="decode")
    return image


def _features(image: Image.Image) -> ImageFeatures:
    width, height = image.size
    if _exif_orientation(image) in (5, 6, 7, 8):
        width, height = height, width
    return ImageFeatures(
        format=str(image.format),
        width=width,
        height=height,
        mode=image.mode,
        animated=bool(getattr(image, "is_animated", False)),
        megapixels=round(width * height / 1e6, 3),
    )


def _exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation (1 when unreadable); a frame that cannot be decoded on the way is left to the caller."""
    try:
        return int(image.getexif().get(0x0112, 1))
    except (OSError, ValueError, TypeError):
        return 1


def _load_downscaled(image: Image.Image, max_side: int) -> Image.Image:
    """Load pixel data at no more than max_side, letting the codec do the shrinking where it can (what it raises on
    bytes it cannot decode, `DECODE_ERRORS`, the caller classifies)."""
    if image.format == "JPEG":
        # JPEG decodes at 1/2, 1/4 or 1/8 scale for free; draft picks the smallest scale ≥ the request.
        image.draft("RGB", (max_side, max_side))
    image.load()
    image = ImageOps.exif_transpose(image)
    factor = max(image.size) // max_side
    if factor >= 2:
        image = image.reduce(factor)
    image = _to_rgb(image)
    if max(image.size) > max_side:
        image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB on white: transparent regions become paper, which OCR reads best."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


def model_ready(rgb: Image.Image, size: int) -> npt.NDArray[np.float16]:
    """Letterbox to size×size (nothing cropped away), normalise, channels first."""
    boxed = ImageOps.pad(rgb, (size, size), method=Image.Resampling.BICUBIC, color=(0, 0, 0))
    pixels = np.asarray(boxed, dtype=np.float32) / 255.0
    normalised = (pixels - _MEAN) / _STD
    return np.ascontiguousarray(normalised.transpose(2, 0, 1), dtype=np.float16)


def model_input_jpeg(model_input: npt.NDArray[np.float16], quality: int = 90) -> bytes:
    """The model-ready array back as a JPEG picture (un-normalised, channels last): for servers that take images."""
    pixels = model_input.astype(np.float32).transpose(1, 2, 0) * _STD + _MEAN
    rgb = Image.fromarray(np.clip(pixels * 255.0 + 0.5, 0, 255).astype(np.uint8), "RGB")
    out = io.BytesIO()
    rgb.save(out, "JPEG", quality=quality)
    return out.getvalue()
