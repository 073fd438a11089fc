"""How jobs become canvases and workers become command lines: checked without a broker."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler
from celery import chord
from celery.app import backends as celery_backends
from celery.exceptions import SoftTimeLimitExceeded

from stoker.adapters.rlimits import cap_address_space
from stoker.core.errors import BrokerUnavailable, ImageCorrupt, ModelUnavailable, StokerError, TransientError
from stoker.core.jobs import Conversation, InputRecord, renders_pictures
from stoker.runtime.stage import input_stage, time_limit
from stoker.runtime.stages.audio import transcribe_limit_s
from stoker.settings import ApiSettings, WorkerSettings
from tasks.app import make_app
from tasks.pipeline import job_canvas
from tasks.preprocess import decode
from tests.fakes.outbox import NoOutbox
from workers.launch import worker_argv, worker_env

#: A producer app, as the API builds one: signatures need no broker until sent.
APP = make_app(WorkerSettings())


def _inputs(n: int) -> list[InputRecord]:
    return [InputRecord(index=i, kind="image", content_hash=f"h{i}", size_bytes=1) for i in range(n)]


def test_images_are_preprocessed_in_parallel_then_tokenized_once() -> None:
    canvas = job_canvas("j", app=APP, inputs=_inputs(3))
    assert isinstance(canvas, chord)
    chains = canvas.tasks
    assert len(chains) == 3
    for index, link in enumerate(chains):
        decode, ocr = link.tasks
        assert (decode.task, ocr.task) == ("stoker.decode", "stoker.ocr")
        assert decode.args == ("j", f"input:{index}")
        assert decode.immutable
    assert canvas.body.task == "stoker.tokenize"
    assert canvas.body.kwargs == {"job_id": "j"}


def _names(signature: Any) -> list[str]:
    return [t.task for t in signature.tasks] if hasattr(signature, "tasks") else [signature.task]


def test_audio_is_probed_then_transcribed() -> None:
    audio = InputRecord(index=0, kind="audio", content_hash="a", size_bytes=1)
    canvas = job_canvas("j", app=APP, inputs=[audio])
    assert [_names(c) for c in canvas.tasks] == [["stoker.probe", "stoker.transcribe"]]
    assert canvas.tasks[0].tasks[0].args == ("j", "input:0")


def test_video_gets_its_sound_and_each_keyframe_slot_through_the_image_branch() -> None:
    video = InputRecord(index=1, kind="video", content_hash="v", size_bytes=1)
    canvas = job_canvas("j", app=APP, inputs=[_inputs(1)[0], video], keyframes=2)
    branches = [_names(c) for c in canvas.tasks]
    assert branches == [
        ["stoker.decode", "stoker.ocr"],
        ["stoker.probe", "stoker.transcribe"],
        ["stoker.keyframe", "stoker.decode", "stoker.ocr"],
        ["stoker.keyframe", "stoker.decode", "stoker.ocr"],
    ]
    assert canvas.tasks[3].tasks[0].args == ("j", 1, 1, 2)
    assert canvas.tasks[3].tasks[1].args == ("j", "input:1:frame:1")


def test_text_only_job_goes_straight_to_tokenize() -> None:
    canvas = job_canvas("j", app=APP, inputs=[])
    assert canvas.task == "stoker.tokenize"
    assert canvas.args == (None,)


def test_cached_jobs_enter_later() -> None:
    assert job_canvas("j", app=APP, inputs=_inputs(2), start="tokenize").task == "stoker.tokenize"
    straight = job_canvas("j", app=APP, inputs=_inputs(2), start="infer", deadline=9.0, prompt_tokens=42)
    assert (straight.task, straight.kwargs) == ("stoker.infer", {"job_id": "j", "prompt_tokens": 42, "deadline": 9.0})


def test_a_render_of_one_picture_is_one_task_and_of_several_a_decode_each_then_tokenize() -> None:
    # One picture: one message that renders it and ends the job, rescued if its child is killed, expiring at the
    # deadline; several: rendered in parallel, with no OCR task behind any (a render reads no text).
    one = job_canvas("j", app=APP, inputs=_inputs(1), start="render", deadline=1_900_000_000.0)
    assert (one.task, one.args, one.immutable) == ("stoker.render", ("j", "input:0"), True)
    assert one.options["ignore_result"] is True
    assert one.options["expires"] == datetime.fromtimestamp(1_900_000_000.0, UTC)
    assert [(e["task"], e["kwargs"]) for e in one.options["link_error"]] == [("stoker.rescue", {"job_id": "j"})]
    several = job_canvas("j", app=APP, inputs=_inputs(3), start="render")
    assert isinstance(several, chord)
    assert [(t.task, t.args) for t in several.tasks] == [("stoker.decode", ("j", f"input:{i}")) for i in range(3)]
    assert several.body.task == "stoker.tokenize"
    assert job_canvas("j", app=APP, inputs=[], start="render").task == "stoker.tokenize"
    assert APP.amqp.router.route({}, "stoker.render")["queue"].name == "decode"


def test_only_a_render_of_inline_pictures_skips_preprocessing() -> None:
    # A transcription is a render of a sound, and a picture by URL must be fetched first: both keep their
    # preprocessing canvas; a text-only render has nothing to render.
    render = Conversation(turns=[], render=True)
    pictures = _inputs(2)
    assert renders_pictures(render, pictures)
    assert renders_pictures(render, [])
    assert not renders_pictures(Conversation(turns=[]), pictures)
    assert not renders_pictures(None, pictures)
    assert not renders_pictures(render, [*pictures, InputRecord(index=2, kind="audio", content_hash="c", size_bytes=1)])
    by_url = InputRecord(index=0, kind="image", content_hash="", size_bytes=0, url="https://example.com/a.png")
    assert not renders_pictures(render, [by_url])


def test_inference_worker_may_hold_whole_batches() -> None:
    settings = WorkerSettings(max_batch_size=8, prefetch_batches=3)
    argv = worker_argv("infer", settings)
    assert argv[argv.index("--queues") + 1] == "infer"
    assert int(argv[argv.index("--prefetch-multiplier") + 1]) == 24
    assert argv[argv.index("--concurrency") + 1] == "1"


def test_cpu_worker_runs_prefork_so_time_limits_apply() -> None:
    argv = worker_argv("cpu", WorkerSettings(cpu_pool=3), ["--loglevel", "DEBUG"])
    assert argv[argv.index("--pool") + 1] == "prefork"
    assert argv[argv.index("--queues") + 1] == "decode,ocr,ocr_bands,asr,tokenize,callbacks"  # every CPU stage
    assert argv[argv.index("--concurrency") + 1] == "3"
    assert argv[-2:] == ["--loglevel", "DEBUG"]


def test_stage_failures_become_structured_input_errors() -> None:
    record = _inputs(1)[0]
    with input_stage(record, "decode"):
        raise ImageCorrupt("bad bytes")
    assert record.status == "failed"
    assert record.error is not None
    assert (record.error.code, record.error.stage) == ("image_corrupt", "decode")
    assert "decode" in record.timings_ms


def test_unexpected_stage_crash_fails_only_that_input() -> None:
    record = _inputs(1)[0]
    with input_stage(record, "decode"):
        raise KeyError("boom")
    assert record.status == "failed"
    assert record.error is not None
    assert record.error.code == StokerError.code


def test_stage_crashes_name_the_stage_where_the_taxonomy_has_a_code() -> None:
    for stage, code in [("ocr", "ocr_failed"), ("transcribe", "asr_failed")]:
        record = _inputs(1)[0]
        with input_stage(record, stage):
            raise RuntimeError("boom")
        assert record.error is not None
        assert record.error.code == code


def test_transient_failures_escape_the_stage_so_the_task_retries() -> None:
    record = _inputs(1)[0]
    with pytest.raises(BrokerUnavailable), input_stage(record, "decode"):
        raise redis.ConnectionError("store restarting")
    with pytest.raises(ModelUnavailable), input_stage(record, "decode"):
        raise ModelUnavailable()
    assert record.status == "pending"
    assert decode.autoretry_for == (TransientError,)
    assert decode.max_retries == 3


def test_every_stage_message_expires_at_the_job_deadline() -> None:
    video = InputRecord(index=1, kind="video", content_hash="v", size_bytes=1)
    canvas = job_canvas("j", app=APP, inputs=[_inputs(1)[0], video], keyframes=2, deadline=1_900_000_000.0)
    tasks = [canvas.body, *(t for link in canvas.tasks for t in link.tasks)]
    assert len(tasks) == 1 + 2 + 2 + 3 + 3
    assert {t.options["expires"] for t in tasks} == {datetime.fromtimestamp(1_900_000_000.0, UTC)}
    alone = job_canvas("j", app=APP, inputs=[], deadline=1_900_000_000.0)
    assert alone.options["expires"] == datetime.fromtimestamp(1_900_000_000.0, UTC)


def test_a_tighter_limit_inside_a_stage_raises_its_timeout() -> None:
    record = _inputs(1)[0]
    with input_stage(record, "transcribe"), time_limit(0.2, "transcribe"):
        time.sleep(5)  # the work the limit cuts short: had it run out, no error would be recorded
    assert record.error is not None
    assert record.error.code == "asr_timeout"


def test_transcription_gets_time_in_proportion_to_the_media_under_a_cap() -> None:
    s = WorkerSettings()
    short = InputRecord(index=0, kind="audio", content_hash="a", size_bytes=1, features={"duration_s": 20.0})
    long = short.model_copy(update={"features": {"duration_s": 590.0}})
    assert transcribe_limit_s(s, short) == s.transcribe_base_s + 20.0 * s.transcribe_per_media_s
    assert transcribe_limit_s(s, long) == s.transcribe_soft_s


def test_visibility_timeout_must_outlast_every_limit() -> None:
    with pytest.raises(ValueError, match="visibility_timeout_s"):
        WorkerSettings(visibility_timeout_s=100, transcribe_hard_s=180)
    assert (
        WorkerSettings(
            visibility_timeout_s=10,
            transcribe_hard_s=8,
            transcribe_soft_s=6,
            keyframes_hard_s=8,
            fetch_hard_s=8,
            ocr_hard_s=8,
            infer_batch_timeout_s=5,
            infer_wedge_grace_s=2,
            handoff_max_wait_s=2,
        ).visibility_timeout_s
        == 10
    )


def test_error_codes_are_unique() -> None:
    def walk(cls: type[StokerError]) -> list[type[StokerError]]:
        return [cls, *(c for sub in cls.__subclasses__() for c in walk(sub))]

    classes = walk(StokerError)
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    assert all(c.__doc__ for c in classes)


def _allocate_past_the_cap() -> None:
    """In a child: cap at current size + 256 MiB, then ask for 1 GiB; exit 0 only if it was refused."""
    in_use_mb = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    cap_address_space(in_use_mb + 256)
    try:
        bytearray(1024 * 1024 * 1024)
    except MemoryError:
        os._exit(0)
    os._exit(1)


def test_address_space_cap_refuses_a_runaway_allocation() -> None:
    child = multiprocessing.get_context("fork").Process(target=_allocate_past_the_cap)
    child.start()
    child.join(30)
    assert child.exitcode == 0


def test_soft_time_limits_get_the_stage_code() -> None:
    for stage, code in [
        ("decode", "image_decode_timeout"),
        ("ocr", "ocr_timeout"),
        ("transcribe", "asr_timeout"),
        ("probe", "stage_timeout"),
    ]:
        record = _inputs(1)[0]
        with input_stage(record, stage):
            raise SoftTimeLimitExceeded()
        assert record.error is not None
        assert record.error.code == code


@contextlib.contextmanager
def _limited(kind: str, seconds: float) -> Iterator[None]:
    """A stage's own limit (`time_limit`), or Celery's soft limit as a prefork child gets it: the signal its pool
    sends, handled by billiard's own handler, which raises in whatever frame the signal interrupts."""
    if kind == "own":
        with time_limit(seconds, "decode"):
            yield
        return
    previous = signal.signal(SIG_SOFT_TIMEOUT, soft_timeout_sighandler)
    pool = threading.Timer(seconds, os.kill, (os.getpid(), SIG_SOFT_TIMEOUT))
    pool.start()
    try:
        yield
    finally:
        pool.cancel()
        signal.signal(SIG_SOFT_TIMEOUT, previous)


