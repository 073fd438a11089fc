"""OCR's pure part: tesseract's text tidied (`normalise_text`), and a dense page cut into bands at blank rows and
its bands' texts joined again. Running tesseract itself is a process, so it lives with the adapters
(`stoker.adapters.tesseract`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: Bump when OCR's output changes for the same image and parameters.
VERSION = "1"

_BLANK_LINES = re.compile(r"\n\s*\n+")


def normalise_text(raw: str) -> str:
    """Strip form feeds and trailing space, collapse runs of blank lines."""
    text = raw.replace("\x0c", "").strip()
    return _BLANK_LINES.sub("\n", text)


# -- chunked OCR --------------------------------------------------------------------------------------------------
#: A pixel darker than this is ink (grayscale 0-255): what the projection profile counts per row.
_INK = 128


@dataclass(frozen=True)
class Band:
    """Rows [top, bottom) of a page, OCR'd on their own; `overlapped`: the cut above it found no blank row, so the
    band repeats a few rows of the one before (and its first line may repeat that band's last)."""

    top: int
    bottom: int
    overlapped: bool = False


def band_limit(configured: int, cores: int, children: int) -> int:
    """How many bands a page is cut into at most: as configured, else as many as the pool's children can read at
    once on the host's cores, and at least two (a small page's OCR can then go between them).

    A band costs a tesseract start (about 0.1 s here) and reads less context per call, so bands beyond what runs at
    once cost CPU and gain nothing: measured on 2 cores, a 2048×1536 page took 1.13 CPU s whole, 1.10 in two bands
    and 1.32 in three, and three bands on two cores finish in two rounds
    (docs/bench/log/2026-12-04-largest-page-whole-vs-bands.md).
    """
    return configured or max(2, min(cores, children))


def plan_bands(
    gray: npt.NDArray[np.uint8], band_rows: int, search_rows: int, overlap_rows: int, most: int = 0
) -> list[Band]:
    """Cut a page into horizontal bands of about band_rows (taller when `most`, if given, caps their count) at
    blank rows, so that no text line is cut.

    The cuts are spread evenly; each moves to the middle of the blank run nearest it within search_rows (a
    projection profile: rows with no ink). Where there is none, the cut stays and the bands overlap by
    overlap_rows on each side, so a line through the cut is whole in both (`join_bands` drops the repeat).
    A page no taller than 1.5 bands is one band.
    """
    height = int(gray.shape[0])
    count = round(height / band_rows)
    if most:
        count = min(count, most)
    if count < 2:
        return [Band(0, height)]
    blank = _blank_rows(gray)
    cuts = [_cut_near(blank, height * k // count, search_rows) for k in range(1, count)]
    edges = [(0, False), *cuts, (height, False)]
    return [
        Band(
            top=max(edges[i][0] - (overlap_rows if edges[i][1] else 0), 0),
            bottom=min(edges[i + 1][0] + (overlap_rows if edges[i + 1][1] else 0), height),
            overlapped=edges[i][1],
        )
        for i in range(count)
    ]


def lines_of_text(bands: list[Band]) -> bool:
    """Whether the page was cut at blank rows only: lines of text, what tesseract spends its time on. A photo has
    no blank row to cut at (its bands overlap), and costs a fraction of a page of text the same size."""
    return len(bands) > 1 and not any(band.overlapped for band in bands)


def _blank_rows(gray: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
    """Rows with no ink (a speck of a pixel or two forgiven)."""
    ink = (gray < _INK).sum(axis=1)
    return np.asarray(ink <= max(1, gray.shape[1] // 1000))


def _cut_near(blank: npt.NDArray[np.bool_], at: int, search_rows: int) -> tuple[int, bool]:
    """The middle of the blank run nearest `at` within search_rows, and False; or `at` itself and True (overlap)."""
    low, high = max(at - search_rows, 1), min(at + search_rows, len(blank) - 1)
    best: tuple[int, int] | None = None  # (distance, row)
    row = low
    while row < high:
        if not blank[row]:
            row += 1
            continue
        start = row
        while row < high and blank[row]:
            row += 1
        middle = (start + row) // 2
        if best is None or abs(middle - at) < best[0]:
            best = (abs(middle - at), middle)
    return (best[1], False) if best is not None else (at, True)


def join_bands(texts: list[str], bands: list[Band]) -> str:
    """The page's text from its bands' texts, in order; where two bands overlapped, a line both read is kept once."""
    lines: list[str] = []
    for text, band in zip(texts, bands, strict=True):
        own = [line for line in text.splitlines() if line.strip()]
        if band.overlapped and lines and own and _same_line(lines[-1], own[0]):
            own = own[1:]
        lines += own
    return normalise_text("\n".join(lines))


def _same_line(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())
