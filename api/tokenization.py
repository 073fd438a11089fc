"""vLLM's `POST /tokenize` and `POST /detokenize`, in vLLM's shapes (`vllm/entrypoints/serve/tokenize/protocol.py`):
a prompt (`TokenizeCompletionRequest`) or a chat (`TokenizeChatRequest`) to the token ids the model is given for
it here, and token ids back to text.

The ids are those stoker's own jobs give the model: a prompt's are a completion's (`/v1/completions`: its text as
plain text, no special token added), a chat's are its turns in the model's template with the deployment's system
prompt, as a chat job's are (never cut: `count` may pass `max_model_len`). Tokenizing runs on the API's tokenizing
threads, never on the event loop, under the chat's limits (the body's JSON values, the prompt's characters).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from api.chat_intake import chat_turns
from api.chat_schemas import MAX_MESSAGES, ChatMessage
from api.context import ApiContext, Context
from api.intake import first_error
from api.limits import read_json_body
from api.schemas import error_responses
from api.tenancy import within_rate
from stoker.adapters.backends.tokenizer import PromptTokenizer
from stoker.core.cachekeys import PipelineContext
from stoker.core.errors import (
    InvalidRequest,
    InvalidTokens,
    ModelNotFound,
    ModelUnavailable,
    PromptTooLong,
    UnsupportedParameter,
)
from stoker.core.jobs import ChatTurn
from stoker.core.prompting import build_prompt, material_chars
from stoker.core.tools import MAX_TOOLS, ToolSpec
from stoker.settings import ApiSettings

router = APIRouter()
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
#: A chat is tokenized whole, never fitted to the context (`count` says how far it passes it).
_UNCUT = 2**31


class _Lenient(BaseModel):
    """vLLM's options stoker has no use for (`mm_processor_kwargs`, …) are accepted and dropped."""

    model_config = ConfigDict(extra="ignore")


class TokenizeCompletion(_Lenient):
    """vLLM's `TokenizeCompletionRequest`."""

    model: str | None = None
    prompt: str
    #: Accepted as vLLM's; a completion's prompt reaches the model here with no special token added.
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(_Lenient):
    """vLLM's `TokenizeChatRequest`."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: Accepted as vLLM's; the template adds what special tokens the model's chat has.
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    """vLLM's `TokenizeResponse`."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenize(_Lenient):
    """vLLM's `DetokenizeRequest`."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


class DetokenizeResponse(BaseModel):
    """vLLM's `DetokenizeResponse`."""

    prompt: str


@router.post(
    "/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 404, 413, 415, 422, 429, 503)
)
async def tokenize(request: Request, context: Context, _: Annotated[str, Depends(within_rate)]) -> TokenizeResponse:
    """A prompt or a chat as the token ids the model is given for it here."""
    settings = context.settings
    body = await read_json_body(request, settings.max_json_values)
    spec = await run_in_threadpool(accept_tokenize, body, settings)
    pipeline = await _pipeline(context)
    ids, strs = await _on_tokenizer(context, pipeline, lambda tokenizer: _tokens(tokenizer, spec, pipeline.system))
    window = pipeline.budget + settings.max_new_tokens
    return TokenizeResponse(count=len(ids), max_model_len=window, tokens=ids, token_strs=strs)


@router.post(
    "/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 401, 404, 413, 415, 422, 429, 503)
)
async def detokenize(request: Request, context: Context, _: Annotated[str, Depends(within_rate)]) -> DetokenizeResponse:
    """Token ids back to the text they spell (special tokens included, as vLLM's)."""
    settings = context.settings
    spec = _parsed(Detokenize, await read_json_body(request, settings.max_json_values))
    _own_model(spec.model, settings)
    pipeline = await _pipeline(context)
    text = await _on_tokenizer(context, pipeline, lambda tokenizer: _text(tokenizer, spec.tokens))
    return DetokenizeResponse(prompt=text)


