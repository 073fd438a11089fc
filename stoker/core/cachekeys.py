"""Cache addresses of stage results: content hash, stage version and a fingerprint of every parameter that shapes
the output. Pure: each function takes the parameters it fingerprints; callers read them from their settings.
(The Redis key an address maps to is laid out in `stoker.adapters.store.keys`.)"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import blake3
import PIL

from stoker.core import asr, imaging, ocr, prompting
from stoker.core.avmedia import KEYFRAMES_VERSION
from stoker.core.imaging import DecodeParams
from stoker.core.jobs import ChatTurn, SpeechOptions
from stoker.core.prompting import Attachment
from stoker.core.tools import ToolSpec

#: The parts of one decode entry: the grayscale picture OCR reads, and the picture a server that sees images gets
#: (PNG, at the served model's own size).
OCR_IMAGE = "ocr_image"
PICTURE = "picture"
#: The part of a vision entry (`vision_address`): the served model's image processor's tensors (safetensors).
VISION_TENSORS = "vision_tensors"
#: The stage version of vision entries: bump when what the decode stage stores there changes.
VISION_VERSION = "1"


@dataclass(frozen=True)
class DecodeOutputs:
    """What the decode stage makes under this configuration, beyond the features: part of its cache address.

    `ocr`: the grayscale OCR image; `processor`: the identity of the model's image processor whose tensors it
    stores ("" for none); `picture`: the served picture's bounds (longest side, pixels) for a server that sees
    images, or None; `render`: the identity of the rendering it caches for vLLM's generate endpoint ("" for none)."""

    ocr: bool = True
    processor: str = ""
    picture: tuple[int, int] | None = None
    render: str = ""


