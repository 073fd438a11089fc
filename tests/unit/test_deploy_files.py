"""The deployment files stay consistent with the code and with themselves: the Dockerfile's sources, compose.yaml
(services, settings names, health checks, what `docker compose config` checks), Prometheus, Grafana, Kubernetes."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from celery.backends.base import KeyValueStoreBackend
from kombu.pidbox import Mailbox
from kombu.transport.redis import Channel
from prometheus_client.metrics import MetricWrapperBase

import celeryconfig
from stoker.adapters import metrics
from stoker.adapters.store import keys
from stoker.core.queues import CALLBACK_QUEUE, QUEUES, SYNC_QUEUE
from stoker.settings import ApiSettings, StackSettings, WorkerSettings
from workers.launch import METRICS_PORTS, worker_kinds
from workers.stack import same_server

ROOT = Path(__file__).resolve().parents[2]
#: The API's settings as shipped (the suite's own environment changes some of them).
API_PORT, API_METRICS_PORT, METRICS_HOST = (
    ApiSettings.model_fields[name].default for name in ("port", "api_metrics_port", "metrics_host")
)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The parsed compose file."""
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


# -- the image: every COPY source is in the build context ---------------------------------------------------------
def _instructions(dockerfile: str) -> list[list[str]]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped, each split into words."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    )
    return [line.split() for line in joined.splitlines() if line.strip()]


def _copy_sources(dockerfile: str) -> list[str]:
    """The build-context paths the Dockerfile's COPY and ADD instructions read (not those from another stage)."""
    sources: list[str] = []
    for words in _instructions(dockerfile):
        if words[0].upper() not in ("COPY", "ADD"):
            continue
        args = words[1:]
        if any(a.startswith("--from=") for a in args):
            continue
        paths = json.loads(" ".join(args)) if args[0].startswith("[") else [a for a in args if not a.startswith("--")]
        sources += paths[:-1]  # the last one is the destination
    return sources


def _ignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore's patterns in order, each as (re-included, regex): Go's filepath.Match with `**`."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated, line = line.startswith("!"), line.removeprefix("!").strip().strip("/")
        regex = re.escape(line).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((negated, re.compile(regex)))
    return rules


def _ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the build context leaves `path` out: the last rule matching it, or a folder above it, decides."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negated, pattern in rules:
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def test_every_copy_source_of_the_dockerfile_is_in_the_build_context() -> None:
    sources = _copy_sources((ROOT / "Dockerfile").read_text())
    rules = _ignore_rules((ROOT / ".dockerignore").read_text())
    assert {"pyproject.toml", "stoker", "api", "tasks", "workers"} <= {s.strip("./") for s in sources}
    for source in sources:
        matches = list(ROOT.glob(source.removeprefix("./"))) if "*" in source else [ROOT / source]
        assert matches, f"COPY {source}: nothing matches"
        for match in matches:
            assert match.exists(), f"COPY {source}: no such file in the repository"
            assert not _ignored(str(match.relative_to(ROOT)), rules), f"COPY {source}: left out by .dockerignore"
    pyproject = (ROOT / "pyproject.toml").read_text()
    readme = re.search(r'^readme = "(.+)"', pyproject, re.MULTILINE)
    assert readme is not None
    assert readme.group(1) in sources  # `pip install .` reads it


def test_the_dockerignore_reading_follows_docker() -> None:
    rules = _ignore_rules("# comment\n.venv\n**/__pycache__\ntests\n!tests/keep.py\n*.log\n")
    assert _ignored(".venv/bin/python", rules)
    assert _ignored("stoker/core/__pycache__/x.pyc", rules)
    assert _ignored("__pycache__", rules)
    assert _ignored("tests/unit/test_x.py", rules)
    assert not _ignored("tests/keep.py", rules)
    assert _ignored("build.log", rules)
    assert not _ignored("stoker/build.log", rules)  # `*` does not cross a folder
    assert not _ignored("stoker/settings.py", rules)


# -- compose.yaml as `docker compose config` reads it --------------------------------------------------------------
#: `$$` (a literal `$`), `$VAR`, and `${VAR}` with an optional `:-default`, `-default`, `:?message` or `?message`;
#: any other `${` is an invalid template ("invalid interpolation format"). A `$` before anything else is literal.
INTERPOLATION = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?])[^}]*)?\}|\$(?P<bare>[A-Za-z_]\w*)|(?P<bad>\$\{)"
)


def _strings(node: Any) -> list[str]:
    """Every string in a parsed YAML document, keys included."""
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return [node] if isinstance(node, str) else []


