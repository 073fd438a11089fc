"""A chat-completions request made a stoker job: every turn's text and media parts become the job's prompt
material and inputs, under the same limits and magic-byte checks as `POST /v1/jobs`."""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Literal

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from api.chat_schemas import (
    AudioPart,
    AudioUrlPart,
    ChatCompletionCreate,
    ChatMessage,
    ContentPart,
    ImagePart,
    TextPart,
    VideoUrlPart,
)
from api.intake import AcceptedRequest, Payload, UrlInput, first_error, validate_inputs
from api.limits import read_json_body
from stoker.adapters.backends.grammar import check_grammar
from stoker.adapters.store.jobs import check_record_size
from stoker.core.errors import (
    AnswerTooLarge,
    InvalidRequest,
    ModelNotFound,
    PromptTooLong,
    TooManyTokens,
    UnsupportedParameter,
)
from stoker.core.jobs import RAW_PROMPT, ChatTurn, Conversation, InputKind
from stoker.core.model import GenerationParams
from stoker.core.prompting import material_chars
from stoker.core.tools import strict_format, strict_tool
from stoker.settings import ApiSettings

log = logging.getLogger(__name__)


#: The header form of `stoker_on_input_error` (the body's field wins where both are sent).
ON_INPUT_ERROR_HEADER = "X-Stoker-On-Input-Error"
#: Unknown top-level fields logged per request at most, and the length of a name as logged.
LOGGED_UNKNOWN, LOGGED_NAME_CHARS = 16, 64
OnInputError = Literal["degrade", "fail"]


def on_input_error_header(value: str | None) -> OnInputError | None:
    """The header's choice, if sent (422 for anything but `degrade` or `fail`)."""
    if value is None:
        return None
    choice = value.strip().lower()
    if choice not in ("degrade", "fail"):
        raise InvalidRequest(f"{ON_INPUT_ERROR_HEADER} must be `degrade` or `fail`", param=ON_INPUT_ERROR_HEADER)
    return "fail" if choice == "fail" else "degrade"


async def read_chat(
    request: Request, settings: ApiSettings, on_input_error: OnInputError | None = None
) -> tuple[ChatCompletionCreate, AcceptedRequest]:
    """Parse and check a chat request off the event loop (base64 media can be megabytes)."""
    body = await read_json_body(request, settings.max_json_values)
    return await run_in_threadpool(accept_chat, body, settings, on_input_error)


def accept_chat(
    body: bytes, settings: ApiSettings, on_input_error: OnInputError | None = None
) -> tuple[ChatCompletionCreate, AcceptedRequest]:
    """The request, and the job it makes: its turns, its media as inputs, its generation parameters."""
    try:
        spec = ChatCompletionCreate.model_validate_json(body)
    except ValidationError as exc:
        unsupported_part(exc)
        where, message = first_error(exc)
        raise InvalidRequest(f"{where}: {message}", param=where) from exc
    return spec, accept_spec(spec, settings, on_input_error)


def unsupported_part(exc: ValidationError) -> None:
    """Refuse a content part of a type this endpoint does not read (400 `unsupported_parameter`, naming the part
    and its type), rather than pass on pydantic's first error, which is the string the content was not."""
    for error in exc.errors():
        if error["type"] != "union_tag_invalid" or "content" not in error["loc"]:
            continue
        ctx = error.get("ctx") or {}
        where = ".".join(str(p) for p in error["loc"] if not str(p).startswith("list["))
        raise UnsupportedParameter(
            f"{where}: a content part of type `{ctx.get('tag')}` is not read here; "
            f"the part types read are {ctx.get('expected_tags')}",
            param=where,
        ) from exc


def accept_spec(
    spec: ChatCompletionCreate, settings: ApiSettings, on_input_error: OnInputError | None = None, raw: bool = False
) -> AcceptedRequest:
    """The job a parsed chat makes. With `raw`, a legacy completion's: its one user turn is the prompt the model
    continues as it is, without the chat template (`stoker.core.prompting.raw_prompt`)."""
    _log_unknown(spec)
    if spec.model != settings.public_model_name:
        raise ModelNotFound(f"the model `{spec.model}` does not exist here", param="model")
    turns, raw_inputs = chat_turns(spec.messages)
    if not any(t.role == "user" for t in turns):
        raise InvalidRequest("the chat needs at least one user message", param="messages")
    if raw:
        turns = [ChatTurn(role=RAW_PROMPT, text=turns[0].text)]
    _within_prompt_limit(spec, turns, settings.max_prompt_chars)
    choice = spec.stoker_on_input_error or on_input_error or "degrade"
    params = _params(spec, settings)
    truncate = settings.truncate_prompts if spec.stoker_truncate is None else spec.stoker_truncate
    conversation = Conversation(
        turns=turns, params=params, stream=spec.stream, on_input_error=choice, truncate=truncate
    )
    last_user = next(t.text for t in reversed(turns) if t.role in ("user", RAW_PROMPT))
    # the record is sized here, off the event loop and before any prompt is built from it (the store checks the
    # whole record again when it writes it)
    known: dict[str | bytes, str | bytes | float | int] = {"prompt": last_user, "chat": conversation.model_dump_json()}
    check_record_size(known, settings.max_record_bytes)
    check_grammar(params)
    return AcceptedRequest(
        prompt=last_user,
        inputs=validate_inputs(raw_inputs, settings),
        deadline_ms=settings.deadline_ms,
        chat=conversation,
    )


