"""OCR with the real tesseract on rendered text."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stoker.core.errors import OcrFailed, OcrTimeout
from stoker.core.imaging import DecodeParams, decode_image
from stoker.core.ocr import normalise_text, read_text, tesseract_version
from tests.media import text_image
from workers.procs import running


def _gray(text: str):  # type: ignore[no-untyped-def]
    return decode_image(text_image(text), DecodeParams()).ocr_image


def test_tesseract_reads_rendered_text() -> None:
    text = read_text(_gray("INVOICE 4711"), "eng", timeout_s=10)
    assert "INVOICE" in text
    assert "4711" in text


def test_timeout_is_a_structured_error() -> None:
    with pytest.raises(OcrTimeout) as info:
        read_text(_gray("SLOW"), "eng", timeout_s=0.001)
    assert info.value.code == "ocr_timeout"


def test_a_hung_tesseract_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    stub = tmp_path / "tesseract"
    stub.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ $! > {pids}\nwait\n")
    stub.chmod(0o755)
    with pytest.raises(OcrTimeout):
        read_text(_gray("HUNG"), "eng", timeout_s=0.5, binary=str(stub))
    time.sleep(0.2)
    assert [pid for pid in map(int, pids.read_text().split()) if running(pid)] == []


def test_missing_tesseract_is_a_structured_error() -> None:
    with pytest.raises(OcrFailed):
        read_text(_gray("X"), "eng", timeout_s=5, binary="/nonexistent/tesseract")


def test_unknown_language_is_a_structured_error() -> None:
    with pytest.raises(OcrFailed):
        read_text(_gray("HELLO"), "xx_not_a_language", timeout_s=10)


def test_chinese_language_pack_is_installed() -> None:
    assert tesseract_version()
    read_text(_gray("HELLO"), "eng+chi_sim", timeout_s=20)


def test_normalise_collapses_blank_lines_and_form_feeds() -> None:
    assert normalise_text("a\n\n\n b\n\x0c") == "a\n b"