def _interpolation_problems(compose: dict[str, Any]) -> list[str]:
    """What compose's interpolation would refuse or silently blank: an invalid `${…}`, or a variable with neither a
    default nor a requirement (unset, it becomes an empty string with only a warning)."""
    problems = []
    for text in _strings(compose):
        for match in INTERPOLATION.finditer(text):
            if match.group("bad"):
                problems.append(f"an invalid interpolation in {text!r} (a literal $ is written $$)")
            elif match.group("bare"):
                problems.append(f"${match.group('bare')} has no default and is not required (:?)")
            elif match.group("name") and match.group("op") is None:
                problems.append(f"${{{match.group('name')}}} has no default and is not required (:?)")
    return problems


def _reference_problems(compose: dict[str, Any], root: Path) -> list[str]:
    """What compose resolves between services and the disk: depends_on names, profiles, declared volumes and secrets,
    build contexts and bind-mounted files."""
    services, problems = compose["services"], []
    for name, service in services.items():
        depends = service.get("depends_on", [])
        for other in depends if isinstance(depends, list) else list(depends):
            if other not in services:
                problems.append(f"{name} depends on unknown service {other}")
            elif services[other].get("profiles") and not set(services[other]["profiles"]) & set(
                service.get("profiles", [])
            ):
                problems.append(
                    f"{name} depends on {other}, which only starts with profiles {services[other]['profiles']}"
                )
        problems += _resource_problems(name, service, compose, root)
    return problems


def _resource_problems(name: str, service: dict[str, Any], compose: dict[str, Any], root: Path) -> list[str]:
    """One service's secrets, volumes and build context against the top level and the disk."""
    problems = [
        f"{name}: undeclared secret {s}" for s in service.get("secrets", []) if s not in compose.get("secrets", {})
    ]
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith((".", "/")):
            if not (root / source).exists():
                problems.append(f"{name}: bind mount {source} does not exist")
        elif source not in (compose.get("volumes") or {}):
            problems.append(f"{name}: undeclared volume {source}")
    build = service.get("build")
    if build is not None:
        context = root / (build if isinstance(build, str) else build.get("context", "."))
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        if not (context / dockerfile).is_file():
            problems.append(f"{name}: no {dockerfile} in build context {context}")
    return problems


def test_compose_passes_what_docker_compose_config_checks(compose: dict[str, Any]) -> None:
    assert _interpolation_problems(compose) == []
    assert _reference_problems(compose, ROOT) == []
    required = {
        m.group("name") for t in _strings(compose) for m in INTERPOLATION.finditer(t) if m.group("op") in (":?", "?")
    }
    assert required == {"REDIS_PASSWORD", "FLOWER_BASIC_AUTH", "GRAFANA_ADMIN_PASSWORD"}


