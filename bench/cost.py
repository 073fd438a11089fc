"""What one job costs the stack in CPU, per process kind, and what the stack costs idle.

    .venv/bin/python -m bench.cost [--jobs 600] [--clients 8] [--idle-s 60] [--profile-s 15] [--docs]

Starts the stack as `stoker up` does (its own command: an embedded Valkey, the API, the CPU, ASR and inference
workers, the reaper and Flower), with the simulated device at 0 ms, so that only stoker's own bookkeeping costs
anything. Then, from 8 closed-loop clients (the load generator runs in this process, outside the stack's process
tree): text-only jobs through `POST /v1/jobs` and a long-poll, the same in one request (`POST /v1/jobs?wait=30`),
cached-image jobs (one image and one prompt, both in the cache after the first), and chat completions. For each
kind of job it reads the user + system CPU time of every process in the stack's tree from /proc before and after
(children that exited are counted in their parent's cutime/cstime) and divides by the jobs answered, and counts
the commands the stack's Valkey ran per job, the round trips every process made to it (the reads it served) and
the times a thread of the stack went to sleep (voluntary context switches: each is a wake-up to pay for later);
then the stack's idle cost over `--idle-s`, in cores per process kind. With py-spy installed (`pip install
py-spy`), the API and the inference worker are sampled under load (text-only unless `--profile-case` names
another case), and the functions they spend their CPU in are listed.

CPU time, not wall time: on a machine where other work runs, contention stretches wall time far more than the
CPU a process spends. The command and round-trip counts do not move with the machine at all. Prints a table and
writes bench/results/cost.json and cost.md; `--docs` also writes the table into docs/benchmarks.md (between the
`cost:begin` / `cost:end` markers).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import redis
from rich.console import Console
from rich.table import Table

from bench import rawload
from bench.workload import text_png
from stoker.adapters.store.tenants import TenantRepository
from stoker.core.tenancy import issue_key
from workers.broker import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs" / "benchmarks.md"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
TERMINAL = ("succeeded", "degraded", "failed", "cancelled")
#: Process kinds, in table order, and how each is recognised in its command line (first match wins).
KINDS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("API", lambda c: "stoker.cli api" in c),
    ("inference worker", lambda c: "infer@" in c),
    ("Valkey", lambda c: "valkey" in c or "redis-server" in c),
    ("Flower", lambda c: " flower" in c),
    ("reaper", lambda c: "stoker.cli reaper" in c),
    ("batch feeder", lambda c: "stoker.cli batch-feeder" in c),
    ("CPU worker", lambda c: "cpu@" in c),
    ("ASR worker", lambda c: "asr@" in c),
    ("supervisor", lambda c: "stoker.cli up" in c),
)
console = Console()


def kind_of(cmdline: str) -> str:
    """The process kind of a command line (`other` for anything unrecognised, e.g. a tesseract child)."""
    return next((name for name, match in KINDS if match(cmdline)), "other")


@dataclass(frozen=True)
class Proc:
    """One process of the tree: its parent, command line and CPU seconds (its own and its waited-for children's)."""

    pid: int
    ppid: int
    cmdline: str
    cpu_s: float


def read_proc(pid: int) -> Proc | None:
    """/proc/PID/stat and cmdline; None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # after the command: state ppid ... utime(14) stime(15) cutime(16) cstime(17), 1-based from pid
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    return Proc(pid, int(fields[1]), cmdline, ticks * TICK_S)


def tree(root: int) -> list[Proc]:
    """The root process and all its descendants, as they stand now."""
    procs = [p for pid in os.listdir("/proc") if pid.isdigit() and (p := read_proc(int(pid))) is not None]
    children: dict[int, list[Proc]] = {}
    for proc in procs:
        children.setdefault(proc.ppid, []).append(proc)
    found, todo = [], [p for p in procs if p.pid == root]
    while todo:
        proc = todo.pop()
        found.append(proc)
        todo.extend(children.get(proc.pid, []))
    return found


def cpu_by_kind(root: int) -> dict[str, float]:
    """CPU seconds per process kind over the tree: a kind's processes and the children they have reaped."""
    totals: dict[str, float] = {}
    for proc in tree(root):
        kind = kind_of(proc.cmdline)
        totals[kind] = totals.get(kind, 0.0) + proc.cpu_s
    return totals


def sleeps(root: int) -> int:
    """Voluntary context switches so far of every thread of every process in the tree (a thread that blocks: on
    a socket, a lock, a condition, the GIL): each costs a wake-up later, which on a virtual machine may cost a
    switch through the hypervisor. A count, so it moves with what the stack does per job, not with the host."""
    total = 0
    for proc in tree(root):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in os.listdir(f"/proc/{proc.pid}/task"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    status = Path(f"/proc/{proc.pid}/task/{task}/status").read_text()
                    total += int(status.split("voluntary_ctxt_switches:", 1)[1].split()[0])
    return total


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent per kind between two readings (a process that started in between counts whole)."""
    return {kind: after.get(kind, 0.0) - before.get(kind, 0.0) for kind in {*before, *after}}


@dataclass
class Stack:
    """A `stoker up` of the benchmark's own."""

    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    scratch: Path
    #: Sent with every request (an API key's, with `--auth`).
    headers: dict[str, str] = field(default_factory=dict)

    def valkey_counts(self) -> tuple[int, int]:
        """Every command the stack's embedded Valkey has run so far (`INFO commandstats`), and every read of a
        client's socket it has processed (`INFO stats`: one per request or pipeline sent, so the round trips of
        every process): counts, so they move with what the stack does per job, not with how busy the machine is."""
        with redis.Redis(port=self.valkey_port()) as client:
            commands = sum(int(stat["calls"]) for stat in client.info("commandstats").values())
            return commands, int(client.info("stats")["total_reads_processed"])

    def valkey_port(self) -> int:
        """The port of the stack's embedded Valkey."""
        (valkey,) = (p for p in tree(self.proc.pid) if kind_of(p.cmdline) == "Valkey")
        listening = re.search(r"127\.0\.0\.1:(\d+)", valkey.cmdline)  # its title once it runs: valkey-server HOST:PORT
        assert listening is not None, valkey.cmdline
        return int(listening.group(1))

    def pids(self, kind: str) -> list[int]:
        """The processes of one kind (a prefork worker's parent first)."""
        return sorted(p.pid for p in tree(self.proc.pid) if kind_of(p.cmdline) == kind)


@contextmanager
def stoker_up(env_extra: dict[str, str], auth: bool = False, root: Path = ROOT) -> Iterator[Stack]:
    """`stoker up` on free ports with an embedded Valkey (its broker URL names a port nothing listens on); with
    `auth`, API keys on as in production (`STOKER_AUTH`), the limits too high to refuse anything, and one key's
    header sent with every request. `root`: the checkout whose code the stack runs (another commit's worktree)."""
    port, flower = free_port(), free_port()
    scratch = Path(tempfile.mkdtemp(prefix="stoker-cost-"))
    nothing = f"redis://127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        # its processes import this checkout's code, not the installed one
        "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
        "STOKER_BROKER_URL": f"{nothing}/0",
        "STOKER_RESULT_URL": f"{nothing}/1",
        "STOKER_CACHE_URL": f"{nothing}/2",
        "STOKER_BACKEND": "sim",
        "STOKER_SIM_BASE_MS": "0",
        "STOKER_SIM_PER_ITEM_MS": "0",
        **(AUTH_ON if auth else {}),
        **env_extra,
    }
    argv = [sys.executable, "-m", "stoker.cli", "up", "--port", str(port), "--flower-port", str(flower)]
    argv += ["--metrics-port", "0"]  # several stacks may run on this machine: no fixed ports
    log = scratch / "stack.log"
    with log.open("wb") as handle:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=handle, stderr=subprocess.STDOUT)
    stack = Stack(proc, f"http://127.0.0.1:{port}", log, scratch)
    try:
        _wait_ready(stack)
        if auth:
            stack.headers = _api_key(f"redis://127.0.0.1:{stack.valkey_port()}/1")
        yield stack
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)


