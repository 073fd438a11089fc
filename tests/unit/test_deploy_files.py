"""compose.yaml stays consistent with the code: services, settings names, health checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from stoker.settings import StackSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The parsed compose file."""
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


def test_every_service_is_there_with_a_health_check(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "cache", "api", "cpu-worker", "asr-worker", "infer-worker", "reaper", "flower"} <= set(services)
    for name, service in services.items():
        assert "healthcheck" in service, name


def test_stoker_variables_name_real_settings(compose: dict[str, Any]) -> None:
    known = {f"STOKER_{f.upper()}" for f in {*WorkerSettings.model_fields, *StackSettings.model_fields}}
    for name, service in compose["services"].items():
        for var in service.get("environment", {}):
            if var.startswith("STOKER_"):
                assert var in known, f"{name}: {var}"


def test_broker_never_evicts_and_persists(compose: dict[str, Any]) -> None:
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert command[command.index("--appendonly") + 1] == "yes"


def test_cache_is_bounded_and_evicts_least_recently_used(compose: dict[str, Any]) -> None:
    command = compose["services"]["cache"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert "--maxmemory" in command
    assert compose["x-stoker"]["environment"]["STOKER_CACHE_URL"].startswith("redis://cache:")


def test_inference_worker_reserves_a_gpu_and_flower_requires_auth(compose: dict[str, Any]) -> None:
    infer = compose["services"]["infer-worker"]
    devices = infer["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert infer["command"] == ["stoker", "worker", "infer"]
    assert any(arg.startswith("--basic-auth=${FLOWER_BASIC_AUTH:?") for arg in compose["services"]["flower"]["command"])
