"""OpenAI's Responses API as plain values: a Responses request made the chat it runs as, and a chat job's answer made
a `response` object (its output items, usage, status and `incomplete_details`).

A response is a chat job like any other: `input` (a string, or items: messages with `input_text`, `input_image`,
`input_audio` and `input_file` parts, `function_call` and `function_call_output` items) becomes the chat's turns,
`instructions` its system turn, `text.format` its `response_format`, and the flat function tools of the Responses
API the chat's nested ones. What the pipeline cannot read is refused 400, naming the item or part type.
"""

from __future__ import annotations

import mimetypes
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stoker.core.errors import UnsupportedParameter
from stoker.core.jobs import Job, ResultInfo, degraded_codes

#: What a message item's part becomes in a chat message; other part types are refused.
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
#: What an `input_file` may hold: the media kinds the pipeline reads, as the chat part that carries each.
_FILE_KINDS = {"image": "image_url", "audio": "audio_url", "video": "video_url"}
ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponseCreate(BaseModel):
    """A Responses request, as far as stoker serves it; unknown fields are dropped unread, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool | None = None
    metadata: dict[str, str] | None = None
    stoker_on_input_error: Literal["degrade", "fail"] | None = None

    def as_chat(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat-completions body this request runs as, after the `history` of the responses it follows."""
        if self.background:
            raise UnsupportedParameter(
                "background responses are not served: leave `background` out", param="background"
            )
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [*system, *history, *input_messages(self.input)],
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "tools": chat_tools(self.tools) if self.tools else None,
            "tool_choice": chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": chat_response_format(self.text),
            "stoker_on_input_error": self.stoker_on_input_error,
        }
        return {key: value for key, value in body.items() if value is not None}


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user turn; consecutive `function_call` items are one assistant
    turn's calls, and each `function_call_output` a tool turn."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(given):
        kind = item.get("type", "message")
        where = f"input.{position}"
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _output_text(item)})
        else:
            raise UnsupportedParameter(f"{where}: input items of type `{kind}` are not served here", param=where)
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    content = item.get("content")
    if isinstance(content, str):
        return {"role": item.get("role"), "content": content}
    parts = [_part(part, f"{where}.content.{n}") for n, part in enumerate(content or [])]
    return {"role": item.get("role"), "content": parts}


def _part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """One content part as the chat's part; a type the pipeline cannot read is 400, naming it."""
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        return {"type": "text", "text": part.get("text", part.get("refusal", ""))}
    if kind == "input_image" and part.get("image_url"):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio", {})}
    if kind == "input_file":
        return _file(part, where)
    detail = " by `file_id`" if part.get("file_id") else ""
    raise UnsupportedParameter(f"{where}: content parts of type `{kind}`{detail} are not served here", param=where)