#: API keys on, with per-tenant limits no closed loop of the benchmark reaches: each request still pays for its key's
#: check and its tenant's counters, as in production.
AUTH_ON = {"STOKER_AUTH": "on", "STOKER_RATE_LIMIT_PER_S": "1000000", "STOKER_RATE_LIMIT_BURST": "1000000"}


def _api_key(store_url: str) -> dict[str, str]:
    """A new API key of the benchmark's tenant in the stack's store, as the header that sends it."""
    issued = issue_key("bench", time.time())
    with redis.Redis.from_url(store_url) as client:
        TenantRepository(client).put_api_key(issued.record)
    return {"Authorization": f"Bearer {issued.token}"}


def _wait_ready(stack: Stack, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while b"stoker is ready" not in stack.log.read_bytes():
        if stack.proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"stoker up did not become ready:\n{stack.log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)


# -- the load ------------------------------------------------------------------------------------------------------

#: One job of a kind, sent and awaited by one client: returns whether it ended as it should.
Send = Callable[[httpx.Client, int], bool]


def _await_job(http: httpx.Client, job: dict[str, Any]) -> bool:
    while job["status"] not in TERMINAL:
        job = http.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()
    return bool(job["status"] == "succeeded")


def text_job(http: httpx.Client, n: int) -> bool:
    """A text-only job through `POST /v1/jobs`, then long-polled to its end."""
    return _await_job(http, http.post("/v1/jobs", data={"prompt": f"Question {n}: what is {n} squared?"}).json())


def text_job_waited(http: httpx.Client, n: int) -> bool:
    """A text-only job in one request: `POST /v1/jobs?wait=30` answers once the job has ended."""
    posted = http.post("/v1/jobs", params={"wait": 30}, data={"prompt": f"Question {n}: what is {n} squared?"})
    return _await_job(http, posted.json())


IMAGE = text_png("stoker")


def image_job(http: httpx.Client, n: int) -> bool:
    """The same image and prompt every time: after the first, its inputs and its prompt come from the cache."""
    files = {"image": ("page.png", IMAGE, "image/png")}
    return _await_job(http, http.post("/v1/jobs", data={"prompt": "What does it say?"}, files=files).json())


def image_job_waited(http: httpx.Client, n: int) -> bool:
    """The cached image job in one request (`POST /v1/jobs?wait=30`)."""
    files = {"image": ("page.png", IMAGE, "image/png")}
    posted = http.post("/v1/jobs", params={"wait": 30}, data={"prompt": "What does it say?"}, files=files)
    return _await_job(http, posted.json())


def chat_job(model: str) -> Send:
    """A text-only chat completion, the connection held until the answer."""

    def send(http: httpx.Client, n: int) -> bool:
        body = {"model": model, "messages": [{"role": "user", "content": f"Question {n}: what is {n} squared?"}]}
        return http.post("/v1/chat/completions", json=body).status_code == 200

    return send


def chat_image_job(model: str) -> Send:
    """A chat completion with the cached image as a data URL."""
    url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()

    def send(http: httpx.Client, n: int) -> bool:
        content = [{"type": "text", "text": "What does it say?"}, {"type": "image_url", "image_url": {"url": url}}]
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        return http.post("/v1/chat/completions", json=body).status_code == 200

    return send


@dataclass
class Load:
    """Closed-loop clients sending `jobs` jobs between them."""

    send: Send
    jobs: int
    clients: int
    headers: dict[str, str] = field(default_factory=dict)
    issued: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _next(self) -> int | None:
        with self.lock:
            if self.issued >= self.jobs:
                return None
            self.issued += 1
            return self.issued

    def _client(self, base: str) -> None:
        with httpx.Client(base_url=base, timeout=60, headers=self.headers) as http:
            while (n := self._next()) is not None:
                try:
                    good = self.send(http, n)
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    good, what = False, type(exc).__name__
                else:
                    what = "not succeeded"
                with self.lock:
                    self.ok += good
                    if not good:
                        self.errors[what] += 1

    def run(self, base: str) -> float:
        """Send them all; the wall seconds it took."""
        started = time.monotonic()
        threads = [threading.Thread(target=self._client, args=(base,)) for _ in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.monotonic() - started


def measure(stack: Stack, name: str, send: Send, jobs: int, clients: int) -> dict[str, Any]:
    """One closed-loop phase: CPU ms per answered job per process kind, and the rate the clients saw."""
    Load(send, max(clients, 8), clients, stack.headers).run(
        stack.base
    )  # warm: first-of-a-kind costs (cache fill, imports)
    time.sleep(1.0)
    before, (commands, reads), slept = cpu_by_kind(stack.proc.pid), stack.valkey_counts(), sleeps(stack.proc.pid)
    load = Load(send, jobs, clients, stack.headers)
    wall = load.run(stack.base)
    spent, slept = delta(before, cpu_by_kind(stack.proc.pid)), sleeps(stack.proc.pid) - slept
    commands_after, reads_after = stack.valkey_counts()
    commands, reads = commands_after - commands, reads_after - reads
    per_job = {k: round(v * 1000 / max(load.ok, 1), 2) for k, v in spent.items()}
    return {
        "case": name,
        "jobs": load.ok,
        "failed": dict(load.errors),
        "jobs_per_s": round(load.ok / wall, 1),
        "wall_s": round(wall, 2),
        "cpu_ms_per_job": per_job,
        "stack_ms_per_job": round(sum(per_job.values()), 2),
        "valkey_commands_per_job": round(commands / max(load.ok, 1), 1),
        "valkey_round_trips_per_job": round(reads / max(load.ok, 1), 1),
        "thread_sleeps_per_job": round(slept / max(load.ok, 1), 1),
    }


def cases_for(stack: Stack) -> dict[str, Send]:
    """Every case by its name (`--cases`), the chats for the model the stack serves."""
    with httpx.Client(base_url=stack.base, timeout=10, headers=stack.headers) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    return {
        "text": text_job,
        "text-wait": text_job_waited,
        "image": image_job,
        "image-wait": image_job_waited,
        "chat": chat_job(model),
        "chat-image": chat_image_job(model),
        "post": post_only,
    }


def post_only(http: httpx.Client, n: int) -> bool:
    """A text-only job through `POST /v1/jobs`, not waited for: the admission path alone."""
    return http.post("/v1/jobs", data=_question(n)).status_code == 202


def post_form(n: int) -> tuple[str, str, bytes]:
    """`post_only`'s request for the admission phase's clients (`bench.rawload`)."""
    return "POST", "/v1/jobs", urlencode(_question(n)).encode()


def _question(n: int) -> dict[str, str]:
    return {"prompt": f"Question {n}: what is {n} squared?"}


def admission(stack: Stack, seconds: float, clients: int) -> dict[str, Any]:
    """`POST /v1/jobs` as fast as `clients` closed-loop clients can send, for `seconds`: accepted jobs per second,
    and how busy each process was meanwhile (near 1 core: the API's own CPU is the ceiling); then every accepted
    job is waited for, and how they ended is counted (a rate whose jobs are not all answered is no rate).

    The clients are `bench.rawload`'s, on one event loop in this process: the load generator's own CPU, counted
    here too, is a small share of the machine the stack runs on."""
    before, started, generator = cpu_by_kind(stack.proc.pid), time.monotonic(), time.process_time()
    _, reads = stack.valkey_counts()
    api = stack.pids("API")  # one scan of /proc: the API's pids do not change during the phase
    api_mb_before = resident_mb(api)
    tally = rawload.run(stack.base, post_form, clients, seconds)
    wall = time.monotonic() - started
    spent = delta(before, cpu_by_kind(stack.proc.pid))
    reads = stack.valkey_counts()[1] - reads
    spent["load generator"] = time.process_time() - generator
    accepted = len(tally.accepted)
    cores = {k: round(v / wall, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v / wall >= 0.01}
    per_post = round(spent.get("API", 0.0) * 1000 / max(accepted, 1), 2)
    api_mb = (api_mb_before, resident_mb(api))
    ended = rawload.wait_all(stack.base, tally.accepted)
    return {
        "accepted_per_s": round(accepted / wall, 1),
        "api_ms_per_post": per_post,
        "generator_ms_per_post": round(spent["load generator"] * 1000 / max(accepted, 1), 3),
        "valkey_round_trips_per_job": round(reads / max(accepted, 1), 1),
        "api_resident_mb": api_mb,
        "cores": cores,
        "statuses": dict(tally.statuses),
        "client_errors": dict(tally.errors),
        "ended": dict(ended),
    }


def resident_mb(pids: list[int]) -> int:
    """The processes' resident memory, in MB, together (VmRSS; 0 for one that is gone)."""
    return _summed_kb(pids, "status", "VmRSS:") // 1024


def proportional_mb(pids: list[int]) -> int:
    """The processes' proportional memory, in MB, together (Pss: each page shared by n processes counts 1/n, so a
    prefork pool's pages shared with its parent, or a library's mapped by several processes, are counted once)."""
    return _summed_kb(pids, "smaps_rollup", "Pss:") // 1024


def _summed_kb(pids: list[int], proc_file: str, field: str) -> int:
    """One kB field of `/proc/PID/<proc_file>`, summed over the processes (0 for one that is gone)."""
    total_kb = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/{proc_file}").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total_kb += next((int(line.split()[1]) for line in text.splitlines() if line.startswith(field)), 0)
    return total_kb


def idle(stack: Stack, seconds: float, settle_s: float = 5.0) -> dict[str, float]:
    """Cores each process kind uses while nothing is sent."""
    time.sleep(settle_s)
    before = cpu_by_kind(stack.proc.pid)
    time.sleep(seconds)
    return {k: round(v / seconds, 4) for k, v in delta(before, cpu_by_kind(stack.proc.pid)).items()}


# -- the profile ---------------------------------------------------------------------------------------------------


def py_spy() -> str | None:
    """py-spy, from this environment or the PATH."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def profile(stack: Stack, seconds: float, clients: int, send: Send = text_job, top: int = 15) -> dict[str, Any]:
    """Sample the API and the inference worker with py-spy while jobs of one kind (`send`: text-only unless
    told) run; their hottest functions.

    Only the thread holding the GIL is sampled (`--gil`): what Python code spends CPU on, not where threads wait."""
    spy = py_spy()
    if spy is None:
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    targets = {"API": stack.pids("API")[0], "inference worker": stack.pids("inference worker")[0]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    raw = {kind: RESULTS / f"profile-{kind.split()[0].lower()}.txt" for kind in targets}  # py-spy's collapsed stacks
    record = [spy, "record", "--duration", str(int(seconds)), "--rate", "250", "--gil", "--format", "raw"]
    spies = [
        subprocess.Popen(
            [*record, "--pid", str(pid), "--output", str(raw[kind])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for kind, pid in targets.items()
    ]
    load = Load(send, 10**9, clients, stack.headers)
    driver = threading.Thread(target=load.run, args=(stack.base,), daemon=True)
    driver.start()
    for spy_proc in spies:
        spy_proc.wait()
    with load.lock:
        load.jobs = load.issued  # the clients stop after their current job
    driver.join()
    return {kind: hottest(raw[kind], top) for kind in targets if raw[kind].exists()}


def hottest(path: Path, top: int) -> dict[str, list[tuple[str, float]]]:
    """From py-spy's collapsed stacks: the share of samples each function is on the stack for (inclusive) and at
    its top (self), the project's own functions and, for self time, everything."""
    inclusive: Counter[str] = Counter()
    everything: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")[1:]]  # the first is the thread
        total += n
        if frames:
            own[frames[-1]] += n
        for frame in set(frames):
            everything[frame] += n
            if _ours(frame):
                inclusive[frame] += n

    def share(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(n / max(total, 1), 3)) for name, n in counter.most_common(top)]

    return {
        "samples": [("all", float(total))],
        "self": share(own),
        "inclusive (project code)": share(inclusive),
        "inclusive": [(name, round(n / max(total, 1), 3)) for name, n in everything.most_common(60)],
    }


def _frame(frame: str) -> str:
    """`func (path/to/file.py:12)` → `func (file.py)`: one entry per function, not per line."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{name} ({short})"


def _ours(frame: str) -> bool:
    return any(f"({d}/" in frame for d in ("api", "store", "runtime", "tasks", "adapters", "core", "workers"))


# -- the report ----------------------------------------------------------------------------------------------------

ORDER = [name for name, _ in KINDS] + ["other"]


def markdown(rows: list[dict[str, Any]], idle_cores: dict[str, float], idle_s: float) -> str:
    """One table: CPU ms per job per process kind for each case, and idle cores."""
    kinds = [k for k in ORDER if any(r["cpu_ms_per_job"].get(k) for r in rows) or idle_cores.get(k)]
    head = ["process", *(f"{r['case']} ms/job" for r in rows), f"idle cores ({idle_s:.0f} s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in kinds:
        cells = [f"{r['cpu_ms_per_job'].get(kind, 0.0):.2f}" for r in rows]
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {idle_cores.get(kind, 0.0):.4f} |")
    totals = [f"**{r['stack_ms_per_job']:.2f}**" for r in rows]
    lines.append("| **stack** | " + " | ".join(totals) + f" | **{sum(idle_cores.values()):.4f}** |")
    idle_total = sum(idle_cores.values())
    marginal = [f"{r['stack_ms_per_job'] - idle_total * r['wall_s'] * 1000 / max(r['jobs'], 1):.2f}" for r in rows]
    lines.append("| stack less its idle cost over the run | " + " | ".join(marginal) + " | |")
    commands = [f"{r['valkey_commands_per_job']:.1f}" for r in rows]
    lines.append("| Valkey commands per job (every process's) | " + " | ".join(commands) + " | |")
    trips = [f"{r['valkey_round_trips_per_job']:.1f}" for r in rows]
    lines.append("| Valkey round trips per job (the reads it served, every process's) | " + " | ".join(trips) + " | |")
    slept = [f"{r['thread_sleeps_per_job']:.1f}" for r in rows]
    lines.append(
        "| thread sleeps per job (voluntary context switches, every process's threads) | " + " | ".join(slept) + " | |"
    )
    rates = [f"{r['jobs']} jobs, {r['jobs_per_s']}/s" for r in rows]
    lines.append("| (answered, closed loop) | " + " | ".join(rates) + " | |")
    return "\n".join(lines)


def show(rows: list[dict[str, Any]], idle_cores: dict[str, float], idle_s: float) -> None:
    """The same table, for the terminal."""
    table = Table(title="CPU ms per job (stack's process tree, /proc utime+stime)")
    table.add_column("process")
    for row in rows:
        table.add_column(f"{row['case']}\n{row['jobs']} jobs, {row['jobs_per_s']}/s", justify="right")
    table.add_column(f"idle cores\n({idle_s:.0f} s)", justify="right")
    kinds = [k for k in ORDER if any(r["cpu_ms_per_job"].get(k) for r in rows) or idle_cores.get(k)]
    for kind in kinds:
        table.add_row(kind, *(f"{r['cpu_ms_per_job'].get(kind, 0.0):.2f}" for r in rows), f"{idle_cores[kind]:.4f}")
    table.add_row(
        "stack", *(f"{r['stack_ms_per_job']:.2f}" for r in rows), f"{sum(idle_cores.values()):.4f}", style="bold"
    )
    console.print(table)


def profile_markdown(prof: dict[str, Any]) -> str:
    """The profile's top entries per process, as lists."""
    if "skipped" in prof:
        return f"profile: {prof['skipped']}"
    out = []
    for kind, views in prof.items():
        samples = int(views["samples"][0][1])
        for view in ("self", "inclusive (project code)"):
            entries = ", ".join(f"`{name}` {share:.0%}" for name, share in views[view][:10])
            out.append(f"- {kind}, {view} ({samples} samples): {entries}")
    return "\n".join(out)


def write_docs(text: str) -> None:
    """Replace the block between the markers in docs/benchmarks.md."""
    page = DOCS.read_text()
    begin, end = "<!-- cost:begin -->", "<!-- cost:end -->"
    if begin not in page:
        raise SystemExit(f"{DOCS} has no {begin} marker")
    head, rest = page.split(begin, 1)
    DOCS.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def main() -> None:
    """Every phase on one stack, then the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=600, help="jobs per case")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--idle-s", type=float, default=60.0, help="how long the idle stack is measured")
    parser.add_argument("--profile-s", type=float, default=15.0, help="py-spy's sampling time (0: no profile)")
    parser.add_argument(
        "--cases",
        default="text,text-wait,image,chat",
        help="of text, image, chat, chat-image, text-wait, image-wait (one request: POST ?wait=), post (not waited)",
    )
    parser.add_argument("--profile-case", default="text", help="the case profiled (one of --cases' choices)")
    parser.add_argument("--admission-s", type=float, default=0.0, help="POST-only load this long (0: none)")
    parser.add_argument("--admission-clients", type=int, default=32)
    parser.add_argument(
        "--device-ms",
        default="0,0",
        help="the simulated device's milliseconds per batch and per item in it (the default: free, so only stoker's "
        "own bookkeeping costs; a slower one fills batches)",
    )
    parser.add_argument(
        "--auth", action="store_true", help="API keys on, as in production (closed-loop cases and the profile only)"
    )
    parser.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    if args.auth and args.admission_s > 0:
        parser.error("--auth measures the closed-loop cases: leave --admission-s at 0")
    started = time.monotonic()
    base_ms, per_item_ms = args.device_ms.split(",")
    with stoker_up({"STOKER_SIM_BASE_MS": base_ms, "STOKER_SIM_PER_ITEM_MS": per_item_ms}, args.auth) as stack:
        cases = cases_for(stack)
        wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
        rows = [measure(stack, name, cases[name], args.jobs, args.clients) for name in wanted]
        idle_cores = idle(stack, args.idle_s)
        admitted = admission(stack, args.admission_s, args.admission_clients) if args.admission_s > 0 else None
        prof = (
            profile(stack, args.profile_s, args.clients, cases[args.profile_case])
            if args.profile_s > 0
            else {"skipped": "--profile-s 0"}
        )
    table = markdown(rows, idle_cores, args.idle_s)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = "python -m bench.cost " + " ".join(sys.argv[1:])
    text = f"`{cmd}` ({when}, {time.monotonic() - started:.0f} s):\n\n{table}\n\n{profile_markdown(prof)}"
    if admitted is not None:
        text += (
            f"\n\nAdmission, {args.admission_clients} clients posting text jobs for {args.admission_s:.0f} s: "
            f"{admitted['accepted_per_s']} jobs/s accepted, {admitted['api_ms_per_post']} API CPU ms per POST "
            f"({admitted['generator_ms_per_post']} ms in the load generator), "
            f"{admitted['valkey_round_trips_per_job']} Valkey round trips per job meanwhile; the API's resident "
            f"memory {admitted['api_resident_mb'][0]} → {admitted['api_resident_mb'][1]} MB; cores busy: "
            f"{admitted['cores']}; responses {admitted['statuses']}; the accepted jobs ended {admitted['ended']}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    facts = {"rows": rows, "idle_cores": idle_cores, "admission": admitted, "profile": prof}
    (RESULTS / "cost.json").write_text(json.dumps(facts, indent=1))
    (RESULTS / "cost.md").write_text(text + "\n")
    show(rows, idle_cores, args.idle_s)
    print(f"\n{text}")  # plain: markdown must not be wrapped
    if args.docs:
        write_docs(text)
    failed = {r["case"]: r["failed"] for r in rows if r["failed"]}
    if admitted is not None and set(admitted["ended"]) - {"succeeded"}:
        failed["admission"] = admitted["ended"]
    if failed:
        raise SystemExit(f"jobs that did not succeed: {failed}")


if __name__ == "__main__":
    main()