def test_the_compose_checks_catch_what_they_look_for(compose: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["api"]["depends_on"] = {"redis": {"condition": "service_healthy"}, "rediss": {}}
    broken["services"]["api"]["secrets"] = ["nope"]
    broken["services"]["reaper"]["depends_on"] = ["prometheus"]  # monitoring-only
    broken["services"]["prometheus"]["volumes"] = ["./deploy/missing.yml:/etc/x.yml:ro"]
    environment = {"A": "${UNSET}", "B": "${A:x}", "C": "$HOME", "D": "$$HOSTNAME", "E": "${OK:-1}", "F": "5$ each"}
    broken["services"]["api"]["environment"] = environment
    assert _reference_problems(broken, ROOT) == [
        "api depends on unknown service rediss",
        "api: undeclared secret nope",
        "reaper depends on prometheus, which only starts with profiles ['monitoring']",
        "prometheus: bind mount ./deploy/missing.yml does not exist",
    ]
    assert _interpolation_problems(broken) == [
        "${UNSET} has no default and is not required (:?)",
        "an invalid interpolation in '${A:x}' (a literal $ is written $$)",
        "$HOME has no default and is not required (:?)",
    ]


def _compose_cli() -> list[str] | None:
    """`docker compose` (v2: the plugin or a standalone binary), where one is installed."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        version = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True, timeout=30)
        if version.returncode == 0 and version.stdout.strip().lstrip("v").startswith("2"):
            return argv
    return None


def test_docker_compose_config_accepts_the_file_and_requires_its_secrets() -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no `docker compose` v2 here: the YAML-level checks above stand in for `docker compose config`")
    env = {**os.environ, "REDIS_PASSWORD": "x", "FLOWER_BASIC_AUTH": "a:b", "GRAFANA_ADMIN_PASSWORD": "y",
           "FLOWER_PASSWORD": "b"}  # fmt: skip
    argv = [*cli, "--project-directory", str(ROOT), "-f", str(ROOT / "compose.yaml")]
    for profiles in ([], ["--profile", "monitoring", "--profile", "ocr-pool"]):
        checked = subprocess.run([*argv, *profiles, "config", "--quiet"], env=env, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
    env.pop("REDIS_PASSWORD")
    refused = subprocess.run([*argv, "config", "--quiet"], env=env, capture_output=True, text=True)
    assert refused.returncode != 0
    assert "set REDIS_PASSWORD" in refused.stderr


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
    assert "--maxmemory" in command  # what the API refuses new jobs before (503 store_full)


def test_cache_is_bounded_and_evicts_least_recently_used(compose: dict[str, Any]) -> None:
    command = compose["services"]["cache"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert "--maxmemory" in command
    assert compose["x-stoker"]["environment"]["STOKER_CACHE_URL"].startswith("redis://stoker:${REDIS_PASSWORD:?")
    assert command[command.index("--save") + 1] == ""


def test_the_cache_is_a_server_apart_from_the_store_and_every_service_waits_for_it(compose: dict[str, Any]) -> None:
    """The cache's entries never count against the store's memory (`store_full`), nor does its eviction reach a
    job record."""
    env = {k: re.sub(r"\$\{[^}]*\}", "secret", v) for k, v in compose["x-stoker"]["environment"].items()}
    assert urlsplit(env["STOKER_CACHE_URL"]).hostname == "cache"
    assert urlsplit(env["STOKER_RESULT_URL"]).hostname == "redis"
    assert not same_server(env["STOKER_CACHE_URL"], env["STOKER_RESULT_URL"])
    assert compose["x-stoker"]["depends_on"]["cache"] == {"condition": "service_healthy"}
    assert compose["services"]["cache"]["healthcheck"]["test"][:2] == ["CMD", "redis-cli"]


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


# -- the Redis ACL user: what stoker and Celery use, nothing more ----------------------------------------------------
def _acl_rules(command: list[str]) -> list[str]:
    """The `stoker` user's rules on a redis-server command line: what follows its password."""
    start = command.index("stoker") + 2
    assert command[start].startswith(">")  # on, then the password
    return command[start + 1 :]


def compose_acl(server: str) -> list[str]:
    """The `stoker` user's rules on one of compose's Redis servers (`redis` or `cache`); the tests' servers use them."""
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return _acl_rules(data["services"][server]["command"])


def _k8s_redis(name: str) -> dict[str, Any]:
    """The Kubernetes workload running one of the Redis servers (`stoker-redis` or `stoker-cache`)."""
    return next(d for d in _k8s() if d["kind"] in ("StatefulSet", "Deployment") and d["metadata"]["name"] == name)


def _k8s_command(name: str) -> list[str]:
    """A Kubernetes Redis server's command line, as its shell would split it."""
    shell = _k8s_redis(name)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert shell[:2] == ["sh", "-c"]
    return shlex.split(shell[2])


def _k8s_acl(name: str) -> list[str]:
    return _acl_rules(_k8s_command(name))


#: A key of each kind stoker and Celery write on the broker and store Redis (kombu's and Celery's names from the
#: libraries themselves): stoker's own, each queue and its priority lists, kombu's bindings and unacked messages,
#: remote control (a worker's mailbox, a reply queue), an event receiver's queue, task and group results.
BROKER_KEYS = [
    keys.job_key("0" * 32),
    keys.ACTIVE_KEY,
    *(f"{q}{Channel.sep}{p}" for q in (*QUEUES, CALLBACK_QUEUE, SYNC_QUEUE) for p in ("", *Channel.priority_steps[1:])),
    *(Channel.keyprefix_queue % name for name in ("decode", "reply.celery.pidbox", "celery.pidbox", "celeryev")),
    Channel.unacked_key,
    Channel.unacked_index_key,
    Channel.unacked_mutex_key,
    f"cpu@host.{Mailbox.exchange_fmt % 'celery'}",
    f"6e1c2f3a-0d5e-4a8b-9c7d-1e2f3a4b5c6d.{Mailbox.reply_exchange_fmt % 'celery'}",
    "celeryev.6e1c2f3a-0d5e-4a8b-9c7d-1e2f3a4b5c6d",
    f"{KeyValueStoreBackend.task_keyprefix}6e1c2f3a-0d5e-4a8b-9c7d-1e2f3a4b5c6d",
    f"{KeyValueStoreBackend.group_keyprefix}6e1c2f3a-0d5e-4a8b-9c7d-1e2f3a4b5c6d.j",
]
FANOUT = Channel.keyprefix_fanout.format(db=0)  # Celery's broadcast channels, on the broker's database 0
#: Channels published to or subscribed by name, and patterns subscribed to (an ACL lets a pattern through only when
#: it names that very pattern).
BROKER_CHANNELS = [
    keys.done_channel("0" * 32),
    keys.CANCELLED_CHANNEL,
    f"{KeyValueStoreBackend.task_keyprefix}6e1c2f3a",
    f"{FANOUT}{Mailbox.exchange_fmt % 'celery'}",
    f"{FANOUT}celeryev/worker.heartbeat",
]
BROKER_PATTERNS = [*keys.ANNOUNCEMENT_PATTERNS, f"{FANOUT}celeryev/*", f"{FANOUT}celeryev/worker.*"]


def _allowed(rules: list[str], sigil: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, rule[1:]) for rule in rules if rule.startswith(sigil))


