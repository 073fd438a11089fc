"""OCR with tesseract: grayscale pixels in, text out."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import numpy.typing as npt
import pytesseract
from PIL import Image

from stoker.errors import OcrFailed, OcrTimeout

#: Bump when OCR's output changes for the same image and parameters.
VERSION = "1"

_BLANK_LINES = re.compile(r"\n\s*\n+")


def read_text(gray: npt.NDArray[np.uint8], langs: str, timeout_s: float) -> str:
    """Run tesseract on a grayscale image and return its text with blank lines collapsed."""
    image = Image.fromarray(gray)
    try:
        raw = pytesseract.image_to_string(image, lang=langs, timeout=timeout_s)
    except (
        pytesseract.TesseractError,
        pytesseract.TesseractNotFoundError,
        subprocess.SubprocessError,
    ) as exc:
        raise OcrFailed(f"tesseract failed: {exc}", stage="ocr") from exc
    except RuntimeError as exc:  # pytesseract signals its timeout with a bare RuntimeError
        raise OcrTimeout(f"tesseract exceeded {timeout_s:g}s", stage="ocr") from exc
    return normalise_text(raw)


def normalise_text(raw: str) -> str:
    """Strip form feeds and trailing space, collapse runs of blank lines."""
    text = raw.replace("\x0c", "").strip()
    return _BLANK_LINES.sub("\n", text)


def tesseract_version() -> str:
    """The installed tesseract's version, part of the OCR stage's identity."""
    return str(pytesseract.get_tesseract_version())