@pytest.mark.parametrize("limit", ["celery", "own"])
def test_a_limit_that_fires_while_the_store_does_not_answer_is_retried_not_blamed_on_the_input(limit: str) -> None:
    record = _inputs(1)[0]
    with socket.create_server(("127.0.0.1", 0)) as mute:  # takes connections, never answers
        client = redis.Redis(port=mute.getsockname()[1], socket_timeout=10)
        with pytest.raises(BrokerUnavailable) as outage, _limited(limit, 0.3), input_stage(record, "decode"):
            client.get("stoker:anything")
    assert not outage.value.permanent  # the stage task retries it (RETRY)
    assert (record.status, record.error) == ("pending", None)


@pytest.mark.parametrize("limit", ["celery", "own"])
def test_a_limit_that_fires_in_the_stages_own_work_fails_the_input(limit: str) -> None:
    record = _inputs(1)[0]
    with _limited(limit, 0.3), input_stage(record, "decode"):
        time.sleep(5)
    assert record.error is not None
    assert (record.status, record.error.code, record.error.stage) == ("failed", "image_decode_timeout", "decode")


def test_cpu_children_are_recycled() -> None:
    argv = worker_argv("cpu", WorkerSettings(max_tasks_per_child=7, max_memory_per_child_kb=123456))
    assert argv[argv.index("--max-tasks-per-child") + 1] == "7"
    assert argv[argv.index("--max-memory-per-child") + 1] == "123456"


