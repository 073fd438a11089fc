"""The model's tokenizer, and what identifies it: the workers' tokenize stage and the API's shortcut for cheap jobs
load it the same way, so a prompt tokenized by either is the same prompt (and the same cache entry)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoker.core.cachekeys import fingerprint


def load_tokenizer(model_path: str) -> Any:
    """The model's fast tokenizer."""
    from transformers import AutoTokenizer  # heavy (seconds): loaded on first use, only where prompts are built

    return AutoTokenizer.from_pretrained(model_path)


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