def _within_prompt_limit(spec: ChatCompletionCreate, turns: list[ChatTurn], limit: int) -> None:
    """Refuse a chat whose prompt material passes `limit` characters (422 `prompt_too_long`): every turn's text,
    the tool calls and call ids its turns carry, the tools it offers and its answer's schema, all of which the model
    is given or the grammar compiled from, before any of it is built or tokenized."""
    material = material_chars(turns, spec.tools or ())
    if spec.response_format is not None:
        material += len(spec.response_format.model_dump_json(by_alias=True, exclude_none=True))
    if material > limit:
        raise PromptTooLong(
            f"the chat's prompt material (its turns' text and tool calls, its tools and response_format) is "
            f"{material} characters, more than the {limit} this server takes",
            param="messages",
        )


def _log_unknown(spec: ChatCompletionCreate) -> None:
    """One line per unknown top-level field (its name, cut short), then they are dropped."""
    unknown = list(spec.model_extra or {})
    for name in unknown[:LOGGED_UNKNOWN]:
        log.info("chat request: unknown field %r ignored", name[:LOGGED_NAME_CHARS])
    if len(unknown) > LOGGED_UNKNOWN:
        log.info("chat request: %d more unknown fields ignored", len(unknown) - LOGGED_UNKNOWN)
    if spec.model_extra:
        spec.model_extra.clear()


def _params(spec: ChatCompletionCreate, settings: ApiSettings) -> GenerationParams:
    """The answer's parameters: as many new tokens as asked, within the server's cap (400 above it, as vLLM
    answers a request its context cannot hold), or up to the cap when none are asked."""
    field = "max_completion_tokens" if spec.max_completion_tokens else "max_tokens"
    asked, cap = spec.max_completion_tokens or spec.max_tokens, settings.max_tokens_cap
    if asked is not None and asked > cap:
        raise TooManyTokens(f"`{field}` is {asked}, but this server answers at most {cap} new tokens", param=field)
    _within_answer_limit(spec, asked or cap, field, settings.max_answer_entries)
    return GenerationParams(
        max_tokens=asked or cap,
        temperature=spec.temperature or 0.0,
        top_p=spec.top_p or 1.0,
        stop=spec.stops(),
        seed=spec.seed,
        n=spec.n or 1,
        logprobs=bool(spec.logprobs),
        top_logprobs=spec.top_logprobs or 0,
        # `strict: true` closes the schema's objects here, once, as OpenAI reads it: the grammar and the prompt
        # both get the closed schema
        tools=tuple(strict_tool(t) for t in spec.tools or ()),
        tool_choice=spec.tool_choice,
        response_format=strict_format(spec.response_format),
    )


def _within_answer_limit(spec: ChatCompletionCreate, max_tokens: int, field: str, limit: int) -> None:
    """Refuse a chat whose answers could hold more than `limit` token entries (400 `answer_too_large`): each of its
    `n` answers of up to `max_tokens` tokens, each token with its `top_logprobs` alternatives, is stored with the
    job."""
    n, alternatives = spec.n or 1, spec.top_logprobs or 0
    entries = n * max_tokens * (alternatives + 1)
    if entries <= limit:
        return
    param = "top_logprobs" if alternatives else "n" if n > 1 else field
    raise AnswerTooLarge(
        f"n × {field} × (top_logprobs + 1) is {n} × {max_tokens} × {alternatives + 1} = {entries} token entries, "
        f"more than the {limit} this server stores for one job: ask for fewer answers, tokens or alternatives",
        param=param,
    )


def chat_turns(messages: list[ChatMessage]) -> tuple[list[ChatTurn], list[tuple[InputKind, Payload]]]:
    """Each message as a turn; its media parts appended to the job's inputs, the turn naming their indexes."""
    turns: list[ChatTurn] = []
    raw: list[tuple[InputKind, Payload]] = []
    for position, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        parts = [TextPart(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        texts, indexes = [], []
        for number, part in enumerate(parts or []):
            if isinstance(part, TextPart):
                texts.append(part.text)
                continue
            where = f"messages.{position}.content.{number}"
            if role != "user":
                raise InvalidRequest(f"{where}: only user messages may carry media", param=where)
            indexes.append(len(raw))
            raw.append(_medium(part, where))
        calls = [c.model_dump() for c in message.tool_calls or []]
        turns.append(
            ChatTurn(
                role=role, text="\n".join(texts), inputs=indexes, tool_calls=calls, tool_call_id=message.tool_call_id
            )
        )
    return turns, raw


def _medium(part: ContentPart, where: str) -> tuple[InputKind, Payload]:
    """One media part as an input: its bytes (data URL, `input_audio`) or a URL a worker fetches."""
    if isinstance(part, AudioPart):
        return "audio", _base64(part.input_audio.data, f"{where}.input_audio.data")
    kind: InputKind
    if isinstance(part, ImagePart):
        kind, url = "image", part.image_url.url
    elif isinstance(part, AudioUrlPart):
        kind, url = "audio", part.audio_url.url
    elif isinstance(part, VideoUrlPart):
        kind, url = "video", part.video_url.url
    else:
        raise InvalidRequest(f"{where}: not a media part", param=where)
    if url.startswith("data:"):
        return kind, _data_url(url, f"{where}.{part.type}.url")
    return kind, UrlInput(url)


def _data_url(url: str, where: str) -> bytes:
    """The bytes of a `data:<type>;base64,<data>` URL (the media type is not trusted: the content is sniffed)."""
    header, sep, data = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequest(f"{where}: a data URL must be base64 (data:<type>;base64,<data>)", param=where)
    return _base64(data, where)


def _base64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{where}: not valid base64", param=where) from exc
