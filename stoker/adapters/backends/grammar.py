"""Constrained decoding for the local model: a request's `response_format` and forced tool calls as an llguidance
grammar, checked once at the API (a schema it cannot compile is refused there) and applied token by token inside the
batched `generate` as a logits processor, one matcher per row.

llguidance (the grammar engine behind vLLM's and llama.cpp's structured outputs) compiles JSON schemas and Lark
grammars lazily, so a mask costs microseconds per token; it needs no torch.compile, which its own torch helper
uses and a CPU host without a compiler cannot run: the bitmask is applied here with plain tensor ops.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from typing import Any

import llguidance
from llguidance import LLMatcher, StructTag

from stoker.core.errors import GrammarRefused
from stoker.core.model import GenerationParams
from stoker.core.tools import CALL_CLOSE, CALL_OPEN, ToolSpec, call_schema

log = logging.getLogger(__name__)

#: How JSON is written: OpenAI's and vLLM's answers are JSON a client parses, whitespace between tokens only.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def grammar_for(params: GenerationParams) -> str | None:
    """The grammar the request's answer must follow; None: free text."""
    mode = params.calls
    if mode == "auto":
        return _lazy_calls(params.tools)
    if mode != "none":
        tools = params.tools if mode == "required" else [t for t in params.tools if t.function.name == mode]
        return _forced_call(tools)
    answer = params.response_format
    if answer is None or answer.type == "text":
        return None
    if answer.type == "json_object":
        return _json({"type": "object"})
    assert answer.json_schema is not None  # the request's validation asks for it
    return _json(answer.json_schema.json_schema)


def check_grammar(params: GenerationParams) -> None:
    """Refuse (400) a request whose answer's grammar cannot be compiled, saying why."""
    try:
        grammar = grammar_for(params)
        problem = LLMatcher.validate_grammar(grammar) if grammar is not None else ""
    except (ValueError, TypeError, RecursionError) as exc:  # what building or compiling a grammar from a schema
        problem = str(exc) or type(exc).__name__  # the client sent can raise: the request's fault, never a 500
    if problem:
        where = "tools" if params.calls != "none" else "response_format"
        raise GrammarRefused(f"`{where}` cannot be used to constrain the answer: {problem.strip()[:500]}", param=where)


def _json(schema: object) -> str:
    return LLMatcher.grammar_from_json_schema(_schema(schema), defaults=_JSON_OPTIONS)


def _compact(schema: object) -> dict[str, Any]:
    """A schema for a grammar's `%json`, which takes its options from the schema itself."""
    checked = _schema(schema)
    return {**checked, "x-guidance": {**_JSON_OPTIONS, **checked.get("x-guidance", {})}}


def _schema(schema: object) -> dict[str, Any]:
    """A client's JSON schema, refused (ValueError) unless it and its llguidance options are objects."""
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    if not isinstance(schema.get("x-guidance", {}), dict):
        raise ValueError("a schema's `x-guidance` must be an object")
    return schema


