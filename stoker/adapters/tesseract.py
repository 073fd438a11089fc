"""tesseract, run as a process: grayscale pixels in, text out (`read_text`), and the installed version.

tesseract runs in a process group of its own and is killed on every way out of read_text, a Celery soft time
limit included (the exception lands mid-wait): no OCR process outlives its task. What is done with its text
(tidied, bands cut and joined) is pure and lives in `stoker.core.ocr`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO

import numpy as np
import numpy.typing as npt

from stoker.core.errors import Cancelled, OcrFailed, OcrTimeout
from stoker.core.ocr import normalise_text

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


def tesseract_version(binary: str = "tesseract") -> str:
    """The installed tesseract's version, part of the OCR stage's identity."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unavailable"
    first = (out.stdout or out.stderr).strip().splitlines()[:1]
    return first[0] if first else "unknown"