def test_a_dedicated_ocr_pool_serves_ocr_and_its_bands_alone_with_the_cpu_pool_size() -> None:
    argv = worker_argv("ocr", WorkerSettings(cpu_pool=16))
    assert argv[argv.index("--queues") + 1] == "ocr,ocr_bands"  # whole pages and the bands of dense ones
    assert argv[argv.index("--pool") + 1] == "prefork"
    assert argv[argv.index("--concurrency") + 1] == "16"


def test_concurrency_and_autoscale_from_the_command_line_win() -> None:
    argv = worker_argv("cpu", WorkerSettings(cpu_pool=2), ["--concurrency", "8", "--autoscale", "16,2"])
    assert argv[-4:] == ["--concurrency", "8", "--autoscale", "16,2"]


def test_no_worker_runs_under_omp_thread_limit_which_is_tesseracts_alone() -> None:
    # The speech model (CTranslate2) under OMP_THREAD_LIMIT=1 with its own thread count left to choose runs ~40x
    # slower and transcribes garbage; every CPU child may transcribe, and tesseract sets its own limit.
    for kind in ("cpu", "ocr", "asr", "sync"):
        assert "OMP_THREAD_LIMIT" not in worker_env(kind, {"OMP_THREAD_LIMIT": "1", "PATH": "/usr/bin"}), kind