def fingerprint(**parts: Any) -> str:
    """A short stable digest of everything that changes a stage's output."""
    return blake3.blake3(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CacheAddress:
    """Where one stage result for one content under one parameter set lives, in whose scope.

    The scope (`stoker.core.tenancy.cache_scope`) is the tenant the entry belongs to, so one tenant's results never
    answer, or speed up, another's; or one scope for all when sharing is on.
    """

    stage: str
    version: str
    digest: str
    fingerprint: str
    scope: str


@dataclass(frozen=True)
class PipelineContext:
    """The workers' identity as published for the API: preprocessing fingerprint, tokenizer, prompt budget, the
    configured system prompt ("" for none), and the decode parameters a picture's rendering is made from (their
    repr, as its cache address names them; "" from workers that published none), by which the API finds a render's
    pictures already rendered."""

    identity: str
    tokenizer: str
    budget: int
    system: str = ""
    render_decode: str = ""


def pipeline_context(
    *,
    ocr_at: CacheAddress,
    decode_at: CacheAddress,
    asr: Sequence[Any],
    keyframes: Sequence[Any],
    tokenizer: str,
    budget: int,
    system: str = "",
    render_decode: str = "",
) -> PipelineContext:
    """The identity of whole cached inputs and prompts from every parameter that shapes them: the OCR and decode
    addresses' fingerprints (the decode's say whether OCR runs, and which image processor's tensors it makes), the
    speech model, the keyframe choice, the stage versions and the tokenizer."""
    identity = fingerprint(
        ocr=ocr_at.fingerprint,
        decode=decode_at.fingerprint,
        asr=list(asr),
        keyframes=list(keyframes),
        versions=[imaging.VERSION, ocr.VERSION, VISION_VERSION],
    )
    return PipelineContext(
        identity=identity, tokenizer=tokenizer, budget=budget, system=system, render_decode=render_decode
    )


def decode_address(digest: str, scope: str, params: DecodeParams, outputs: DecodeOutputs | None = None) -> CacheAddress:
    """Cache address of decode's output for this content under these decode parameters and outputs (and this
    Pillow)."""
    made = asdict(outputs or DecodeOutputs())
    if not made["render"]:
        del made["render"]  # addresses from before renderings were cached stay as they were
    parts = fingerprint(params=asdict(params), outputs=made, pillow=PIL.__version__)
    return CacheAddress("decode", imaging.VERSION, digest, parts, scope)


def vision_address(digest: str, scope: str, params: DecodeParams, processor: str) -> CacheAddress:
    """Cache address of one picture's tensors as the model's image processor (named by its identity) makes them
    from the decoded picture."""
    parts = fingerprint(params=asdict(params), processor=processor, pillow=PIL.__version__)
    return CacheAddress("vision", f"{imaging.VERSION}.{VISION_VERSION}", digest, parts, scope)


def ocr_address(
    digest: str, scope: str, *, params: DecodeParams, langs: str, tesseract: str, outputs: DecodeOutputs | None = None
) -> CacheAddress:
    """Cache address of OCR text: languages, tesseract version and the decode it reads from."""
    decoded = decode_address(digest, scope, params, outputs).fingerprint
    parts = fingerprint(langs=langs, tesseract=tesseract, decode=decoded)
    return CacheAddress("ocr", ocr.VERSION, digest, parts, scope)


def ocr_band_address(page: CacheAddress, top: int, bottom: int) -> CacheAddress:
    """Cache address of one band's OCR text: the page's OCR address and the rows the band covers, so a retry or a
    repeat of the page reuses every band already read."""
    parts = fingerprint(page=page.fingerprint, top=top, bottom=bottom)
    return CacheAddress("ocr_band", ocr.VERSION, page.digest, parts, page.scope)


def transcribe_address(
    digest: str, scope: str, *, model: str, weights: str, beam: int, speech: SpeechOptions | None = None
) -> CacheAddress:
    """Cache address of a transcript: the speech model, its weights, its beam and VAD (always on), and the
    language, prompt and temperature a request asked for (`speech`); a request that asked for none of them (or the
    defaults) has the address transcripts had before requests could ask."""
    asked = speech_asked(speech)
    if asked:
        parts = fingerprint(model=model, weights=weights, beam=beam, vad=True, asked=asked)
    else:
        parts = fingerprint(model=model, weights=weights, beam=beam, vad=True)
    return CacheAddress("transcribe", asr.VERSION, digest, parts, scope)


def speech_asked(speech: SpeechOptions | None) -> dict[str, Any]:
    """What a request asked of its transcription that differs from the deployment's way: a language, a prompt, a
    temperature above 0 (0 is the default fallback's first)."""
    if speech is None:
        return {}
    asked = {"language": speech.language, "prompt": speech.prompt or None, "temperature": speech.temperature or None}
    return {name: value for name, value in asked.items() if value is not None}


def keyframe_address(digest: str, slot: int, count: int, scope: str, *, max_media_seconds: float) -> CacheAddress:
    """Cache address of one keyframe choice of a video."""
    parts = fingerprint(slot=slot, count=count, limit=max_media_seconds)
    return CacheAddress("keyframes", KEYFRAMES_VERSION, digest, parts, scope)


def prompt_address(
    context: PipelineContext,
    prompt: str,
    attachments: Sequence[Attachment],
    scope: str,
    turns: Sequence[ChatTurn] | None = None,
    tools: Sequence[ToolSpec] = (),
    trim: bool = False,
) -> CacheAddress:
    """Cache address of a tokenized prompt: the whole prompt material (a chat's every turn, the tools it offers)
    under this tokenizer, budget and system prompt; a prompt that may be trimmed to fit (`trim`) has an address of
    its own, so a request that did not allow trimming never reads a trimmed prompt."""
    chat = [t.model_dump() for t in turns] if turns else None
    parts = [prompt, [asdict(a) for a in attachments], context.budget, chat, context.system]
    if tools:
        parts.append([t.model_dump() for t in tools])
    if trim:
        parts.append("trim")
    material = json.dumps(parts, sort_keys=True).encode()
    digest = blake3.blake3(material).hexdigest()
    return CacheAddress("tokenize", prompting.VERSION, digest, context.tokenizer, scope)


def prompt_worth_caching(
    prompt: str,
    attachments: Sequence[Attachment],
    turns: Sequence[ChatTurn] | None,
    tools: Sequence[ToolSpec],
    min_chars: int,
) -> bool:
    """Whether a tokenized prompt is looked up in (and written to) the cache rather than tokenized every time: one
    with attachments or tools, or with more than `min_chars` characters of prompt material (a chat's text, and the
    tool calls its turns carry: `prompting.material_chars`). A short text-only chat costs less to render and
    tokenize again than the lookup's and the write's round trips to the cache; only such a one is tokenized on the
    API's event loop (`api.prompts.PromptBuilder.build_here`)."""
    if attachments or tools or min_chars == 0:
        return True
    material = prompting.material_chars(turns) if turns else len(prompt)
    return material > min_chars


def pipeline_identity(stages: Mapping[str, Any]) -> str:
    """One fingerprint of every stage's parameters: whole cached inputs are valid only under the same identity."""
    return fingerprint(**stages)
