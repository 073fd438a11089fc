"""The shortest path for cheap jobs: a job with nothing left to preprocess (text only, or every input cached) is
tokenized in the API, off the event loop, and goes to the inference queue in one hop instead of through the
tokenize queue. Tokenizing a prompt takes milliseconds; a broker round trip and a CPU worker's turn cost more.

The API uses the workers' own tokenizer (same model files): a prompt it builds is only used when its tokenizer's
identity matches the one the workers published, so the model gets exactly what the tokenize stage would build.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.tokenizer import PromptTokenizer, load_prompt_tokenizer
from stoker.core.cachekeys import PipelineContext
from stoker.core.jobs import ChatTurn
from stoker.core.prompting import Attachment, BuiltPrompt, build_prompt
from stoker.core.tools import ToolSpec
from stoker.settings import ApiSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


@functools.cache
def _tokenizer_of(model_path: str) -> tuple[PromptTokenizer, str]:
    """The model's prompt tokenizer and its identity, loaded once per process (a failed load is not kept): every
    app this process builds shares it, as one app's request threads already do. The API never reloads a model's
    files; a changed model is a new identity at the workers, and then this API's prompts go unused (`build`)."""
    prompt_tokenizer = load_prompt_tokenizer(model_path)
    return prompt_tokenizer, prompt_tokenizer.identity(model_path)


class PromptBuilder:
    """The model's tokenizer in the API process, loaded in the background at start (never on a request's path),
    used on the serving loop for short prompts and on a few threads of its own (`api_tokenize_threads`) for the rest.

    Its own threads, not the request pool's: each thread that has run the tokenizer keeps memory of its own. The
    `tokenizers` library keeps its BPE word cache per thread (up to 10,000 words each, huggingface/tokenizers#2028),
    and glibc's allocator gives threads arenas of their own: on the request pool's 40 threads the API grew by
    tens of MB more than on a few, and the hop to these costs about 10 µs of CPU a job (the measurements, and why
    four by default: docs/bench/log/2026-12-05-api-memory-under-admission.md)."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self._loaded: tuple[PromptTokenizer, str] | None = None
        self._lock = threading.Lock()
        # threads start on first use, so an app that never tokenizes holds none
        self._threads = ThreadPoolExecutor(settings.api_tokenize_threads, thread_name_prefix="stoker-tokenize")

    def load(self) -> None:
        """Load the tokenizer (seconds); until then, and if it cannot be loaded, jobs take the tokenize queue."""
        if not self.settings.api_tokenize:
            return
        try:
            prompt_tokenizer, identity = _tokenizer_of(
                str(resolve_model(self.settings.model, self.settings.model_cache, fetch=False))
            )
        except Exception as exc:  # no model files here (an API on its own host): the queue hop still works
            log.warning("no tokenizer in the API (%s): cheap jobs go through the tokenize queue", exc)
            return
        with self._lock:
            self._loaded = (prompt_tokenizer, identity)
        log.info("tokenizer loaded: text-only and cached jobs go straight to the inference queue")

    @property
    def loaded(self) -> bool:
        """Whether the tokenizer is here (cheap jobs can take the one-hop path)."""
        with self._lock:
            return self._loaded is not None

    def build_here(
        self,
        context: PipelineContext,
        prompt: str,
        attachments: Sequence[Attachment],
        turns: Sequence[ChatTurn] | None = None,
        tools: Sequence[ToolSpec] = (),
        trim: bool = False,
    ) -> BuiltPrompt | None:
        """The prompt as the tokenize stage would build it (`trim`: fitted to the context rather than refused), on
        the calling thread (the serving loop, for a short prompt); None when this API cannot (not loaded, or another
        tokenizer than the workers').

        Rendering and encoding hold the GIL throughout (two threads building prompts take twice one's wall time),
        so a tokenizing thread never let the loop serve meanwhile: for a short prompt (50-60 µs here) it only
        added the hop there and back (docs/bench/log/2026-12-05-cost-store-calls-on-the-loop.md)."""
        tokenizer = self._tokenizer_for(context)
        if tokenizer is None:
            return None
        return build_prompt(tokenizer, prompt, attachments, context.budget, turns, context.system, tools, trim=trim)

    async def build_off_loop(
        self,
        context: PipelineContext,
        prompt: str,
        attachments: Sequence[Attachment],
        turns: Sequence[ChatTurn] | None = None,
        tools: Sequence[ToolSpec] = (),
        trim: bool = False,
    ) -> BuiltPrompt | None:
        """`build_here`, on a tokenizing thread, awaited: a long prompt (or one with pictures) would hold the
        loop for milliseconds; from a thread, the interpreter's switch interval gives the loop its turns."""
        built = self._threads.submit(self.build_here, context, prompt, attachments, turns, tools, trim)
        return await asyncio.wrap_future(built)

    async def run_off_loop(self, context: PipelineContext, work: Callable[[PromptTokenizer], T]) -> T | None:
        """`work` with the workers' tokenizer, on a tokenizing thread, awaited (`/tokenize`, `/detokenize`); None
        when this API has no such tokenizer (not loaded, or another than the workers')."""
        tokenizer = self._tokenizer_for(context)
        if tokenizer is None:
            return None
        return await asyncio.wrap_future(self._threads.submit(work, tokenizer))

    def _tokenizer_for(self, context: PipelineContext) -> PromptTokenizer | None:
        with self._lock:
            loaded = self._loaded
        return loaded[0] if loaded is not None and loaded[1] == context.tokenizer else None

    def close(self) -> None:
        """Let the tokenizing threads end once idle (a prompt being built still finishes)."""
        self._threads.shutdown(wait=False)
