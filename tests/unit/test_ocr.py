"""OCR with the real tesseract on rendered text."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image, ImageDraw, ImageFont

from stoker.adapters.cache import StageCache
from stoker.adapters.tesseract import read_text
from stoker.core.errors import Cancelled, OcrFailed, OcrTimeout
from stoker.core.imaging import DecodeParams, decode_image
from stoker.core.ocr import Band, band_limit, join_bands, normalise_text, plan_bands
from stoker.runtime.context import WorkerContext
from stoker.runtime.stages.ocr import bands_for
from stoker.settings import WorkerSettings
from tests.conftest import missing
from tests.fakes.outbox import NoOutbox
from tests.media import text_image
from workers.procs import running, wait_for


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
    started = [int(pid) for pid in pids.read_text().split()]
    wait_for(lambda: not any(running(pid) for pid in started), 10, "the stub's processes to be gone", [])
    assert [pid for pid in started if running(pid)] == []


def test_a_cancelled_job_stops_its_tesseract_with_everything_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    stub = tmp_path / "tesseract"
    stub.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ $! > {pids}\nwait\n")
    stub.chmod(0o755)
    asked = []

    def cancelled() -> bool:
        asked.append(pids.exists())
        return pids.exists()  # cancelled once tesseract is under way

    with pytest.raises(Cancelled) as info:
        read_text(_gray("CANCEL"), "eng", timeout_s=60, binary=str(stub), cancelled=cancelled)
    assert info.value.code == "cancelled"
    assert asked[-1] is True
    started = [int(pid) for pid in pids.read_text().split()]
    wait_for(lambda: not any(running(pid) for pid in started), 10, "the stub's processes to be gone", [])


def test_a_tesseract_slow_to_read_still_gets_all_its_input_between_cancel_checks(tmp_path: Path) -> None:
    # It starts reading only after several cancel checks: the page (far more than a pipe holds) must still
    # arrive whole, not stop at what the first slice managed to write.
    stub = tmp_path / "tesseract"
    stub.write_text("#!/bin/sh\nsleep 0.8\necho $(wc -c) bytes\n")
    stub.chmod(0o755)
    gray = np.zeros((1600, 2400), dtype=np.uint8)
    text = read_text(gray, "eng", timeout_s=20, binary=str(stub), cancelled=lambda: False)
    header = b"P5\n2400 1600\n255\n"
    assert text == f"{len(header) + 2400 * 1600} bytes"


def test_asking_whether_cancelled_changes_nothing_else() -> None:
    text = read_text(_gray("HELLO WORLD"), "eng", timeout_s=30, cancelled=lambda: False)
    assert "HELLO" in text
    with pytest.raises(OcrTimeout):
        read_text(_gray("SLOW"), "eng", timeout_s=0.001, cancelled=lambda: False)


def test_missing_tesseract_is_a_structured_error() -> None:
    with pytest.raises(OcrFailed):
        read_text(_gray("X"), "eng", timeout_s=5, binary="/nonexistent/tesseract")


def test_unknown_language_is_a_structured_error() -> None:
    with pytest.raises(OcrFailed):
        read_text(_gray("HELLO"), "xx_not_a_language", timeout_s=10)


def _chinese_page(text: str) -> np.ndarray:
    """Simplified Chinese rendered with a CJK font (`make test` installs fonts-wqy-zenhei)."""
    found = subprocess.run(["fc-list", ":lang=zh", "file"], capture_output=True, text=True, check=False)
    path = next(iter(sorted(found.stdout.split())), "").rstrip(":")
    if found.returncode or not path.endswith((".ttc", ".ttf", ".otf")):
        missing("no CJK font: apt-get install fonts-wqy-zenhei")
    page = Image.new("L", (900, 200), "white")
    ImageDraw.Draw(page).text((40, 60), text, fill="black", font=ImageFont.truetype(path, 64))
    return np.asarray(page, dtype=np.uint8)


def test_simplified_chinese_is_read_with_chi_sim_and_not_without() -> None:
    page = _chinese_page("发票号码 四七一一")
    text = read_text(page, "chi_sim", timeout_s=20)
    assert "号码" in text
    assert "四七一一" in text
    assert "号码" not in read_text(page, "eng", timeout_s=20)  # the language pack, not luck, reads it


def test_normalise_collapses_blank_lines_and_form_feeds() -> None:
    assert normalise_text("a\n\n\n b\n\x0c") == "a\n b"


def _page(lines: int, size: tuple[int, int] = (1600, 1400), font_size: int = 36) -> npt.NDArray[np.uint8]:
    """A page of `lines` text lines spaced as print is, as decode hands it to OCR (grayscale)."""
    image = Image.new("L", size, 255)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    for row in range(lines):
        draw.text(
            (40, 30 + row * int(font_size * 1.6)), f"ROW{row} " + " ".join(f"W{row}X{n}" for n in range(9)), 0, font
        )
    return np.asarray(image, dtype=np.uint8)


def test_bands_cut_only_at_blank_rows_and_cover_the_page() -> None:
    gray = _page(22)
    bands = plan_bands(gray, band_rows=400, search_rows=80, overlap_rows=24)
    assert len(bands) == round(gray.shape[0] / 400)
    assert bands[0].top == 0
    assert bands[-1].bottom == gray.shape[0]
    for above, below in itertools.pairwise(bands):
        assert above.bottom == below.top  # no overlap: every cut found a blank row
        assert not below.overlapped
        assert (gray[above.bottom] >= 128).all()  # the cut row has no ink: no line was cut


def test_a_page_without_blank_rows_is_cut_with_an_overlap() -> None:
    gray = np.zeros((1200, 300), dtype=np.uint8)  # ink everywhere: nowhere to cut cleanly
    bands = plan_bands(gray, band_rows=400, search_rows=80, overlap_rows=24)
    assert [(b.top, b.bottom, b.overlapped) for b in bands] == [(0, 424, False), (376, 824, True), (776, 1200, True)]


def test_a_cap_on_the_count_makes_fewer_taller_bands_still_cut_at_blank_rows() -> None:
    gray = _page(22)
    assert round(gray.shape[0] / 400) > 2  # uncapped, more than two
    bands = plan_bands(gray, band_rows=400, search_rows=80, overlap_rows=24, most=2)
    assert len(bands) == 2
    assert (bands[0].top, bands[0].bottom, bands[1].bottom) == (0, bands[1].top, gray.shape[0])
    assert (gray[bands[0].bottom] >= 128).all()


@pytest.mark.parametrize(
    ("configured", "cores", "children", "most"),
    [
        (0, 2, 3, 2),  # three children share two cores: two bands run at once
        (0, 8, 3, 3),  # three children on a big host
        (0, 8, 1, 2),  # one child: still two, so a small page can go between them
        (5, 2, 3, 5),  # as configured
    ],
)
def test_the_band_limit_is_what_the_pool_reads_at_once(configured: int, cores: int, children: int, most: int) -> None:
    assert band_limit(configured, cores, children) == most


@pytest.mark.parametrize(("cache_on", "children", "count"), [(True, 3, 2), (True, 1, 2), (False, 3, 1)])
def test_a_worker_cuts_a_dense_page_into_what_its_pool_reads_at_once(cache_on: bool, children: int, count: int) -> None:
    """On two cores (given here), three children read two bands at once; with the stage cache off, where bands
    would each decode the page again, the page is read whole."""
    gray = _page(22)
    settings = WorkerSettings(ocr_band_min_pixels=1, ocr_band_rows=200, cache_enabled=cache_on)
    ctx = WorkerContext(settings, outbox=NoOutbox(), cache=StageCache.connect(settings), cores=2)
    ctx.pool_children = children
    bands = bands_for(ctx, gray)
    assert round(gray.shape[0] / 200) > 2  # the rows alone would allow more
    assert len(bands) == count
    assert (bands[0].top, bands[-1].bottom) == (0, gray.shape[0])


def test_a_short_page_is_one_band() -> None:
    assert plan_bands(_page(3, size=(800, 500)), 400, 80, 24) == [Band(0, 500)]


def test_joined_band_texts_drop_the_line_an_overlap_repeats() -> None:
    bands = [Band(0, 100), Band(90, 200, overlapped=True), Band(200, 300)]
    texts = ["one\ntwo  words", "two words\nthree", "three\nfour"]  # the clean cut keeps a repeat as it is
    assert join_bands(texts, bands) == "one\ntwo  words\nthree\nthree\nfour"


def test_a_dense_page_read_in_bands_reads_as_the_whole_page() -> None:
    gray = _page(22)
    bands = plan_bands(gray, band_rows=400, search_rows=80, overlap_rows=24)
    whole = read_text(gray, "eng", timeout_s=30)
    texts = [read_text(gray[b.top : b.bottom], "eng", timeout_s=30) for b in bands]
    assert len(bands) >= 3
    assert join_bands(texts, bands).split() == whole.split()


class QueueDepths:
    """The outbox seam as the band planner sees it: the CPU queues' depths, or a broker that does not answer."""

    def __init__(self, waiting: int | None) -> None:
        self.waiting, self.asked = waiting, 0

    def queue_depths(self, queues: list[str], timeout_s: float | None = None) -> dict[str, int]:
        self.asked += 1
        if self.waiting is None:
            raise ConnectionError("broker away")
        return {name: self.waiting if name == "asr" else 0 for name in queues}


