"""The model's tokenizer, and what identifies it: the workers' tokenize stage and the API's shortcut for cheap jobs
load it the same way, so a prompt tokenized by either is the same prompt (and the same cache entry)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stoker.core.cachekeys import fingerprint
from stoker.core.errors import StokerError


def load_tokenizer(model_path: str) -> Any:
    """The model's fast tokenizer."""
    from transformers import AutoTokenizer  # heavy (seconds): loaded on first use, only where prompts are built

    return AutoTokenizer.from_pretrained(model_path)


#: A template that renders one message's text and nothing else: `PromptTokenizer.encode_text` encodes through it.
_TEXT_ONLY = "{{ messages[0]['content'] }}"


class PromptTokenizer:
    """The model's tokenizer as prompt assembly uses it (`stoker.core.prompting.ChatTokenizer`): text in a message
    is encoded as text, whatever it spells; only the chat template's own markers are control tokens.

    Control tokens are every special token of the tokenizer (a vision model's `<image>` and the like included) and
    the added tokens its template writes; transformers' `sanitize_control_tokens` marks them where they occur in the
    messages' strings, renders the template and encodes what it marked as plain text.
    """

    def __init__(self, tokenizer: Any) -> None:
        # An older transformers would hand the unknown keyword to the template as a variable and encode every
        # control token the messages spell: refuse it rather than build such prompts.
        if "sanitize_control_tokens" not in inspect.signature(tokenizer.apply_chat_template).parameters:
            raise StokerError("this transformers cannot encode a message's control tokens as text: needs >= 5.24")
        self.tokenizer = tokenizer

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat in the model's template, the assistant's turn opened; the messages' text encoded as text."""
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, sanitize_control_tokens=True
        )
        return [int(i) for i in out]

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text to token ids as `render` encodes it in a message (its control tokens as plain text), so
        the budget is counted in the tokens the prompt will really have."""
        # Through the same sanitising path, not `split_special_tokens=True`: a fast tokenizer stores that flag on its
        # one Rust tokenizer for each call, so a call in another of the API's threads can switch it back between the
        # flag and the encode. (An added token that is special to neither and that only the model's template writes
        # counts as itself here and as plain text in `render`: a few tokens off at most.)
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


def tokenizer_identity(tokenizer: Any, model_path: str) -> str:
    """What identifies the tokenizer and its chat template, part of the tokenize cache fingerprint."""
    import transformers  # heavy: see load_tokenizer

    template = str(getattr(tokenizer, "chat_template", "") or "")
    files = file_identity(Path(model_path) / "tokenizer.json")
    parts = {"template": template, "vocab": len(tokenizer), "files": files, "hf": transformers.__version__}
    return fingerprint(path=model_path, **parts)


def file_identity(path: Path) -> str:
    """Size and modification time of a file (cheap, and changed by any reinstall); "" when it is not there."""
    try:
        stat = path.stat()
    except OSError:
        return ""
    return f"{stat.st_size}:{stat.st_mtime_ns}"
