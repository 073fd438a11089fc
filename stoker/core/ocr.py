"""OCR with tesseract: grayscale pixels in, text out.

tesseract runs in a process group of its own and is killed on every way out of read_text, a Celery soft time
limit included (the exception lands mid-wait): no OCR process outlives its task.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import numpy as np
import numpy.typing as npt

from stoker.core.errors import Cancelled, OcrFailed, OcrTimeout

#: Bump when OCR's output changes for the same image and parameters.
VERSION = "1"

_BLANK_LINES = re.compile(r"\n\s*\n+")


#: How often a running tesseract is asked whether its job still wants it.
CANCEL_CHECK_S = 0.25


def read_text(
    gray: npt.NDArray[np.uint8],
    langs: str,
    timeout_s: float,
    binary: str = "tesseract",
    cancelled: Callable[[], bool] | None = None,
) -> str:
    """Run tesseract on a grayscale image and return its text with blank lines collapsed.

    `cancelled`, asked every CANCEL_CHECK_S while tesseract runs, stops it (and everything it started) as soon as
    it answers True: a cancelled job leaves no tesseract behind.
    """
    height, width = gray.shape[:2]
    pgm = b"P5\n%d %d\n255\n" % (width, height) + np.ascontiguousarray(gray, dtype=np.uint8).tobytes()
    cmd = [binary, "stdin", "stdout", "-l", langs, "--psm", "3"]
    # One OpenMP thread per tesseract (about 6x faster per page on a small machine, where pool children already
    # share the cores): for tesseract alone, never the worker's own environment (see `workers.launch.worker_env`).
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
    except OSError as exc:
        raise OcrFailed(f"cannot run {binary}: {exc}", stage="ocr") from exc
    try:
        out, err = _communicate(proc, pgm, timeout_s, cancelled)
    except subprocess.TimeoutExpired as exc:
        raise OcrTimeout(f"tesseract exceeded {timeout_s:g}s", stage="ocr") from exc
    finally:
        _kill_group(proc)
    if proc.returncode != 0:
        detail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise OcrFailed(f"tesseract failed: {detail[0]}", stage="ocr")
    return normalise_text(out.decode("utf-8", "replace"))


def _communicate(
    proc: subprocess.Popen[bytes], data: bytes, timeout_s: float, cancelled: Callable[[], bool] | None
) -> tuple[bytes, bytes]:
    """Feed tesseract and collect its output within timeout_s, in slices so `cancelled` is asked between them.

    communicate() cannot go on sending input after a slice timed out (it registers stdin only when handed input,
    and refuses input once started), so with slices a thread of our own feeds stdin and communicate only reads.
    """
    if cancelled is None:
        return proc.communicate(data, timeout=timeout_s)
    stdin, proc.stdin = proc.stdin, None
    feeder = threading.Thread(target=_feed, args=(stdin, data), name="tesseract-stdin", daemon=True)
    feeder.start()
    until = time.monotonic() + timeout_s
    while True:
        left = until - time.monotonic()
        try:
            return proc.communicate(timeout=max(min(CANCEL_CHECK_S, left), 0.01))
        except subprocess.TimeoutExpired:
            if left <= CANCEL_CHECK_S:
                raise
        if cancelled():
            raise Cancelled("the job was cancelled while its OCR ran", stage="ocr")


def _feed(stdin: IO[bytes] | None, data: bytes) -> None:
    """Write all of data to tesseract's stdin and close it; a tesseract killed meanwhile ends the writing."""
    if stdin is None:
        return
    with contextlib.suppress(OSError):  # BrokenPipeError: tesseract is gone (killed, or it failed)
        stdin.write(data)
    with contextlib.suppress(OSError):
        stdin.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill tesseract and anything it started, then reap it."""
    if proc.poll() is None:  # still running: never signal a group whose leader was already reaped
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def normalise_text(raw: str) -> str:
    """Strip form feeds and trailing space, collapse runs of blank lines."""
    text = raw.replace("\x0c", "").strip()
    return _BLANK_LINES.sub("\n", text)


def tesseract_version(binary: str = "tesseract") -> str:
    """The installed tesseract's version, part of the OCR stage's identity."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unavailable"
    first = (out.stdout or out.stderr).strip().splitlines()[:1]
    return first[0] if first else "unknown"


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
