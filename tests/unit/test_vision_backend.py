"""Which models the local backend serves as vision-language models, read from their config alone."""

from __future__ import annotations

from pathlib import Path

from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.vlm import is_vision_language
from stoker.settings import BUILTIN_MODEL, CommonSettings


def test_a_model_with_a_vision_config_is_a_vision_language_model(tiny_vlm: Path) -> None:
    assert is_vision_language(str(tiny_vlm))
    text_model = resolve_model(BUILTIN_MODEL, CommonSettings().model_cache, fetch=False)
    assert not is_vision_language(text_model)
