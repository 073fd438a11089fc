"""The settings package stays a part per concern: small modules and classes, every part read as the process classes
read it."""

from __future__ import annotations

import inspect
import pkgutil
from importlib import import_module
from pathlib import Path

import pytest

import stoker.settings
from stoker.settings import ApiSettings, WorkerSettings
from stoker.settings.base import SettingsPart
from stoker.settings.stages import OcrSettings

MODULES = [import_module(f"stoker.settings.{info.name}") for info in pkgutil.iter_modules(stoker.settings.__path__)]
#: Every settings class the package defines, the parts and the process classes they compose.
CLASSES = [
    cls
    for module in MODULES
    for cls in vars(module).values()
    if inspect.isclass(cls) and cls.__module__ == module.__name__ and hasattr(cls, "model_fields")
]


def test_no_settings_module_is_over_300_lines_and_no_class_declares_over_30_fields() -> None:
    assert len(MODULES) >= 10  # a module per concern, not one for everything
    for module in MODULES:
        assert module.__file__ is not None
        lines = len(Path(module.__file__).read_text().splitlines())
        assert lines <= 300, f"{module.__name__} has {lines} lines"
    for cls in CLASSES:
        declared = [name for name in inspect.get_annotations(cls) if name in cls.model_fields]
        assert len(declared) <= 30, f"{cls.__name__} declares {len(declared)} fields"


def test_every_part_reads_the_environment_as_the_process_classes_do(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [cls for cls in CLASSES if issubclass(cls, SettingsPart)]
    assert {cls.model_config.get("env_prefix") for cls in parts} == {"STOKER_"}
    assert {cls.model_config.get("extra") for cls in parts} == {"ignore"}
    monkeypatch.setenv("STOKER_OCR_LANGS", "eng+deu")
    assert OcrSettings().ocr_langs == WorkerSettings().ocr_langs == "eng+deu"  # a part alone, and composed
    assert issubclass(WorkerSettings, OcrSettings)
    assert not issubclass(ApiSettings, OcrSettings)  # the API reads no stage's settings
