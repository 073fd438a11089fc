"""Image decode: bytes in; structured features, the grayscale image OCR reads and the full picture a model's image
processor (or a server that sees) works from, out."""

from __future__ import annotations

import io
import re
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
VERSION = "3"  # 3: a JPEG read for OCR alone decodes its luma


@dataclass(frozen=True)
class DecodeParams:
    """Everything that changes what decode produces."""

    max_pixels: int = 90_000_000
    ocr_max_side: int = 2048


@dataclass(frozen=True)
class DecodeNeeds:
    """What decode must make for the configured model: the OCR image (when OCR runs), the full picture (for a
    model's image processor or a server that sees images)."""

    ocr: bool = True
    picture: bool = False


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
    """What the decode stage hands on: only what was asked for (`DecodeNeeds`)."""

    features: ImageFeatures
    ocr_image: npt.NDArray[np.uint8] | None  # H×W grayscale, longest side ≤ ocr_max_side
    picture: Image.Image | None  # EXIF-rotated RGB on white, at full resolution


#: What Pillow raises on bytes it cannot decode once the header was read: OSError (a truncated or broken stream),
#: ValueError, SyntaxError (chunks out of order, e.g. an APNG's frame controls: "APNG contains frame sequence
#: errors") and EOFError (data that ends early). Each is the image's fault: `image_corrupt`.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError)


#: The message for bytes that no allowed format's decoder recognises.
UNIDENTIFIED = f"cannot identify image: not a picture in any format read here ({', '.join(IMAGE_FORMATS)})"
#: How Python writes an object that has no text of its own: `<_io.BytesIO object at 0x7fa…>`.
_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def error_text(exc: BaseException) -> str:
    """A decoder's error as a client may read it: its message without any object it names by heap address."""
    return " ".join(_OBJECT_REPR.sub("", str(exc)).split()) or type(exc).__name__


def decode_image(data: bytes, params: DecodeParams, needs: DecodeNeeds | None = None) -> DecodedImage:
    """Decode image bytes safely (allowlisted formats, a pixel cap, EXIF orientation) into what `needs` asks for.

    Without the full picture, the codec shrinks while decoding (a JPEG's draft scale and luma) to what OCR reads:
    fast. With it, the image is decoded at full resolution (within the pixel cap) and the OCR image shrunk from
    that: a model's processor resizes the original itself, and any shrinking before it (draft, reduce, a resample
    of our own) would change the tensors it makes. Its cost is memory: a picture at the 90 MP cap is 270 MB of RGB
    (plus the decoder's frame while converting), well inside a CPU pool child's address-space cap
    (`cpu_address_space_mb`)."""
    needs = needs or DecodeNeeds()
    image = _open(data, params.max_pixels)
    try:
        # Reading the features may decode already: Pillow reaches a PNG's EXIF by loading the frame before it.
        features = _features(image)
        if needs.picture:
            picture = _load_full(image)
            small = _shrunk(picture, params.ocr_max_side).convert("L") if needs.ocr else None
        else:
            picture, small = None, _load_gray(image, params.ocr_max_side)  # decoded even unread: is it whole?
    except DECODE_ERRORS as exc:
        raise ImageCorrupt(f"cannot decode image: {error_text(exc)}", stage="decode") from exc
    gray = np.asarray(small, dtype=np.uint8) if small is not None and needs.ocr else None
    return DecodedImage(features=features, ocr_image=gray, picture=picture)


def decode_rgb(data: bytes, params: DecodeParams) -> Image.Image:
    """The full picture alone (the same checks and errors as `decode_image`): EXIF-rotated RGB on white, at full
    resolution. A model's image processor takes it from here."""
    picture = decode_image(data, params, DecodeNeeds(ocr=False, picture=True)).picture
    assert picture is not None
    return picture


def _open(data: bytes, max_pixels: int) -> Image.Image:
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            # Pillow only warns between 1× and 2× the cap; a bomb is an error at any size over it.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image exceeds {max_pixels} pixels", stage="decode") from exc
    except UnidentifiedImageError as exc:  # Pillow's own message names the in-memory file object, heap address and all
        raise ImageCorrupt(UNIDENTIFIED, stage="decode") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageCorrupt(f"cannot identify image: {error_text(exc)}", stage="decode") from exc
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


