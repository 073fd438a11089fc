"""celeryconfig.py computed afresh from chosen settings, for tests of what a process would configure."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest

from tests.procs import ROOT


def fresh_celeryconfig(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> ModuleType:
    """celeryconfig.py as a new module read with this environment (the one Celery loaded is left alone)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("celeryconfig_under_test", ROOT / "celeryconfig.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
