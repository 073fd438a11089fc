"""Tools, structured outputs and streamed text as plain values: the Hermes convention a template without tools reads,
calls parsed back from an answer, the grammars an answer is held to, and pieces that never have to be taken back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llguidance import LLMatcher

from stoker.adapters.backends.grammar import check_grammar, grammar_for
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.tokenizer import load_prompt_tokenizer
from stoker.core.errors import GrammarRefused
from stoker.core.model import GenerationParams
from stoker.core.streaming import TextStream
from stoker.core.tools import ToolSpec, call_mode, fold_tools, parse_tool_calls
from stoker.settings import CommonSettings

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
TOOLS = (ToolSpec.model_validate(WEATHER), ToolSpec.model_validate(CLOCK))


def _params(**fields: Any) -> GenerationParams:
    return GenerationParams.model_validate(fields)


def test_calls_of_offered_tools_are_parsed_out_of_the_answer_and_anything_else_stays_text() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>\n'
        "<tool_call>{not json</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}'  # cut off by the token limit after its JSON
    )
    rest, calls = parse_tool_calls(text, TOOLS)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    assert all(c.id.startswith("call_") for c in calls)
    assert rest.startswith("Let me look.")
    assert "launch_rockets" in rest
    assert "{not json" in rest


def test_a_chat_with_tools_reads_in_plain_turns_for_a_template_without_tools() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "12 C, rain", "tool_call_id": "call_1"},
        {"role": "tool", "content": "10:00", "tool_call_id": "call_2"},
    ]
    folded = fold_tools(messages, TOOLS)
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user"]
    assert folded[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in folded[0]["content"]
    assert folded[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    results = "<tool_response>\n12 C, rain\n</tool_response>\n<tool_response>\n10:00\n</tool_response>"
    assert folded[3]["content"] == results
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in folded)
    assert fold_tools(messages[1:2], TOOLS)[0]["role"] == "system"  # a system turn is made for the tools


def test_the_real_tokenizer_renders_the_offered_tools_and_a_tool_result() -> None:
    tokenizer = load_prompt_tokenizer(resolve_model(CommonSettings().model, CommonSettings().model_cache))
    chat = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "tool", "content": "12 C, rain", "tool_call_id": "call_1"},
    ]
    text = tokenizer.decode_text(tokenizer.render(chat, TOOLS))
    assert "<tools>" in text
    assert '"get_time"' in text
    assert "<|im_start|>user\n<tool_response>\n12 C, rain\n</tool_response><|im_end|>" in text
    plain = tokenizer.decode_text(tokenizer.render(chat[:1]))
    assert "<tools>" not in plain


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ({}, "none"),
        ({"tools": [WEATHER]}, "auto"),
        ({"tools": [WEATHER], "tool_choice": "none"}, "none"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "get_weather"),
    ],
)
def test_what_a_request_asks_of_its_answers_calls(fields: dict[str, Any], mode: str) -> None:
    params = _params(**fields)
    assert params.calls == mode == call_mode(params.tools, params.tool_choice)


def test_grammars_hold_an_answer_to_its_format_and_to_a_call_of_the_named_tool() -> None:
    named = grammar_for(
        _params(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    )
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    formats = {
        "json_object": grammar_for(_params(response_format={"type": "json_object"})),
        "json_schema": grammar_for(
            _params(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
        ),
    }
    assert grammar_for(_params()) is None
    assert grammar_for(_params(response_format={"type": "text"})) is None
    for grammar in [named, *formats.values()]:
        assert grammar is not None
        assert LLMatcher.validate_grammar(grammar) == ""
    assert named is not None
    assert "get_time" in named
    assert "get_weather" not in named
    assert "integer" in str(formats["json_schema"])


def test_a_schema_that_cannot_be_compiled_is_refused_with_why() -> None:
    bad = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(("}}}
    with pytest.raises(GrammarRefused) as refused:
        check_grammar(_params(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": bad}}))
    assert refused.value.param == "response_format"
    assert (refused.value.code, refused.value.http_status) == ("unsupported_schema", 400)
    assert "unclosed group" in str(refused.value)
    check_grammar(_params(response_format={"type": "json_object"}))  # a good one passes


def _pieces(stream: TextStream, growing: list[str], final: str) -> list[str]:
    pieces = [stream.advance(text) for text in growing]
    pieces.append(stream.finish(final))
    return [p for p in pieces if p]


def test_streamed_pieces_add_up_to_the_answer_and_never_take_anything_back() -> None:
    growing = [" ", " Hel", " Hello ", " Hello wo", " Hello world\ufffd", " Hello world\u00e9 "]
    growing.append(" Hello world\u00e9 !  ")
    pieces = _pieces(TextStream(), growing, " Hello world\u00e9 !  ")
    assert "".join(pieces) == " Hello world\u00e9 !  "  # the model's whitespace kept
    assert len(pieces) >= 3
    assert not any("\ufffd" in p for p in pieces)


def test_a_stream_holds_what_may_begin_a_stop_sequence_and_ends_before_it() -> None:
    stream = TextStream(stop=["END"])
    assert stream.advance("one E") == "one "
    assert stream.advance("one EN") == ""  # still maybe the stop sequence
    assert stream.advance("one ENTRY") == "ENTRY"
    assert stream.advance("one ENTRY END and more") == " "
    assert stream.advance("one ENTRY END and more, longer") == ""
    assert stream.sent == "one ENTRY "
    assert stream.finish("one ENTRY ") == ""
