"""`stoker up`: API, CPU worker, inference worker and Flower on this machine, with a broker if none answers."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from rich.console import Console

from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.store.clients import redis_answers
from stoker.settings import StackSettings, WorkerSettings
from tasks.app import make_app
from workers.broker import start_embedded
from workers.launch import worker_argv, worker_env
from workers.procs import dies_with_parent, terminate

console = Console()
#: The embedded servers' names among the stack's children: the broker and job store (noeviction), and the stage
#: cache (allkeys-lru). They stop last.
BROKER = "valkey"
CACHE = "valkey-cache"
EMBEDDED = (BROKER, CACHE)
#: Flower's user when `stoker up --auth` makes its credentials (STOKER_FLOWER_BASIC_AUTH unset).
FLOWER_USER = "admin"


#: Children that are replaced when they exit (a worker that gave up on a wedged device exits to be replaced).
RESTARTABLE = ("cpu-worker", "infer-worker", "reaper", "batch-feeder")
#: More restarts than this within RESTART_WINDOW_S means something is broken for good: stop the stack.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
#: How long the stack's services get, once told to stop, before they are killed.
STOP_GRACE_S = 15.0
#: The API's waits end this much before it would be killed: a wait sees the stop at once (a stream within a second,
#: its poll), and then writes its answer or its last event.
API_STOP_MARGIN_S = 5.0


@dataclass
class Stack:
    """The processes stoker up started, stopped together."""

    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)
    restarts: list[float] = field(default_factory=list)
    #: Every child gets SIGTERM when the supervisor dies, even by SIGKILL: nothing it started outlives it.
    tether: Callable[[], None] = field(default_factory=dies_with_parent)
    #: Directories of the stack's own (the embedded broker's, the workers' metric files), removed once everything
    #: has stopped.
    scratch: list[Path] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        """Start a child in its own session, so a terminal's Ctrl-C reaches only the supervisor, which stops it."""
        self.commands[name] = (argv, env)
        # preexec_fn is unsafe only in a process with threads; the supervisor runs in one thread.
        self.procs[name] = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=self.tether)

    def dead(self) -> list[str]:
        """Names of children that exited."""
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def restart(self, name: str, now: float) -> bool:
        """Start a dead child again, unless it is not restartable or restarts come too fast."""
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if name not in RESTARTABLE or len(self.restarts) >= MAX_RESTARTS:
            return False
        self.restarts.append(now)
        self.start(name, *self.commands[name])
        return True

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the services first and the embedded servers last, so workers can ack and requeue on the way out."""
        services = [p for name, p in self.procs.items() if name not in EMBEDDED]
        terminate(services, grace_s)
        terminate([p for name, p in self.procs.items() if name in EMBEDDED], grace_s)
        for directory in self.scratch:
            shutil.rmtree(directory, ignore_errors=True)


def run_stack(ports: Mapping[str, int | None] | None = None, auth: bool = False) -> int:
    """Start the whole stack and supervise it until Ctrl-C, SIGTERM or SIGHUP, or a child dies.

    `ports` may name `port` (the API), `flower_port` and `metrics_base_port` (the first of the workers' three metrics
    ports, the API's metrics on the next); they are checked free before anything starts. API keys are off on this
    local stack unless `auth` (`stoker up --auth`); STOKER_AUTH, when set, decides.
    """
    settings = StackSettings()
    for name, value in (ports or {}).items():
        if value is not None:
            setattr(settings, name, value)
    settings.auth = stack_auth(settings, auth, os.environ)
    made = settings.auth and not settings.flower_basic_auth
    settings.flower_basic_auth = flower_credentials(settings)
    check_ports(stack_ports(settings))
    # Every child gets its environment from here: this one's, plus what the stack decided.
    env = {**os.environ, "STOKER_AUTH": "on" if settings.auth else "off"}  # the API's own default is on
    stack = Stack()
    # SIGINT too, explicitly: a process started in the background by a script inherits SIGINT ignored, and Python
    # then installs no Ctrl-C handler of its own. A terminal that goes away sends SIGHUP: stop as for SIGTERM.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        env.update(_ensure_broker(settings, stack))
        console.print("[bold]preparing the model[/] (first run downloads and converts it)…")
        resolve_model(settings.model, settings.model_cache)
        _start_all(settings, stack, env)
        _wait_ready(settings, stack)
        _announce(settings, flower_made=made)
        return _supervise(stack)
    except KeyboardInterrupt:
        console.print("stopping…")
        return 0
    finally:
        stack.stop()


def stack_auth(settings: StackSettings, flag: bool, environ: Mapping[str, str]) -> bool:
    """Whether the local stack requires API keys: as STOKER_AUTH says when it is set, else as `--auth` says."""
    return settings.auth if any(name.upper() == "STOKER_AUTH" for name in environ) else flag


def flower_credentials(settings: StackSettings) -> str | None:
    """Flower's "user:password": the setting's; else, with API keys on, one made for this run (Flower's UI shows
    every tenant's task arguments and results); else none."""
    if settings.flower_basic_auth or not settings.auth:
        return settings.flower_basic_auth
    return f"{FLOWER_USER}:{secrets.token_urlsafe(18)}"  # URL-safe: no ":" or "," (Flower splits a list on commas)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@dataclass(frozen=True)
class Port:
    """A port the stack listens on, and how to choose another."""

    number: int
    what: str
    option: str
    host: str


#: The stack's workers: one CPU pool for every CPU stage, speech included (no child idles while any stage has
#: work), and the inference worker; their metrics on `metrics_base_port` plus their offset, as `stoker worker`
#: numbers them (the ASR worker's port between them stays free for one run apart), the API's on the port after.
METRICS_KINDS = {"cpu": 0, "infer": 2}
API_METRICS_OFFSET = 3


def stack_ports(settings: StackSettings) -> list[Port]:
    """Every port `stoker up` will listen on, each on the stack's address (metrics too: STOKER_METRICS_HOST)."""
    ports = [
        Port(settings.port, "the API", "--port / STOKER_PORT", settings.host),
        Port(settings.flower_port, "Flower", "--flower-port / STOKER_FLOWER_PORT", settings.host),
    ]
    if settings.metrics_base_port:
        option = "--metrics-port / STOKER_METRICS_BASE_PORT"
        for kind, offset in METRICS_KINDS.items():
            ports.append(
                Port(settings.metrics_base_port + offset, f"the {kind} worker's metrics", option, settings.host)
            )
        ports.append(Port(api_metrics_port(settings), "the API's metrics", option, settings.host))
    return ports


def api_metrics_port(settings: StackSettings) -> int:
    """The stack's API serves its metrics on the port after the workers' (0: none, as theirs)."""
    return settings.metrics_base_port + API_METRICS_OFFSET if settings.metrics_base_port else 0


def check_ports(ports: list[Port]) -> None:
    """Exit with a message naming the port, before anything starts, when one is taken or named twice: a second
    stack on this machine needs ports of its own."""
    seen: dict[int, str] = {}
    for port in ports:
        if port.number in seen:
            raise SystemExit(f"port {port.number} is given to both {seen[port.number]} and {port.what}")
        seen[port.number] = port.what
        with socket.socket() as sock:
            try:
                sock.bind((port.host, port.number))
            except OSError as exc:
                raise SystemExit(
                    f"port {port.number} ({port.what}) is in use ({exc.strerror}): another stoker up?"
                    f" choose another with {port.option}"
                ) from exc


def _ensure_broker(settings: StackSettings, stack: Stack) -> dict[str, str]:
    """Start embedded Valkeys when no broker answers: one for the broker and the job store, which never evicts (a
    message or a job record must not be forgotten), and one for the stage cache, which forgets the least recently used
    entries (unless a cache answers at its URL), so a full cache never fills the store's memory and refuses jobs.
    Returns the URLs every child must use instead."""
    url = settings.broker_url
    if url.startswith("redis") and not redis_answers(url, tls=settings.redis_tls(url)):
        console.print(f"no broker answers at {_without_password(url)}: an embedded Valkey for the broker and store")
        port = _embedded(stack, BROKER, settings.embedded_maxmemory_mb, "noeviction")
        urls = {"STOKER_BROKER_URL": f"redis://127.0.0.1:{port}/0", "STOKER_RESULT_URL": f"redis://127.0.0.1:{port}/1"}
        cache = settings.cache_url
        if settings.cache_enabled and not redis_answers(cache, tls=settings.redis_tls(cache)):
            console.print(f"no cache answers at {_without_password(cache)}: an embedded Valkey for it (allkeys-lru)")
            port = _embedded(stack, CACHE, settings.embedded_cache_maxmemory_mb, "allkeys-lru", settings.heap_keep_mb)
            urls["STOKER_CACHE_URL"] = f"redis://127.0.0.1:{port}/0"
        settings.broker_url, settings.result_url = urls["STOKER_BROKER_URL"], urls["STOKER_RESULT_URL"]
        settings.cache_url = urls.get("STOKER_CACHE_URL", settings.cache_url)
    else:
        urls = {}
    if settings.cache_enabled and same_server(settings.cache_url, settings.result_url):
        console.print(f"[yellow]warning: {cache_shares_store(settings)}[/]")
    return urls


def _embedded(stack: Stack, name: str, maxmemory_mb: int, policy: str, keep_freed_mb: int = 0) -> int:
    """Start an embedded Valkey as one of the stack's children; its port. A cache keeps `keep_freed_mb` of freed
    memory for its next entries (`start_embedded`).

    In memory only: the stack stops when its servers do, so a file could serve no restart, only outlive the stack
    with every job record and upload in it. Its directory goes when the stack stops."""
    data_dir = Path(tempfile.mkdtemp(prefix=f"stoker-{name}-"))
    stack.scratch.append(data_dir)
    proc, port = start_embedded(
        data_dir=data_dir,
        preexec=stack.tether,
        maxmemory_mb=maxmemory_mb,
        persist=False,
        policy=policy,
        keep_freed_mb=keep_freed_mb,
    )
    stack.procs[name] = proc
    return port


def same_server(a: str, b: str) -> bool:
    """Whether two Redis URLs name one server (whatever their databases): one memory, one eviction policy."""
    return _server(a) == _server(b)


def _server(url: str) -> tuple[str | None, int, str]:
    """A Redis URL's server: its host and port, or its socket's path."""
    parts = urlsplit(url)
    return parts.hostname, parts.port or 6379, parts.path if parts.scheme == "unix" else ""


def cache_shares_store(settings: StackSettings) -> str:
    """What a stage cache on the job store's server costs, said for a startup warning."""
    where = _without_password(settings.cache_url)
    return (
        f"the stage cache ({where}) is on the job store's server: its entries fill the store's memory, which must "
        "never evict (noeviction), until new jobs are refused (503 store_full); give STOKER_CACHE_URL a server of "
        "its own with maxmemory-policy allkeys-lru"
    )


def _scratch(stack: Stack, env: dict[str, str]) -> dict[str, str]:
    """A worker's environment, its metric files' directory the stack's to remove (a restarted worker keeps it)."""
    stack.scratch.append(Path(env["PROMETHEUS_MULTIPROC_DIR"]))
    return env


def _start_all(settings: StackSettings, stack: Stack, env: dict[str, str]) -> None:
    workers = WorkerSettings(broker_url=settings.broker_url, result_url=settings.result_url)
    env = {**env, "STOKER_METRICS_HOST": settings.host}  # every metrics port on the stack's address, as the rest
    py = sys.executable
    # The API's metrics on a listener of their own, on the stack's address: never on the API's port.
    # The API only serves; OpenAI batches are fed by a process of their own, at a lower CPU priority
    # (`api.openai_batch_feeder`).
    api_env = {**env, "STOKER_API_METRICS_PORT": str(api_metrics_port(settings)), "STOKER_BATCH_FEEDER": "false"}
    # The API's waits get what is left of the stack's own stop grace, so a request still waiting when the stack
    # stops is answered (its job as it stands, or `server_stopping`) rather than cut off with the API killed under it.
    api_env["STOKER_STOP_GRACE_S"] = str(min(settings.stop_grace_s, STOP_GRACE_S - API_STOP_MARGIN_S))
    stack.start("api", api_argv(settings), api_env)
    stack.start("batch-feeder", [py, "-m", "stoker.cli", "batch-feeder"], env)
    # The CPU pool gets the children an ASR worker would have had as well: one pool, the same CPU processes.
    extra = {"cpu": ["--concurrency", str(workers.cpu_pool + workers.asr_concurrency)]}
    for kind, offset in METRICS_KINDS.items():
        metrics = settings.metrics_base_port + offset if settings.metrics_base_port else 0
        argv = worker_argv(kind, workers, extra.get(kind, []))
        stack.start(f"{kind}-worker", argv, {**_scratch(stack, worker_env(kind, env)), **_metrics(metrics)})
    stack.start("reaper", [py, "-m", "stoker.cli", "reaper"], _scratch(stack, worker_env("reaper", env)))
    stack.start("flower", *flower_command(settings, env))


def flower_command(settings: StackSettings, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """Flower's command line and environment. With API keys on it never runs without basic auth: its UI shows every
    tenant's task arguments and results."""
    credentials = settings.flower_basic_auth
    if settings.auth and not credentials:
        raise SystemExit("API keys are on: Flower needs STOKER_FLOWER_BASIC_AUTH=user:password")
    user, _, password = (credentials or ":").partition(":")
    if credentials and not (user and password):
        raise SystemExit("STOKER_FLOWER_BASIC_AUTH must be user:password")
    port, address = f"--port={settings.flower_port}", f"--address={settings.host}"
    argv = [sys.executable, "-m", "celery", "-A", "tasks.worker", "flower", port, address]
    # Flower reads FLOWER_* options from its environment: the credentials stay off its command line (and `ps`).
    auth = {"FLOWER_BASIC_AUTH": credentials} if credentials else {}
    return argv, {**env, **auth}


def api_argv(settings: StackSettings) -> list[str]:
    """The API's command line: `stoker api`, as every deployment runs it, so that it is served with the same bounds
    on what one connection may cost (`api.server`)."""
    return [sys.executable, "-m", "stoker.cli", "api", "--host", settings.host, "--port", str(settings.port)]


def _metrics(port: int) -> dict[str, str]:
    return {"STOKER_METRICS_PORT": str(port)}


def _wait_ready(settings: StackSettings, stack: Stack) -> None:
    """Ready when /readyz answers 200 and every worker answers a ping."""
    app = make_app(settings)
    deadline = time.monotonic() + settings.ready_timeout_s
    url = f"http://{settings.host}:{settings.port}/readyz"
    while time.monotonic() < deadline:
        if dead := stack.dead():
            raise SystemExit(f"failed to start: {', '.join(dead)} exited")
        if _http_ok(url) and _workers_up(app.control.ping(timeout=1.0)):
            return
        time.sleep(0.5)
    raise SystemExit(f"stack not ready after {settings.ready_timeout_s:.0f}s")


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _workers_up(replies: list[dict[str, Any]]) -> bool:
    names = {name.split("@")[0] for reply in replies for name in reply}
    return set(METRICS_KINDS) <= names


def _announce(settings: StackSettings, flower_made: bool = False) -> None:
    base = f"http://{settings.host}:{settings.port}"
    console.print(f"[bold green]stoker is ready[/]\n  API      {base}  (docs {base}/docs)")
    auth = "basic auth" if settings.flower_basic_auth else "no auth: its API stays closed"
    if flower_made and settings.flower_basic_auth:
        user, _, password = settings.flower_basic_auth.partition(":")
        auth = f"basic auth: user {user}, password {password}, made for this run (STOKER_FLOWER_BASIC_AUTH sets one)"
    console.print(f"  Flower   http://{settings.host}:{settings.flower_port}  ({auth})")
    broker, store, cache = (
        _without_password(u) for u in (settings.broker_url, settings.result_url, settings.cache_url)
    )
    console.print(f"  broker   {broker}\n  store    {store}\n  cache    {cache}")
    keys = "off (one tenant, local)"
    if settings.auth:
        keys = f"on: STOKER_RESULT_URL={store} stoker keys create --tenant NAME   (the key is its last line)"
    console.print(f"  API keys {keys}")
    key = " --key KEY" if settings.auth else ""
    console.print(f"  try:     stoker submit IMAGE.png --prompt 'What does it say?' --api {base}{key}", soft_wrap=True)
    console.print("  (Ctrl-C stops everything)")


def _without_password(url: str) -> str:
    """A URL fit to print: an ACL user's password masked."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _supervise(stack: Stack) -> int:
    """Replace workers that exit; stop everything when the API, Flower or the broker exits, or restarts pile up."""
    while True:
        for name in stack.dead():
            code = stack.procs[name].returncode
            if not stack.restart(name, time.monotonic()):
                console.print(f"[red]{name} exited ({code}); stopping the stack[/]")
                return 1
            console.print(f"[yellow]{name} exited ({code}); started a new one[/]")
        time.sleep(1.0)