def _file(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An `input_file` the pipeline reads (a picture, a recording, a video, by data or URL), as the chat's part."""
    url = part.get("file_data") or part.get("file_url") or ""
    if url.startswith("data:"):
        media = url[5:].partition(";")[0]
    else:
        media = mimetypes.guess_type(part.get("filename") or url)[0] or ""
    chat_part = _FILE_KINDS.get(media.partition("/")[0])
    if not url or chat_part is None:
        what = f" of type `{media}`" if media else ""
        raise UnsupportedParameter(
            f"{where}: an `input_file`{what} is not read here: send a picture, a recording or a video, by data URL "
            "(`file_data`) or `file_url`",
            param=where,
        )
    return {"type": chat_part, chat_part: {"url": url}}


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    call = {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":  # the text said before the calls, and the calls: one turn
        last["tool_calls"] = [*last.get("tool_calls", []), call]
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output_text(item: dict[str, Any]) -> str:
    output = item.get("output", "")
    if isinstance(output, str):
        return output
    return "\n".join(str(part.get("text", "")) for part in output if isinstance(part, dict))


def chat_tools(tools: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's flat function tools as the chat's nested ones; other tool types are refused."""
    nested = []
    for n, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise UnsupportedParameter(
                f"tools.{n}: tools of type `{tool.get('type')}` are not served here", param="tools"
            )
        function = {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None
        }
        nested.append({"type": "function", "function": function})
    return nested


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice` in the chat's shape (a named function nests its name)."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise UnsupportedParameter(
            f"tool_choice of type `{choice.get('type')}` is not served here", param="tool_choice"
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat's `response_format` (`json_schema` nests its name, schema and strictness)."""
    given = (text or {}).get("format")
    if not given or given.get("type") == "text":
        return None
    if given.get("type") == "json_schema":
        inner = {key: given[key] for key in ("name", "description", "schema", "strict") if key in given}
        return {"type": "json_schema", "json_schema": inner}
    return {"type": given.get("type")}


def output_items(response_id: str, result: ResultInfo) -> list[dict[str, Any]]:
    """The answer as output items: its text as one assistant message (when it has text or no calls), then one
    `function_call` item per call."""
    status = "incomplete" if result.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if result.text or not result.tool_calls:
        items.append(message_item(f"msg_{response_id}", result.text, status))
    for call in result.tool_calls or []:
        items.append(call_item(call))
    return items


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant message of one `output_text` part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    """One of the answer's calls (a chat `tool_calls` entry) as a `function_call` item."""
    function = call["function"]
    return {
        "id": f"fc_{call['id']}",
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": "completed",
    }


def usage(result: ResultInfo | None) -> dict[str, Any]:
    """The answer's token counts in the Responses API's shape."""
    given, made = (result.prompt_tokens, result.completion_tokens) if result else (0, 0)
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": made,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": given + made,
    }


def response_object(
    response_id: str,
    created_at: float,
    request: ResponseCreate,
    status: ResponseStatus,
    output: list[dict[str, Any]],
    **more: Any,
) -> dict[str, Any]:
    """A `response` object: the request's settings echoed as OpenAI echoes them, its status and output; `more`
    sets `usage`, `error`, `incomplete_details` or `metadata`."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": request.model,
        "status": status,
        "output": output,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature if request.temperature is not None else 1.0,
        "top_p": request.top_p if request.top_p is not None else 1.0,
        "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto",
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "text": request.text or {"format": {"type": "text"}},
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "background": False,
        "truncation": "disabled",
        "metadata": request.metadata or {},
        "usage": None,
        "error": None,
        "incomplete_details": None,
    }
    return {**body, **more}


def answered(
    response_id: str, created_at: float, request: ResponseCreate, result: ResultInfo, notes: dict[str, str]
) -> dict[str, Any]:
    """The `response` of a job that answered: `incomplete` (`max_output_tokens`) when the answer was cut by its
    token budget; `notes` (stoker's own, a degraded answer's codes) are added to its `metadata`."""
    cut = result.finish_reason == "length"
    return response_object(
        response_id,
        created_at,
        request,
        "incomplete" if cut else "completed",
        output_items(response_id, result),
        usage=usage(result),
        incomplete_details={"reason": "max_output_tokens"} if cut else None,
        metadata={**(request.metadata or {}), **notes},
    )


def as_history(messages: list[dict[str, Any]], output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored conversation followed by a response's output, as the chat messages a later response starts from."""
    return [*messages, *input_messages(output)]


def notes(job: Job) -> dict[str, str]:
    """stoker's own `metadata` on a response: its job, and the codes of the inputs that could not be read (the
    `x-stoker-degraded` header's), where a framework that shows no headers shows the metadata."""
    codes = degraded_codes(job.inputs)
    return {"stoker_job_id": job.id, **({"stoker_degraded": ",".join(codes)} if codes else {})}


def finished(response_id: str, created_at: float, request: ResponseCreate, job: Job) -> dict[str, Any]:
    """The `response` of a job that ended: its answer, or `cancelled`, or `failed` with the job's error."""
    if job.result is not None:
        return answered(response_id, created_at, request, job.result, notes(job))
    error = {"code": job.error.code, "message": job.error.message} if job.error else None
    status: ResponseStatus = "cancelled" if job.status == "cancelled" else "failed"
    metadata = {**(request.metadata or {}), **notes(job)}
    return response_object(response_id, created_at, request, status, [], error=error, metadata=metadata)