def test_the_result_backend_class_is_looked_up_once_however_many_threads_publish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lookups: list[str] = []
    by_url = celery_backends.by_url

    def counted(url: str, loader: object) -> tuple[type, str]:
        lookups.append(url)
        found: tuple[type, str] = by_url(url, loader)
        return found

    monkeypatch.setattr(celery_backends, "by_url", counted)
    app = make_app(ApiSettings())
    made: list[object] = []
    threads = [threading.Thread(target=lambda: made.append(app.backend)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(backend) for backend in made}) == 4  # still one backend per thread (Redis's is not thread-safe)
    assert lookups == [app.conf.result_backend]


def _priorities(signature: Any) -> list[Any]:
    """Every task's broker priority in a canvas, depth first."""
    if hasattr(signature, "tasks"):
        return [p for task in signature.tasks for p in _priorities(task)]
    return [signature.options.get("priority")]


def test_an_interactive_inputs_stages_carry_its_size_class_and_tokenize_the_first_priority() -> None:
    small, large = (
        InputRecord(index=i, kind="image", content_hash=f"h{i}", size_bytes=1, size_class=size)
        for i, size in enumerate((0, 2))
    )
    canvas = job_canvas("j", app=APP, inputs=[small, large])
    assert [_priorities(branch) for branch in canvas.tasks] == [[0, 0], [2, 2]]  # decode and OCR of each
    assert canvas.body.options["priority"] == 0  # never the large input's, whose task may finish the chord