def accept_tokenize(body: bytes, settings: ApiSettings) -> TokenizeCompletion | TokenizeChat:
    """The request, checked: a chat when it has `messages`, else a prompt; within the chat's prompt limit."""
    try:
        chat = isinstance(parsed := json.loads(body), dict) and "messages" in parsed
    except ValueError as exc:
        raise InvalidRequest("the body is not JSON", param="body") from exc
    spec: TokenizeCompletion | TokenizeChat = _parsed(TokenizeChat, body) if chat else _parsed(TokenizeCompletion, body)
    _own_model(spec.model, settings)
    if isinstance(spec, TokenizeChat):
        _served(spec)
        chars, field = material_chars(_text_turns(spec), spec.tools or ()), "messages"
    else:
        chars, field = len(spec.prompt), "prompt"
    if chars > settings.max_prompt_chars:
        raise PromptTooLong(
            f"the prompt material is {chars} characters, more than the {settings.max_prompt_chars} this server takes",
            param=field,
        )
    return spec


def _parsed(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        where, message = first_error(exc)
        raise InvalidRequest(f"{where}: {message}", param=where) from exc


def _own_model(model: str | None, settings: ApiSettings) -> None:
    if model is not None and model != settings.public_model_name:
        raise ModelNotFound(f"the model `{model}` does not exist here", param="model")


def _served(spec: TokenizeChat) -> None:
    """What a chat job here cannot be, a tokenized chat cannot ask for."""
    if not spec.add_generation_prompt or spec.continue_final_message:
        raise UnsupportedParameter(
            "a chat is tokenized as stoker gives it to the model: with the assistant's turn opened "
            "(add_generation_prompt true, continue_final_message false)",
            param="add_generation_prompt" if not spec.add_generation_prompt else "continue_final_message",
        )
    if spec.chat_template is not None or spec.chat_template_kwargs:
        raise UnsupportedParameter("only the model's own chat template is served", param="chat_template")


def _text_turns(spec: TokenizeChat) -> list[ChatTurn]:
    turns, media = chat_turns(spec.messages)
    if media:
        raise UnsupportedParameter("only text is tokenized here (no picture, audio or video part)", param="messages")
    return turns


def _tokens(
    tokenizer: PromptTokenizer, spec: TokenizeCompletion | TokenizeChat, system: str
) -> tuple[list[int], list[str] | None]:
    """The ids (and, if asked, their token strings); on a tokenizing thread."""
    if isinstance(spec, TokenizeChat):
        turns = _text_turns(spec)
        last = next((t.text for t in reversed(turns) if t.role == "user"), "")
        ids = build_prompt(tokenizer, last, [], _UNCUT, turns, system, tuple(spec.tools or ())).ids
    else:
        ids = tokenizer.encode_text(spec.prompt)
    strs = [str(s) for s in tokenizer.tokenizer.convert_ids_to_tokens(ids)] if spec.return_token_strs else None
    return ids, strs


def _text(tokenizer: PromptTokenizer, ids: list[int]) -> str:
    vocabulary = len(tokenizer.tokenizer)
    unknown = [i for i in ids if i >= vocabulary]
    if unknown:
        raise InvalidTokens(f"token id {unknown[0]} is outside the vocabulary ({vocabulary} ids)", param="tokens")
    return tokenizer.decode_text(ids)


async def _pipeline(context: ApiContext) -> PipelineContext:
    """What the workers published (their tokenizer, prompt budget and system prompt); 503 before they have."""
    cache = context.cache
    pipeline = cache.context() if cache.context_fresh() else await run_in_threadpool(cache.context)
    if pipeline is None:
        raise ModelUnavailable("the workers have not said which tokenizer they use yet; retry shortly", stage="api")
    return pipeline


async def _on_tokenizer(context: ApiContext, pipeline: PipelineContext, work: Callable[[PromptTokenizer], T]) -> T:
    done = await context.prompts.run_off_loop(pipeline, work)
    if done is None:
        raise ModelUnavailable("this API has not loaded the workers' tokenizer (yet); retry shortly", stage="api")
    return done