def test_the_redis_user_reaches_only_what_stoker_and_celery_use() -> None:
    broker, cache = compose_acl("redis"), compose_acl("cache")
    for rules in (broker, cache):
        assert rules[0] == "resetkeys"  # nothing but the patterns that follow
        assert "resetchannels" in rules
        assert not {"~*", "&*", "allkeys", "allchannels", "allcommands", "nopass", "+@admin", "+@dangerous"} & set(
            rules
        )
        commands = [r for r in rules if r[0] in "+-"]
        assert commands.index("-@admin") > commands.index("+@all") < commands.index("-@dangerous")
        assert commands.index("-@scripting") < commands.index("+evalsha")  # no EVAL, no FUNCTION
    # What comes back after the dangerous commands went, each for a reason: INFO on the store, for the API's view of
    # its memory (the cache's user needs none); of scripting, what redis-py's scripts use.
    scripts = ["-@scripting", "+evalsha", "+script|load", "+script|exists"]
    assert broker[broker.index("-@dangerous") + 1 :] == ["+info", *scripts]
    assert cache[cache.index("-@dangerous") + 1 :] == scripts
    for key in BROKER_KEYS:
        assert _allowed(broker, "~", key), key
    for key in ("foo", "stokerx", "_kombu", "celery"):
        assert not _allowed(broker, "~", key), key
    for channel in BROKER_CHANNELS:
        assert _allowed(broker, "&", channel), channel
    assert set(BROKER_PATTERNS) <= {r[1:] for r in broker if r.startswith("&")}
    # The cache holds stage results only: stoker's keys, no channel.
    assert [r for r in cache if r[0] in "~&"] == ["~stoker:*"]
    assert _allowed(cache, "~", keys.CACHE_STATS_KEY)


def test_kubernetes_redis_servers_have_the_same_user_as_compose() -> None:
    assert _k8s_acl("stoker-redis") == compose_acl("redis")
    assert _k8s_acl("stoker-cache") == compose_acl("cache")