def _idle_rule_bands(gray: npt.NDArray[np.uint8], outbox: QueueDepths, idle_min: int = 500_000) -> list[Band]:
    settings = WorkerSettings(ocr_band_min_pixels=1_500_000, ocr_band_idle_min_pixels=idle_min)
    ctx = WorkerContext(settings, outbox=outbox, cache=StageCache.connect(settings), cores=2)  # type: ignore[arg-type]
    ctx.pool_children = 3
    return bands_for(ctx, gray)


def test_a_page_of_text_under_the_size_threshold_is_cut_only_while_no_cpu_work_waits() -> None:
    gray = _page(14, size=(1024, 768), font_size=30)
    assert gray.size < 1_500_000  # below the size threshold: whole, but for the idle rule
    idle, busy, away = QueueDepths(0), QueueDepths(1), QueueDepths(None)
    bands = _idle_rule_bands(gray, idle)
    assert len(bands) == 2
    assert not bands[1].overlapped  # cut at a blank row
    assert (bands[0].top, bands[0].bottom, bands[1].bottom) == (0, bands[1].top, 768)
    assert _idle_rule_bands(gray, busy) == [Band(0, 768)]  # a message waits: read whole, at the least CPU
    assert _idle_rule_bands(gray, away) == [Band(0, 768)]  # the broker does not answer: as under load
    assert _idle_rule_bands(gray, QueueDepths(0), idle_min=0) == [Band(0, 768)]  # the rule off
    assert (idle.asked, busy.asked, away.asked) == (1, 1, 1)


def test_a_picture_with_no_blank_row_is_read_whole_on_an_idle_pool_without_asking_the_broker() -> None:
    rng = np.random.default_rng(3)
    photo = rng.integers(0, 256, size=(768, 1024), dtype=np.uint8)  # ink on every row: no line to cut between
    idle = QueueDepths(0)
    assert _idle_rule_bands(photo, idle) == [Band(0, 768)]
    small = _page(8, size=(800, 600), font_size=30)  # 480,000 pixels: under the idle rule's floor
    assert _idle_rule_bands(small, idle) == [Band(0, 600)]
    assert idle.asked == 0
