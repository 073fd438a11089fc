"""A model request rendered into vLLM's `GenerateRequest`, as the `openai` backend hands it to a server's
`/inference/v1/generate` (`STOKER_OPENAI_PROTOCOL`): the chat as the chat-completions path would send it (each
turn's text, then its pictures), rendered here as vLLM 0.33.0's render tier renders it (`stoker.adapters.render`):
token ids, each picture's placeholder range, hash and tensors (from the stage cache, where the CPU stage put them),
sampling parameters, the parse context for its tools. The server then runs the model alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from stoker.adapters.render import Rendered, RenderedPicture, Renderer
from stoker.adapters.vllm_render import features, generate_request, parse_context, sampling_params
from stoker.core.errors import ContextLengthExceeded, ImageTensorsMissing
from stoker.core.model import GenerationParams, ModelRequest
from stoker.core.tools import ToolSpec

#: A picture's rendering by its content hash in a cache scope; None when neither the cache nor the store has it.
PictureSource = Callable[[str, str], RenderedPicture | None]


class RequestRenderer:
    """The served model's renderer, turning a backend's requests into `GenerateRequest` bodies."""

    def __init__(self, renderer: Renderer, pictures: PictureSource, model: str) -> None:
        self.renderer = renderer
        self.pictures = pictures
        self.model = model

    def body(self, request: ModelRequest, *, max_tokens: int, priority: int, stream: bool) -> dict[str, Any]:
        """The request as vLLM's `GenerateRequest`: answered as a parsed chat message (`derender`), or as token
        ids to detokenize here when it is streamed (vLLM's derender does not stream)."""
        messages, digests = self._messages(request)
        pictures = [self._picture(digest, request.scope) for digest in digests]
        params = request.params
        tools = [t.model_dump(exclude_none=True) for t in params.tools] or None
        rendered = self.renderer.chat(messages, [p.layout for p in pictures], tools)
        sampling = self._sampling(params, rendered, max_tokens, stream)
        hashes = [self.renderer.picture_hash(digest) for digest in digests]
        calls = sum(len(m.get("tool_calls") or []) for m in request.messages if m.get("role") == "assistant")
        return generate_request(
            f"stoker-{uuid.uuid4().hex}",
            rendered.token_ids,
            sampling,
            model=self.model,
            mm_features=features(hashes, rendered.placeholders, [p.wire for p in pictures]),
            parse_context=parse_context(tools, _tool_choice(params), history_tool_call_cnt=calls),
            stream=stream,
            priority=priority,
            output_mode="tokens" if stream else "derender",
        )

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Answer tokens as text (special tokens left out)."""
        return str(self.renderer.tokenizer.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _messages(self, request: ModelRequest) -> tuple[list[dict[str, Any]], list[str]]:
        """The turns as the renderer takes them (a turn with pictures: its text part, then an image part per
        picture; a request whose turns name none: every picture on the last user turn, as the chat path sends
        them), and the pictures' content hashes in order."""
        turns = [dict(m) for m in request.messages]
        if request.images and not any("images" in m for m in turns) and turns and turns[-1]["role"] == "user":
            turns[-1]["images"] = list(request.images)
        digests: list[str] = []
        shaped = []
        for turn in turns:
            images = turn.pop("images", None) or []
            if images:
                turn["content"] = [{"type": "text", "text": turn["content"]}, *({"type": "image"} for _ in images)]
            digests += images
            shaped.append(turn)
        return shaped, digests

    def _picture(self, digest: str, scope: str) -> RenderedPicture:
        picture = self.pictures(digest, scope)
        if picture is None:
            raise ImageTensorsMissing(f"picture {digest[:12]} is gone (cache and job store)", stage="infer")
        return picture

    def _sampling(self, params: GenerationParams, rendered: Rendered, max_tokens: int, stream: bool) -> dict[str, Any]:
        """vLLM's sampling parameters for the request, its new tokens within the context's room, its answer's
        form as vLLM's structured outputs."""
        limit, tokens = self.renderer.max_model_len, len(rendered.token_ids)
        room = limit - tokens
        if room <= 0:  # as the server would refuse it, in its words
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your request has {tokens} input "
                "tokens. Please reduce the length of the input messages.",
                stage="infer",
                param="messages",
            )
        sampling = sampling_params(
            max_tokens=min(max_tokens, room),
            temperature=params.temperature,
            top_p=params.top_p if params.top_p != 1 else None,
            seed=params.seed,
            stop=list(params.stop),
            n=params.n,
            logprobs=params.top_logprobs if params.logprobs else None,
            stream=stream,
            tools_parsed=params.calls != "none",
        )
        structured = structured_outputs(params)
        return sampling | {"structured_outputs": structured} if structured else sampling


def _tool_choice(params: GenerationParams) -> Any:
    choice = params.tool_choice
    return choice.model_dump() if choice is not None and not isinstance(choice, str) else choice


def structured_outputs(params: GenerationParams) -> dict[str, Any] | None:
    """The constraint vLLM's chat path puts on a request's decoding (`StructuredOutputsParams`): a named function's
    arguments, one or more calls of the tools (`required`), JSON, JSON valid against a schema; None: free text."""
    calls = params.calls
    if calls == "required":
        return {"json": _calls_schema(params.tools)}
    if calls not in ("none", "auto"):
        tool = next(t for t in params.tools if t.function.name == calls)
        return {"json": tool.function.parameters}
    answer = params.response_format
    if answer is None or answer.type == "text":
        return None
    if answer.type == "json_object" or answer.json_schema is None:
        return {"json_object": True}
    return {"json": answer.json_schema.json_schema}


def _calls_schema(tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """vLLM's schema for `tool_choice: required`: a list of one call or more, each a tool's name and parameters."""
    each = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": each}}
