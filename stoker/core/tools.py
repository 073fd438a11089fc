"""Tools and structured outputs as plain values: OpenAI's `tools`, `tool_choice` and `response_format`, how a chat
with tools reads to a model whose own template has no tools (the Hermes convention: the tools' signatures in the
system turn, each call as `<tool_call>{json}</tool_call>`, each result as `<tool_response>`), and the calls parsed
back out of the model's answer.

The Hermes convention is the one Qwen2.5/3, Hermes and SmolLM3 are trained on and vLLM parses with
`--tool-call-parser hermes`; a template that renders tools itself is given them as they are.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The most tools one request may offer (OpenAI's limit), and a function name's form (OpenAI's).
MAX_TOOLS = 128
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


class _Spec(BaseModel):
    """Part of a request: frozen (it rides in the generation parameters) and lenient (clients send more)."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class FunctionSpec(_Spec):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    #: The arguments' JSON schema; none: the function takes no arguments.
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolSpec(_Spec):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionName(_Spec):
    name: str


class NamedToolChoice(_Spec):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class JsonSchemaFormat(_Spec):
    name: str = "response"
    description: str | None = None
    #: The answer's JSON schema (`schema` on the wire; a pydantic attribute cannot be named so).
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True, serialize_by_alias=True)


class ResponseFormat(_Spec):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionCall(_Spec):
    name: str
    #: The arguments as a JSON text, as OpenAI sends them.
    arguments: str


class ToolCall(_Spec):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def call_mode(tools: Sequence[ToolSpec], choice: ToolChoice | None) -> str:
    """What the answer must be: `none` (no call: text), `auto` (text or calls), `required` (one call or more),
    or the name of the one function it must call. No tools: `none`; tools with no choice: `auto`, as OpenAI's."""
    if not tools or choice == "none":
        return "none"
    if choice is None or choice == "auto":
        return "auto"
    if choice == "required":
        return "required"
    assert isinstance(choice, NamedToolChoice)
    return choice.function.name


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON schema of one call of this tool as the model writes it: `{"name": ..., "arguments": {...}}`."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def strict_tool(tool: ToolSpec) -> ToolSpec:
    """A tool as its calls are held to it: its parameters closed (`closed_schema`) when it is `strict`."""
    function = tool.function
    if not function.strict:
        return tool
    closed = function.model_copy(update={"parameters": closed_schema(function.parameters)})
    return tool.model_copy(update={"function": closed})


def strict_format(answer: ResponseFormat | None) -> ResponseFormat | None:
    """A `json_schema` answer format as the answer is held to it: its schema closed when it is `strict`."""
    if answer is None or answer.json_schema is None or not answer.json_schema.strict:
        return answer
    closed = answer.json_schema.model_copy(update={"json_schema": closed_schema(answer.json_schema.json_schema)})
    return answer.model_copy(update={"json_schema": closed})


#: The keywords of a JSON schema whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMAS = ("anyOf", "allOf", "oneOf", "prefixItems")
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema: Any) -> Any:
    """A schema as OpenAI's `strict: true` reads it: every object in it takes no properties but those it names
    (`additionalProperties: false` where the schema says nothing of them), however deep (`properties`, `items`,
    `anyOf`, `$defs`, ...). An object that allows more properties explicitly keeps its choice."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in schema:
            closed[key] = closed_schema(schema[key])
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), list):
            closed[key] = [closed_schema(item) for item in schema[key]]
    for key in _NAMED_SUBSCHEMAS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: closed_schema(item) for name, item in schema[key].items()}
    if isinstance(schema.get("additionalProperties"), dict):
        closed["additionalProperties"] = closed_schema(schema["additionalProperties"])
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def drop_unclosed_call(text: str) -> str:
    """An answer's text without a call it opened and never closed (one cut by its token limit): the text before
    that call's tag. A closed block stays, as `parse_tool_calls` leaves it."""
    opened = text.rfind(CALL_OPEN)
    if opened < 0 or CALL_CLOSE in text[opened:]:
        return text
    return text[:opened].rstrip()


def tools_prompt(tools: Sequence[ToolSpec]) -> str:
    """The system turn's part that offers the tools, in the Hermes convention."""
    signatures = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        f'{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{CALL_CLOSE}"
    )


def written_call(call: dict[str, Any]) -> str:
    """One call (OpenAI's `tool_calls` entry) as the model writes it."""
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments  # kept as the client sent it: the model reads what was there
    body = json.dumps({"name": function.get("name", ""), "arguments": parsed}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def fold_tools(messages: Sequence[dict[str, Any]], tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """A chat with tools as plain turns for a template that has none: the tools offered in the system turn (the
    chat's own, or one made for them), each assistant call written out in its turn, and each run of tool results
    one user turn of `<tool_response>` blocks (as Qwen's template writes them)."""
    out: list[dict[str, Any]] = []
    previous = ""
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if previous == "tool":  # the same run of results: one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
        else:
            calls = message.get("tool_calls") or []
            if calls:
                content = "\n".join([content, *(written_call(c) for c in calls)]).strip()
            plain = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
            out.append({**plain, "content": content})
        previous = role
    if tools:
        offer = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{offer}".strip()}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


def parse_tool_calls(text: str, tools: Sequence[ToolSpec]) -> tuple[str, list[ToolCall]]:
    """The answer's text outside its calls, and its calls of the offered tools (a block that is not a JSON call of
    one of them stays in the text, as the model wrote it)."""
    names = {t.function.name for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    start = 0
    for match in _CALL.finditer(text):
        call = parse_call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[start : match.start()])
        start = match.end()
        calls.append(call)
    kept.append(text[start:])
    return "".join(kept).strip(), calls


def parse_call(body: str, names: Collection[str]) -> ToolCall | None:
    """One call's body (the JSON between its tags) as a call of one of the named tools; None if it is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return ToolCall(
        id=f"call_{secrets.token_hex(12)}",
        function=FunctionCall(name=str(data["name"]), arguments=json.dumps(arguments, ensure_ascii=False)),
    )