def test_a_batch_lines_stages_carry_the_batch_priority_whatever_their_size() -> None:
    inputs = [InputRecord(index=i, kind="image", content_hash=f"h{i}", size_bytes=1, size_class=i) for i in range(3)]
    canvas = job_canvas("j", app=APP, inputs=inputs, job_class="batch")
    assert [p for branch in canvas.tasks for p in _priorities(branch)] == [9] * 6
    assert canvas.body.options["priority"] == 9


def test_the_speech_model_is_loaded_once_when_two_threads_ask_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool child's preload thread and a recording that came first ask for the model at once: one load."""
    from stoker.runtime.context import WorkerContext

    loads: list[int] = []
    started = threading.Event()

    def slow_load(self: WorkerContext) -> object:
        loads.append(threading.get_ident())
        started.set()
        time.sleep(0.2)  # a load in progress, so the second caller comes while it runs
        return object()

    monkeypatch.setattr(WorkerContext, "_load_speech_model", slow_load)
    ctx = WorkerContext(WorkerSettings(), outbox=NoOutbox())
    got: list[object] = []
    first = threading.Thread(target=lambda: got.append(ctx.speech_model))
    first.start()
    assert started.wait(5)
    got.append(ctx.speech_model)
    first.join(5)
    assert len(loads) == 1
    assert got[0] is got[1]


def test_the_local_models_torch_threads_come_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """STOKER_TORCH_THREADS reaches the predictor the worker builds, and its setup sets torch's pool to it."""
    import torch

    from stoker.adapters.backends.local import TransformersPredictor
    from stoker.runtime.context import WorkerContext

    predictor = WorkerContext(WorkerSettings(torch_threads=1), outbox=NoOutbox())._local_predictor()
    assert predictor.threads == 1
    monkeypatch.setattr(TransformersPredictor, "_load_model", lambda self, device: object())  # no weights needed
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        predictor.setup("cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_local_models_engine_settings_reach_the_predictor() -> None:
    """STOKER_LOCAL_ENGINE, STOKER_ENGINE_MAX_ROWS and STOKER_KV_CACHE_TOKENS reach the predictor the worker builds."""
    from stoker.runtime.context import WorkerContext

    settings = WorkerSettings(local_engine=False, engine_max_rows=3, kv_cache_tokens=4096)
    predictor = WorkerContext(settings, outbox=NoOutbox())._local_predictor()
    assert (predictor.engine, predictor.max_rows, predictor.kv_cache_tokens) == (False, 3, 4096)
    assert not predictor.mixes_sampling


def test_a_recordings_own_limit_starts_once_its_speech_model_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool child that just started may still be loading the speech model: the wait is no fault of the
    recording, so the recording's own limit (here 0.3 s) does not count it (here 0.8 s)."""
    from stoker.core.asr import Transcript
    from stoker.runtime.context import WorkerContext
    from stoker.runtime.stages import audio as media

    def slow_load(self: WorkerContext) -> object:
        time.sleep(0.8)
        return object()

    monkeypatch.setattr(WorkerContext, "_load_speech_model", slow_load)
    monkeypatch.setattr(media, "cache_scope", lambda ctx, job_id: "tests")
    monkeypatch.setattr(media, "through_cache", lambda ctx, record, address, compute, wait: compute())  # no cache
    monkeypatch.setattr(media, "input_bytes", lambda ctx, record, stage: b"")
    monkeypatch.setattr(media, "decode_audio", lambda data: [])
    monkeypatch.setattr(media, "transcribe_samples", lambda model, samples, beam: Transcript("heard", []))
    ctx = WorkerContext(WorkerSettings(transcribe_base_s=0.3, transcribe_per_media_s=0.0), outbox=NoOutbox())
    record = InputRecord(index=0, kind="audio", content_hash="a", size_bytes=1, features={"duration_s": 1.0})
    with input_stage(record, "transcribe"):
        media.transcribe(ctx, "job", record)
    assert (record.status, record.text, record.error) == ("ok", "heard", None)