def _load_gray(image: Image.Image, max_side: int) -> Image.Image:
    """The OCR image alone: grayscale at no more than max_side, letting the codec do the shrinking and the colour
    work where it can (what it raises on bytes it cannot decode, `DECODE_ERRORS`, the caller classifies)."""
    if image.format == "JPEG":
        # JPEG decodes at 1/2, 1/4 or 1/8 scale for free (draft picks the smallest scale ≥ the request), and a
        # colour JPEG decodes to its luma channel alone: no colour conversion, and a third of the pixels to resample.
        # A 4000×3000 page: 0.32 CPU s through RGB, 0.095 as luma, within 2 grey levels of RGB's conversion to L
        # (docs/bench/log/2026-12-04-largest-page-whole-vs-bands.md).
        image.draft("L", (max_side, max_side))
    image.load()
    image = ImageOps.exif_transpose(image)
    factor = max(image.size) // max_side
    if factor >= 2:
        image = image.reduce(factor)  # before converting: the composite on white then works on fewer pixels
    gray = image if image.mode == "L" else _to_rgb(image).convert("L")
    return _shrunk(gray, max_side)


def _load_full(image: Image.Image) -> Image.Image:
    """Load every pixel: EXIF-rotated RGB on white (rotated in place, and an RGB picture kept as it is: each copy of a
    1280×960 picture costs ~2 ms, 40 % of its decode)."""
    image.load()
    ImageOps.exif_transpose(image, in_place=True)
    return _to_rgb(image)


def _shrunk(image: Image.Image, max_side: int) -> Image.Image:
    """At most max_side on the longest side: a box reduce by whole factors first (fast), then Lanczos."""
    factor = max(image.size) // max_side
    if factor >= 2:
        image = image.reduce(factor)
    if max(image.size) > max_side:
        image = image.copy()
        image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB on white: transparent regions become paper, which OCR reads best."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def within(size: tuple[int, int], max_side: int, max_pixels: int | None = None) -> tuple[int, int]:
    """The largest size of the same aspect ratio no bigger than size, max_side on its longest side and max_pixels in
    all (never enlarged; each side at least 1)."""
    width, height = size
    scale = min(1.0, max_side / max(width, height))
    if max_pixels:
        scale = min(scale, (max_pixels / (width * height)) ** 0.5)
    if scale >= 1.0:
        return size
    return max(1, round(width * scale)), max(1, round(height * scale))


#: The JPEG qualities a picture for a server is tried at, best first, when its PNG is over the bytes it may have: a
#: camera's noise makes PNG (and lossless WebP) large. A 4096×3072 photo: PNG 26.6 MB in 1.3 s, lossless WebP no
#: smaller, JPEG at quality 95 5.2 MB in 0.05 s.
SERVED_JPEG_QUALITIES = (95, 90, 80)


def served_picture(
    picture: Image.Image, max_side: int, max_pixels: int | None = None, max_bytes: int | None = None
) -> bytes:
    """The picture for a server that sees images: shrunk (Lanczos) to fit max_side and max_pixels, never enlarged,
    as a lossless PNG; when that is over `max_bytes` (what the stage cache keeps, so that the inference worker only
    reads it), as the best JPEG that fits, at a smaller size only where no quality does."""
    target = within(picture.size, max_side, max_pixels)
    if target != picture.size:
        picture = picture.resize(target, Image.Resampling.LANCZOS)
    png = _encoded(picture, "PNG", compress_level=1)  # lossless; level 1: a fraction of the time, a little larger
    if max_bytes is None or len(png) <= max_bytes:
        return png
    return _jpeg_within(picture, max_bytes)


def _jpeg_within(picture: Image.Image, max_bytes: int) -> bytes:
    """The picture as a JPEG of at most max_bytes: the best quality that fits; shrunk in proportion where none does."""
    while True:
        for quality in SERVED_JPEG_QUALITIES:
            data = _encoded(picture, "JPEG", quality=quality)
            if len(data) <= max_bytes:
                return data
        if max(picture.size) == 1:
            return data  # nothing smaller to send
        side = max(1, int(max(picture.size) * 0.9 * (max_bytes / len(data)) ** 0.5))
        picture = picture.resize(within(picture.size, side), Image.Resampling.LANCZOS)


def _encoded(picture: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    picture.save(out, fmt, **options)
    return out.getvalue()
