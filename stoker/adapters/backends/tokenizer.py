"""The model's tokenizer, and what identifies it: the workers' tokenize stage and the API's shortcut for cheap jobs
load it the same way, so a prompt tokenized by either is the same prompt (and the same cache entry)."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from stoker.adapters.backends.vision import declares_processor, processor_identity
from stoker.core.cachekeys import fingerprint
from stoker.core.errors import StokerError
from stoker.core.tools import ToolSpec, fold_tools

log = logging.getLogger(__name__)

#: The class transformers 5 saves for a tokenizer that is its `tokenizer.json` and nothing else (both built-in
#: models declare it).
_GENERIC_BACKEND = "TokenizersBackend"


def load_tokenizer(model_path: str) -> Any:
    """The model's fast tokenizer. Every process of the stack loads it here (the local model's included), so they
    all build and read the same ids.

    A local model whose `tokenizer_config.json` declares transformers' generic backend, with no code of its own
    (`auto_map`), is loaded by that class directly. `AutoTokenizer` chooses the same class for it, but on the way
    reads the model's config through modules that import torch: about 190 MB of private memory and 2-3 s of start-up
    in each process that only tokenizes (the API, the CPU workers, the reaper, the batch feeder;
    docs/bench/log/2026-12-05-soak-process-memory-and-torch.md).
    Any other model goes through `AutoTokenizer`. (`AutoTokenizer` overrides a declared class only for the few model
    types whose hub configs it knows to be wrong, its `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`; `save_pretrained`
    writes the class a tokenizer was loaded as.)
    """
    if _declares_generic_backend(Path(model_path)):
        # heavy (about a second): loaded on first use, only where prompts are built or read
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_path)
    from transformers import AutoTokenizer  # heavier still: torch comes with it

    return AutoTokenizer.from_pretrained(model_path)


def _declares_generic_backend(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):  # a hub id, or no config to read: AutoTokenizer decides
        return False
    declared = config.get("tokenizer_class") == _GENERIC_BACKEND and "auto_map" not in config
    return declared and (model_dir / "tokenizer.json").is_file()


#: A template that renders one message's text and nothing else: `PromptTokenizer.encode_text` encodes through it.
_TEXT_ONLY = "{{ messages[0]['content'] }}"


class ImageTokens:
    """How a vision-language model's prompt spells a picture: the image token its chat template writes for each
    image part, and what its processor expands that token into for one picture's layout (tile rows and cols, a
    patch grid), read from the model's own processor (`replace_image_token`), never written out here."""

    def __init__(self, processor: Any, tokenizer: Any) -> None:
        self.processor = processor
        self.tokenizer = tokenizer
        self.template = str(processor.chat_template)
        self.token_id = int(tokenizer.convert_tokens_to_ids(processor.image_token))
        self.identity = processor_identity(processor)
        self._expand = lru_cache(maxsize=256)(self._expansion)

    @classmethod
    def load(cls, model_path: str, tokenizer: Any) -> ImageTokens | None:
        """The model's processor, when it has an image processor, an image token and a chat template; else None."""
        if not declares_processor(model_path):
            return None
        from transformers import AutoProcessor  # heavy (torch): see load_tokenizer

        try:
            processor = AutoProcessor.from_pretrained(model_path)
        except (OSError, ValueError):  # no processor files: a text-only model
            return None
        if not all(getattr(processor, name, None) for name in ("image_processor", "image_token", "chat_template")):
            return None
        return cls(processor, tokenizer)

    def expansion(self, layout: dict[str, Any]) -> list[int]:
        """The token ids the processor puts in place of one image token, for a picture of this layout."""
        return self._expand(json.dumps(layout, sort_keys=True))

    def _expansion(self, layout_json: str) -> list[int]:
        # The layout as the image processor returned it for one picture (`rows`: [[r]], `image_grid_thw`: [[t, h,
        # w]]): arrays, as the processor indexes them.
        inputs = {name: np.asarray(value) for name, value in json.loads(layout_json).items()}
        text = self.processor.replace_image_token(inputs, image_idx=0)
        # The expansion is tokenized alone: it begins and ends with special tokens, which the tokenizer never
        # merges with the text around them, so these are the ids it has inside the whole prompt.
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def expand(self, ids: list[int], layouts: list[dict[str, Any]]) -> list[int]:
        """Rendered ids with each image token the template wrote replaced by its picture's expansion, in order."""
        return self.expand_with_ranges(ids, layouts)[0]

    def expand_with_ranges(
        self, ids: list[int], layouts: list[dict[str, Any]]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`expand`, and where each picture's expansion lies in the expanded ids (offset, length), in order."""
        positions = [i for i, token in enumerate(ids) if token == self.token_id]
        if len(positions) != len(layouts):
            raise StokerError(f"the chat template wrote {len(positions)} image tokens for {len(layouts)} pictures")
        out: list[int] = []
        ranges: list[tuple[int, int]] = []
        start = 0
        for at, layout in zip(positions, layouts, strict=True):
            out += ids[start:at]
            expansion = self.expansion(layout)
            ranges.append((len(out), len(expansion)))
            out += expansion
            start = at + 1
        return out + ids[start:], ranges


class PromptTokenizer:
    """The model's tokenizer as prompt assembly uses it (`stoker.core.prompting.ChatTokenizer`): text in a message
    is encoded as text, whatever it spells; only the chat template's own markers are control tokens.

    Control tokens are every special token of the tokenizer (a vision model's `<image>` and the like included) and
    the added tokens its template writes; transformers' `sanitize_control_tokens` marks them where they occur in the
    messages' strings, renders the template and encodes what it marked as plain text.

    For a model that sees (`images`), every message is rendered as content parts with the processor's chat
    template: one image part per picture, then the text. The image tokens in the rendered ids are then exactly
    those the template wrote for the image parts (user text cannot spell one), and each is expanded at the id level
    as the processor expands it: the ids equal the processor's own for the same chat, and the text stays sanitised.
    """

    def __init__(self, tokenizer: Any, images: ImageTokens | None = None) -> None:
        # An older transformers would hand the unknown keyword to the template as a variable and encode every
        # control token the messages spell: refuse it rather than build such prompts.
        if "sanitize_control_tokens" not in inspect.signature(tokenizer.apply_chat_template).parameters:
            raise StokerError("this transformers cannot encode a message's control tokens as text: needs >= 5.24")
        self.tokenizer = tokenizer
        self.images = images
        self._whole = _PlainEncoder.of(tokenizer)

    def identity(self, model_path: str) -> str:
        """What identifies this tokenizer, its template and (for a model that sees) its processor."""
        return tokenizer_identity(self.tokenizer, model_path, self.images.identity if self.images else "")

    def render(self, messages: list[dict[str, Any]], tools: Sequence[ToolSpec] = ()) -> list[int]:
        """The chat in the model's template, the assistant's turn opened; the messages' text encoded as text, each
        message's pictures (`images`: their layouts) as image parts before it, expanded as the processor does.
        With `tools`, or turns that call them: a template that renders tools gets them as they are; any other
        reads them in the Hermes convention, in its plain turns (`stoker.core.tools.fold_tools`)."""
        template = self.images.template if self.images else str(self.tokenizer.chat_template or "")
        native = "tools" in template
        calling = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if calling and not native:
            messages = fold_tools(messages, tools)
        offered = [t.model_dump(exclude_none=True) for t in tools]
        options: dict[str, Any] = {"tools": offered} if native and tools else {}
        if self.images is None:
            if any(m.get("images") for m in messages):
                raise StokerError("pictures for a model that reads no images", stage="tokenize")
            return self._apply([_plain(m) for m in messages], **options)
        parts = [
            {
                **_plain(m),
                "content": [{"type": "image"} for _ in m.get("images", [])] + [{"type": "text", "text": m["content"]}],
            }
            for m in messages
        ]
        ids = self._apply(parts, chat_template=self.images.template, **options)
        return self.images.expand(ids, [layout for m in messages for layout in m.get("images", [])])

    def render_template(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Messages as they are (content parts for a model that sees: `{"type": "image"}`, `{"type": "text"}`) in the
        model's template (the processor's for a model that sees), with the template's own options, as a renderer
        that hands them on unchanged does (vLLM's: `stoker.adapters.render`); their text is still only text. The
        image tokens are left for the caller to expand (`ImageTokens.expand_with_ranges`)."""
        template: dict[str, Any] = {"chat_template": self.images.template} if self.images else {}
        if tools:
            template["tools"] = list(tools)
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        return self._apply(messages, **template, **options)

    def _apply(self, messages: list[dict[str, Any]], **template: Any) -> list[int]:
        template.setdefault("add_generation_prompt", True)
        if self._whole is not None and not self._whole.spelled_in(messages, template.get("tools")):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **template)
            return self._whole.encode(str(text))
        out = self.tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
            **template,
        )
        return [int(i) for i in out]

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text to token ids as `render` encodes it in a message (its control tokens as plain text), so
        the budget is counted in the tokens the prompt will really have."""
        # Through the same sanitising path, not `split_special_tokens=True`: a fast tokenizer stores that flag on its
        # one Rust tokenizer for each call, so a call in another of the API's threads can switch it back between the
        # flag and the encode. (An added token that is special to neither and that only the model's template writes
        # counts as itself here and as plain text in `render`: a few tokens off at most.)
        if self._whole is not None and not self._whole.spelled_in(text):
            return self._whole.encode(text)
        out = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            chat_template=_TEXT_ONLY,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
        )
        return [int(i) for i in out]

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """Token ids of plain text back to text."""
        return str(self.tokenizer.decode(list(token_ids)))


class _PlainEncoder:
    """The fast path of `PromptTokenizer`: a chat whose strings spell no added token is rendered and encoded whole.

    transformers' sanitising (`sanitize_control_tokens`) marks every control token in the messages' strings, renders
    the template and encodes the rendered chat piece by piece around the marks. Where no string spells an added token
    (every control token is one) nor one of its private marks, it marks nothing and encodes the rendered chat in one
    piece (`encode_marked_chat` with one piece), so rendering to text and encoding that text gives the same ids. That
    is most prompts, and it costs about half of the sanitising path (its Python around two encodes and a walk of
    the messages). A string that spells one takes the sanitising path.

    The encoder is a copy of the tokenizer's Rust tokenizer, never switched: transformers stores
    `split_special_tokens` on its own for each call, so another thread's call could change how this one reads the
    template's markers between the switch and the encode."""

    def __init__(self, backend: Any, spelled: re.Pattern[str]) -> None:
        self.backend = backend
        self.spelled = spelled

    @classmethod
    def of(cls, tokenizer: Any) -> _PlainEncoder | None:
        """The fast path for a fast tokenizer (one with a Rust backend and added tokens to look for); else None."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        added = getattr(tokenizer, "added_tokens_encoder", None)
        if backend is None or not isinstance(added, dict):
            return None
        from tokenizers import Tokenizer  # transformers' own dependency, loaded with it
        from transformers.utils import chat_template_utils as chat

        # The sanitising path also drops its private marks (two private-use characters) from the strings.
        marks = [getattr(chat, name, None) for name in ("_CONTROL_TOKEN_START", "_CONTROL_TOKEN_END")]
        if not all(isinstance(mark, str) for mark in marks):
            return None  # a transformers that marks them otherwise: every chat takes the sanitising path
        words = sorted({*map(str, added), *map(str, marks)}, key=len, reverse=True)
        try:
            copy = Tokenizer.from_str(backend.to_str())
        except Exception:  # a backend that cannot be written out: every chat takes the sanitising path
            log.warning("the tokenizer cannot be copied: every prompt is encoded piece by piece", exc_info=True)
            return None
        return cls(copy, re.compile("|".join(map(re.escape, words))))

    def spelled_in(self, *values: Any) -> bool:
        """Whether any string in these values (messages, tools; keys included) spells an added token or a mark."""
        return any(self._spelled(value) for value in values)

    def _spelled(self, value: Any) -> bool:
        if isinstance(value, str):
            return self.spelled.search(value) is not None
        if isinstance(value, dict):
            return any(self._spelled(k) or self._spelled(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return any(self._spelled(v) for v in value)
        return False

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a chat template takes it: role and text, and a call's arguments as an object (as templates
    that render calls expect them, not OpenAI's JSON text)."""
    out: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [_parsed_arguments(c) for c in message["tool_calls"]]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    with contextlib.suppress(TypeError, ValueError):  # not JSON: the template gets the text as it was sent
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    return {**call, "function": function}


def load_prompt_tokenizer(model_path: str, tokenizer: Any | None = None) -> PromptTokenizer:
    """The model's tokenizer (loaded when not given) as prompt assembly uses it, with its processor's image tokens
    for a model that sees."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
    return PromptTokenizer(tokenizer, ImageTokens.load(model_path, tokenizer))


def tokenizer_identity(tokenizer: Any, model_path: str, processor: str = "") -> str:
    """What identifies the tokenizer and its chat template (and the processor that expands a picture's
    placeholder, for a model that sees), part of the tokenize cache fingerprint."""
    import transformers  # heavy: see load_tokenizer

    template = str(getattr(tokenizer, "chat_template", "") or "")
    files = file_identity(Path(model_path) / "tokenizer.json")
    parts = {"template": template, "vocab": len(tokenizer), "files": files, "hf": transformers.__version__}
    if processor:
        parts["processor"] = processor
    return fingerprint(path=model_path, **parts)


def file_identity(path: Path) -> str:
    """Size and modification time of a file (cheap, and changed by any reinstall); "" when it is not there."""
    try:
        stat = path.stat()
    except OSError:
        return ""
    return f"{stat.st_size}:{stat.st_mtime_ns}"
