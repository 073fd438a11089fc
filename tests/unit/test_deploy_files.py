"""compose.yaml stays consistent with the code: services, settings names, health checks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

import celeryconfig
from stoker.adapters import metrics
from stoker.settings import StackSettings, WorkerSettings
from workers.launch import METRICS_PORTS, worker_kinds

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
    assert compose["x-stoker"]["environment"]["STOKER_CACHE_URL"].startswith("redis://stoker:${REDIS_PASSWORD:?")


def test_inference_worker_reserves_a_gpu_and_flower_requires_auth(compose: dict[str, Any]) -> None:
    infer = compose["services"]["infer-worker"]
    devices = infer["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert infer["command"] == ["stoker", "worker", "infer"]
    flower = compose["services"]["flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert not any("basic-auth" in arg for arg in flower["command"])  # never on a command line (`ps` shows it)


def test_no_default_secret_anywhere(compose: dict[str, Any]) -> None:
    for name in ("redis", "cache"):
        command = compose["services"][name]["command"]
        assert command[command.index("--user") : command.index("--user") + 3] == ["--user", "default", "off"]
        assert ">${REDIS_PASSWORD:?set REDIS_PASSWORD}" in command
    for var in ("STOKER_BROKER_URL", "STOKER_RESULT_URL", "STOKER_CACHE_URL"):
        assert "${REDIS_PASSWORD:?" in compose["x-stoker"]["environment"][var]
    grafana = compose["services"]["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    k8s = "\n".join(p.read_text() for p in (ROOT / "deploy" / "k8s").glob("*.yaml"))
    assert "change-me" not in k8s
    assert "stringData" not in k8s  # secrets are created by the operator, never shipped with values


def test_monitoring_is_an_optional_profile(compose: dict[str, Any]) -> None:
    for name in ("prometheus", "grafana"):
        assert compose["services"][name]["profiles"] == ["monitoring"]
    assert "profiles" not in compose["services"]["api"]


def test_prometheus_scrapes_every_worker_on_its_metrics_port() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["stoker-api"]["static_configs"][0]["targets"] == ["api:8000"]
    for kind, port in METRICS_PORTS.items():
        discovery = jobs[f"stoker-{kind}-worker"]["dns_sd_configs"][0]
        assert (discovery["names"], discovery["port"]) == ([f"{kind}-worker"], port)


def test_the_dashboard_only_charts_series_stoker_exports() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "stoker.json").read_text())
    exported = {"stoker_jobs_total"} | {
        name for metric in vars(metrics).values() if isinstance(metric, MetricWrapperBase) for name in _series(metric)
    }
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"stoker_[a-z_]+", target["expr"])
    }
    assert used
    assert used <= exported, used - exported
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("stage latency", "queue depths", "cache hit", "busy", "starved", "429"):
        assert topic in titles


def _series(metric: MetricWrapperBase) -> list[str]:
    base = metric._name
    kind = metric._type
    if kind == "histogram":
        return [f"{base}_bucket", f"{base}_sum", f"{base}_count"]
    if kind == "counter":
        return [f"{base}_total"]
    return [base]


def _k8s() -> list[dict[str, Any]]:
    return [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]


def test_kubernetes_workers_scale_on_the_queues_they_consume() -> None:
    docs = _k8s()
    kinds = worker_kinds(WorkerSettings())
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    env = deployments["stoker-cpu-worker"]["spec"]["template"]["spec"]["containers"][0]["env"]
    broker = urlsplit(next(e["value"] for e in env if e["name"] == "STOKER_BROKER_URL"))
    assert (broker.username, broker.password) == ("stoker", "$(REDIS_PASSWORD)")  # from the Secret, in each pod
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    workers = {
        name: c["command"][2]
        for name, d in deployments.items()
        for c in d["spec"]["template"]["spec"]["containers"]
        if c.get("command", [])[:2] == ["stoker", "worker"]
    }
    assert set(workers.values()) == set(kinds)  # a Deployment per worker kind
    assert set(scaled) == set(workers)  # each one scaled by KEDA
    declared = {q.name for q in celeryconfig.connection(WorkerSettings())["task_queues"]}
    for name, kind in workers.items():
        triggers = scaled[name]["spec"]["triggers"]
        lists = {t["metadata"]["listName"] for t in triggers}
        assert lists == set(kinds[kind].queues), name
        assert lists <= declared
        for trigger in triggers:
            assert trigger["type"] == "redis"
            assert trigger["metadata"]["address"] == f"{broker.hostname}:{broker.port}"
            assert trigger["metadata"]["databaseIndex"] == broker.path.strip("/")
            assert trigger["metadata"]["username"] == "stoker"
            assert trigger["authenticationRef"] == {"name": "stoker-redis"}  # the password, from the Secret


def test_kubernetes_settings_name_real_settings_and_the_gpu_goes_to_inference() -> None:
    known = {f"STOKER_{f.upper()}" for f in {*WorkerSettings.model_fields, *StackSettings.model_fields}}
    docs = _k8s()
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    names = set(config)
    gpus = {}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        for container in d["spec"]["template"]["spec"]["containers"]:
            names |= {e["name"] for e in container.get("env", [])}
            gpus[d["metadata"]["name"]] = "nvidia.com/gpu" in container.get("resources", {}).get("limits", {})
    assert {n for n in names if n.startswith("STOKER_")} <= known
    assert [name for name, gpu in gpus.items() if gpu] == ["stoker-infer-worker"]