def _forced_call(tools: Sequence[ToolSpec]) -> str:
    """One call of one of the tools, in its tags. (`required` allows several calls in OpenAI's API, but a model
    that must write a call tends to write the same one again until its token limit: one is what it is held to.)"""
    schema = _compact({"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 else call_schema(tools[0]))
    call = f"{json.dumps(CALL_OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CALL_CLOSE)}"
    return LLMatcher.grammar_from_lark(f"start: {call}\n")


def _lazy_calls(tools: Sequence[ToolSpec]) -> str:
    """Free text, but once the model opens a call, a valid call of one of the tools."""
    tags = [
        StructTag(
            trigger=CALL_OPEN,
            begin=f'{CALL_OPEN}\n{{"name": {json.dumps(t.function.name)}, "arguments": ',
            grammar=_compact(t.function.parameters),
            end=f"}}\n{CALL_CLOSE}",
        )
        for t in tools
    ]
    return LLMatcher.grammar_from_lark(StructTag.to_grammar(tags, assume_special=False))


def token_grammar(tokenizer: Any) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance reads it (about a second: built once per process)."""
    import llguidance.hf  # needs transformers: loaded where the model is

    return llguidance.hf.from_tokenizer(tokenizer)


class GrammarMask:
    """A logits processor for `generate`: each constrained row's next token is one its grammar allows (past the
    tokens `done` it already has, for an answer that goes on); rows without a grammar are left alone. A row that
    ends (its grammar complete, or the end-of-sequence token) is left alone too: `generate` pads it from then on.

    A row whose grammar fails (it cannot load, refuses a token, or its matcher errors on a resource limit) is never
    left to go on unconstrained: from then on its one allowed token is `end` (the end of sequence), and `failed`
    says why, for its request to fail alone."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        grammars: Sequence[str | None],
        width: int,
        done: Sequence[Sequence[int]] = (),
        *,
        end: int,
    ) -> None:
        self.width = width
        self.end = end
        #: Rows whose grammar failed, and why.
        self.failed: dict[int, str] = {}
        #: Rows ended otherwise (a stop sequence): `generate` pads them, and their grammar reads no more.
        self.ended: Collection[int] = ()
        self.matchers = [LLMatcher(tokenizer, g) if g is not None else None for g in grammars]
        for row, matcher in enumerate(self.matchers):
            if matcher is not None and row < len(done) and done[row]:
                matcher.consume_tokens(list(done[row]))  # an answer that goes on: past what it has
            if matcher is not None and matcher.is_error():
                self._fail(row, f"its grammar failed to load: {matcher.get_error()}")

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch  # heavy: in the model's process only

        if input_ids.shape[1] > self.width:
            self._consume(input_ids[:, -1].tolist())
        for row, matcher in enumerate(self.matchers):
            allowed = self._allowed(torch, row, matcher, scores.shape[1]) if matcher is not None else None
            if row in self.failed:
                allowed = torch.zeros(scores.shape[1], dtype=torch.bool)
                allowed[self.end] = True
            if allowed is not None:  # a complete grammar's mask allows the end of sequence alone
                scores[row] = scores[row].masked_fill(~allowed.to(scores.device), float("-inf"))
        return scores

    def _allowed(self, torch: Any, row: int, matcher: LLMatcher, vocab: int) -> Any | None:
        """The tokens a row's grammar allows next, over the model's vocabulary; None once its grammar failed."""
        if row in self.failed:
            return None
        packed = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        if matcher.is_error():  # a resource limit met while computing the mask
            self._fail(row, f"its grammar failed: {matcher.get_error()}")
            return None
        allowed = ((packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
        if allowed.shape[0] < vocab:
            allowed = torch.cat([allowed, torch.zeros(vocab - allowed.shape[0], dtype=torch.bool)])
        return allowed[:vocab]

    def _consume(self, tokens: list[int]) -> None:
        for row, (matcher, token) in enumerate(zip(self.matchers, tokens, strict=True)):
            if matcher is None or row in self.failed or row in self.ended or matcher.is_stopped():
                continue
            if not matcher.consume_token(token) or matcher.is_error():
                self._fail(row, f"its grammar refused token {token}: {matcher.get_error()}")

    def _fail(self, row: int, reason: str) -> None:
        """End the row at its next token: what it writes can no longer be held to its grammar."""
        log.warning("row %d: %s; the row is ended and its request fails", row, reason)
        self.failed[row] = reason


class RowGrammar:
    """One row's grammar for the decode engine (`engine.DecodeEngine`): the mask of the tokens it allows next, and
    the tokens the row takes. A grammar that fails (it cannot load, refuses a token, or errors on a resource limit)
    allows the end of sequence alone from then on, and `failure` says why (the row's request fails alone)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, done: Sequence[int] = (), *, end: int) -> None:
        self.end = end
        self.failure: str | None = None
        self.matcher = LLMatcher(tokenizer, grammar)
        if done:
            self.matcher.consume_tokens(list(done))  # an answer that goes on: past what it has
        if self.matcher.is_error():
            self._fail(f"its grammar failed to load: {self.matcher.get_error()}")

    def mask(self, scores: Any, torch: Any) -> Any:
        """The row's scores (one vector over the vocabulary) with the tokens its grammar refuses at -inf."""
        vocab = int(scores.shape[0])
        allowed = None if self.failure is not None else self._allowed(torch, vocab)
        if allowed is None:  # failed: the end of sequence alone
            allowed = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
            allowed[self.end] = True
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def _allowed(self, torch: Any, vocab: int) -> Any | None:
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        if self.matcher.is_error():  # a resource limit met while computing the mask
            self._fail(f"its grammar failed: {self.matcher.get_error()}")
            return None
        allowed = ((packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
        if allowed.shape[0] < vocab:
            allowed = torch.cat([allowed, torch.zeros(vocab - allowed.shape[0], dtype=torch.bool)])
        return allowed[:vocab]

    def consume(self, token: int) -> None:
        """The row took `token` (nothing after its grammar completed or failed)."""
        if self.failure is not None or self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            self._fail(f"its grammar refused token {token}: {self.matcher.get_error()}")

    def _fail(self, reason: str) -> None:
        log.warning("%s; the row is ended and its request fails", reason)
        self.failure = reason
