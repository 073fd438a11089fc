"""docs/configuration.md is what the settings render, and every setting says what it does."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.cli import main
from stoker.docs import SETTINGS_CLASSES, configuration_page, env_var
from stoker.settings import ApiSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


def test_the_configuration_page_is_the_one_the_settings_render() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == configuration_page(), "docs/configuration.md is stale: run `make docs`"


def test_stoker_docs_config_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs", "config"]) == 0
    assert capsys.readouterr().out == configuration_page()


def test_every_setting_has_a_description_and_a_row_of_its_own() -> None:
    page = configuration_page()
    for cls in SETTINGS_CLASSES:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no Field(description=...)"
        assert f"\n## {cls.__name__}\n" in page
    assert "| `PROMETHEUS_MULTIPROC_DIR` |" in page  # a field's own alias is its variable
    field = WorkerSettings.model_fields["prometheus_multiproc_dir"]
    assert env_var(WorkerSettings, "prometheus_multiproc_dir", field) == "PROMETHEUS_MULTIPROC_DIR"


def test_a_default_a_class_replaces_is_shown_beside_the_inherited_one() -> None:
    rows = [line for line in configuration_page().splitlines() if line.startswith("| `STOKER_STORE_TIMEOUT_S` |")]
    assert ApiSettings.model_fields["store_timeout_s"].default == 3.0
    assert len(rows) == 2  # CommonSettings' own and the API's
    assert "| `3.0` (CommonSettings: `10.0`) |" in rows[1]
    assert "| `float` (> 0) |" in rows[0]
    assert "| `~/.cache/stoker` |" in configuration_page()  # not the home folder of whoever rendered it