def test_kubernetes_runs_the_cache_on_a_server_apart_that_evicts_and_the_store_never_does() -> None:
    store, cache = _k8s_command("stoker-redis"), _k8s_command("stoker-cache")
    assert store[store.index("--maxmemory-policy") + 1] == "noeviction"
    assert store[store.index("--appendonly") + 1] == "yes"
    assert "--maxmemory" in store
    assert cache[cache.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert "--maxmemory" in cache
    assert cache[cache.index("--save") + 1] == ""
    assert "--appendonly" not in cache
    docs = _k8s()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for name in ("stoker-redis", "stoker-cache"):
        assert services[name]["spec"]["selector"] == {"app.kubernetes.io/name": name}
        assert "readinessProbe" in _k8s_redis(name)["spec"]["template"]["spec"]["containers"][0]
    pods = [
        {e["name"]: e.get("value") for e in c.get("env", [])}
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        if any(e["name"] == "STOKER_RESULT_URL" for e in c.get("env", []))
    ]
    assert len(pods) >= 6  # the API, every worker kind, the reaper, the batch feeder, Flower
    for env in pods:
        assert urlsplit(env["STOKER_CACHE_URL"]).hostname == "stoker-cache"
        assert urlsplit(env["STOKER_RESULT_URL"]).hostname == "stoker-redis"
        assert not same_server(env["STOKER_CACHE_URL"], env["STOKER_RESULT_URL"])


def test_monitoring_is_an_optional_profile(compose: dict[str, Any]) -> None:
    for name in ("prometheus", "grafana"):
        assert compose["services"][name]["profiles"] == ["monitoring"]
    assert "profiles" not in compose["services"]["api"]


def test_prometheus_scrapes_every_worker_on_its_metrics_port() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    api = jobs["stoker-api"]["dns_sd_configs"][0]
    assert (api["names"], api["port"]) == (["api"], API_METRICS_PORT)  # its metrics listener
    for kind, port in METRICS_PORTS.items():
        discovery = jobs[f"stoker-{kind}-worker"]["dns_sd_configs"][0]
        assert (discovery["names"], discovery["port"]) == ([f"{kind}-worker"], port)


def _published(port: str) -> tuple[str, str, str]:
    """A compose `ports` entry as (host address, host port, container port); no address means every interface."""
    parts = port.split(":")
    return ("0.0.0.0", *parts) if len(parts) == 2 else (parts[0], parts[1], parts[2])  # type: ignore[return-value]


def test_only_the_api_port_is_published_beyond_loopback(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        published = [_published(p) for p in service.get("ports", [])]
        if name == "api":
            assert published == [("0.0.0.0", "8000", "8000")]  # the API's port, and not its metrics listener
        else:
            assert all(host == "127.0.0.1" for host, _, _ in published), (name, published)
    assert {"flower", "prometheus", "grafana"} <= {n for n, s in compose["services"].items() if s.get("ports")}
    assert "ports" not in compose["services"]["redis"]
    assert "ports" not in compose["services"]["cache"]
    # Inside the compose network the metrics listeners answer the scraper: bound to the container's interfaces.
    assert compose["x-stoker"]["environment"]["STOKER_METRICS_HOST"] == "0.0.0.0"
    assert METRICS_HOST == "127.0.0.1"  # anywhere else, loopback unless a deployment says otherwise


def test_kubernetes_routes_clients_to_the_api_port_and_only_the_scraper_to_metrics() -> None:
    docs = _k8s()
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    assert config["STOKER_METRICS_HOST"] == "0.0.0.0"  # the pod's address, for the scraper
    api = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "stoker-api")
    ports = {p["name"]: p["containerPort"] for p in api["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"http": API_PORT, "metrics": API_METRICS_PORT}
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "stoker-api")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [API_PORT]


def test_the_dashboard_only_charts_series_stoker_exports() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "stoker.json").read_text())
    collected = {"stoker_jobs_total", "stoker_batch_lines_total", "stoker_batch_lines_queued"}  # read from the store
    exported = collected | {
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


# -- deploy/k8s against the Kubernetes API's own schemas (`make lint` runs the same check) ------------------------
#: Custom resources: their CRDs' schemas do not ship with kubernetes-validate (KEDA's are checked above).
CUSTOM_API_GROUPS = ("keda.sh/",)


def _schema_problems(document: dict[str, Any]) -> list[str]:
    """What the Kubernetes schema of a document's kind refuses, strictly (no property the API does not know)."""
    try:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as error:
        where = ".".join(str(part) for part in error.path)
        return [f"{document['kind']}/{document['metadata']['name']}: {where}: {error.message}"]
    return []


def test_every_kubernetes_manifest_passes_the_kubernetes_schemas() -> None:
    checked = [d for d in _k8s() if not d["apiVersion"].startswith(CUSTOM_API_GROUPS)]
    assert {d["kind"] for d in checked} >= {"ConfigMap", "Deployment", "Service", "StatefulSet", "NetworkPolicy"}
    # A kind without a schema (a misspelt kind or apiVersion) raises SchemaNotFoundError: it fails the test too.
    assert [problem for document in checked for problem in _schema_problems(document)] == []


@pytest.mark.parametrize(
    ("path", "value", "refused"),
    [
        (("spec", "replicas"), "two", "is not of type 'integer'"),
        (("spec", "template", "spec", "containers", 0, "imagePullPolice"), "Always", "imagePullPolice"),
    ],
)
def test_the_schema_check_refuses_a_broken_deployment(path: tuple[str | int, ...], value: str, refused: str) -> None:
    api = next(d for d in _k8s() if d["kind"] == "Deployment" and d["metadata"]["name"] == "stoker-api")
    node: Any = api
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    problems = _schema_problems(api)
    assert len(problems) == 1
    assert refused in problems[0]


def _seconds(duration: str) -> float:
    """A Compose duration ("40s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))


def test_the_api_is_given_more_time_to_stop_than_its_waits_take(compose: dict[str, Any]) -> None:
    """Whatever stops an API process waits longer than the grace its waits get (`STOKER_STOP_GRACE_S`), or it
    kills the process under answers still to be sent."""
    grace = ApiSettings.model_fields["stop_grace_s"].default
    assert _seconds(compose["services"]["api"]["stop_grace_period"]) > grace
    api = next(d for d in _k8s() if d["kind"] == "Deployment" and d["metadata"]["name"] == "stoker-api")
    pod = api["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"  # serving on while the pod leaves the Service's endpoints
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + grace
