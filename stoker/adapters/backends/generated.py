"""vLLM's `/inference/v1/generate` answers read back as chat completions, so the `openai` backend reads both
protocols one way (mirrored from vLLM 0.33.0's `vllm/entrypoints/scale_out/token_in_token_out/protocol.py`).

A whole answer (`GenerateResponse`) carries per choice its `token_ids`, and with `output_mode: derender` the parsed
assistant `message` (content, tool calls parsed by the server's parser, logprobs as chat completions write them), with
`text` the detokenized `text`. A streamed answer (`output_mode: tokens`; vLLM's derender does not stream) is
Server-Sent Events of chunks whose choices carry the new `token_ids`, which stoker detokenizes itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stoker.core.model import Prediction, apply_stop
from stoker.core.streaming import TextStream

#: Token ids to text (the served model's tokenizer, special tokens left out).
Detokenize = Callable[[Sequence[int]], str]


def chat_completion(data: dict[str, Any], detokenize: Detokenize) -> dict[str, Any]:
    """A whole generate answer in chat completions' shape: each choice's message (parsed by the server, else its text,
    else its tokens detokenized here), finish reason and logprobs; the usage."""
    choices = [_chat_choice(c, detokenize) for c in data.get("choices") or []]
    return {"choices": choices, "usage": data.get("usage") or {}}


def _chat_choice(choice: dict[str, Any], detokenize: Detokenize) -> dict[str, Any]:
    message = choice.get("message")
    if message is None:
        text = choice.get("text")
        message = {"role": "assistant", "content": text if text is not None else detokenize(choice["token_ids"])}
    logprobs = choice.get("logprobs")
    if logprobs and any("token_id" in entry for entry in logprobs.get("content") or []):
        logprobs = {"content": [_logprob(entry, detokenize, True) for entry in logprobs["content"]]}
    return {
        "index": choice.get("index", 0),
        "message": message,
        "finish_reason": choice.get("finish_reason"),
        "logprobs": logprobs,
    }


def _logprob(entry: dict[str, Any], detokenize: Detokenize, top: bool) -> dict[str, Any]:
    """One token's logprob with its token id made its text, as chat completions write it."""
    token = detokenize([int(entry["token_id"])])
    out = {"token": token, "logprob": float(entry["logprob"]), "bytes": list(token.encode())}
    if top:
        out["top_logprobs"] = [_logprob(t, detokenize, False) for t in entry.get("top_logprobs") or []]
    return out


class StreamedTokens:
    """A streamed generate answer put back together: its tokens detokenized here as they come, each piece one that
    never has to be taken back (`TextStream`: stop sequences, unfinished characters), its finish reason and usage."""

    def __init__(self, detokenize: Detokenize, stop: Sequence[str] = ()) -> None:
        self.detokenize = detokenize
        self.stop = list(stop)
        self.stream = TextStream(self.stop)
        self.token_ids: list[int] = []
        self.finish_reason = "stop"
        self.usage: dict[str, Any] = {}

    def add(self, chunk: dict[str, Any]) -> str:
        """Take one chunk (its first choice: a stream is asked for with `n` 1); its piece of text ('' for none)."""
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            self.token_ids += [int(t) for t in choice.get("token_ids") or []]
            return self.stream.advance(self.detokenize(self.token_ids))
        return ""

    def rest(self) -> str:
        """What is left to send once the stream ended."""
        return self.stream.finish(self.text())

    def text(self) -> str:
        """The whole answer: up to a stop sequence, its whitespace kept."""
        return apply_stop(self.detokenize(self.token_ids), self.stop)[0]

    def prediction(self) -> Prediction:
        """The whole answer as a prediction."""
        return Prediction(
            text=self.text(),
            prompt_tokens=int(self.usage.get("prompt_tokens", 0)),
            completion_tokens=int(self.usage.get("completion_tokens", len(self.token_ids))),
            finish_reason="length" if self.finish_reason == "length" else "stop",
        )
