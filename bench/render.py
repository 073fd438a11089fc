"""stoker's render tier against vLLM's own renderer (`vllm launch render`): the same model, the same pictures and the
same requests (`POST /v1/chat/completions/render`), the load generator on the same machine.

    .venv/bin/python -m bench.render [--quick] [--scenarios a,b,c,d] [--cores 1] [--profile-pictures 12]

The servers: vLLM 0.33.0's renderer on the CPU from its own venv (`make peer`; `workers.vllm_peer` starts it as the
recording of its renders does), and a stoker stack in pipeline mode (`bench.stack.bench_stack`: the API, the CPU
worker's pool, the inference worker, the reaper and the batch feeder, over two Valkeys of this run's own, a store and
a cache, as `stoker up` has them; the device simulated, which a render never reaches). Both serve the tiny VLM
(`make tiny-vlm`). `--cores N` starts both on the machine's first N cores (as `taskset -c` would: every process they
start inherits it); the load generator is not pinned.

Scenarios: (a) one distinct 1280×960 photo-like JPEG a request; (b) four distinct 720p ones; (c) 40 % of the pictures
byte-identical repeats of earlier ones; (d) 5 % of the requests carry a broken (truncated JPEG) or oversized (a PNG
claiming 40,000 × 40,000 pixels) picture, whose 4xx is the expected answer and a 5xx a failure. Pictures are made from
seeded noise and shapes (`bench.workload.scene_jpeg`): the same bytes for both servers, new ones for every phase (so
neither server's cache carries a picture from one phase to the next). For each scenario, both servers in turn: a
closed loop (`--clients` clients, renders/s at saturation), then open loops (Poisson arrivals) at 50 % and 90 % of
vLLM's closed-loop rate, p50 / p99 from each request's arrival to the last byte of its answer. Before the scenarios,
each server is settled as a long-running one is (`settle`): rounds of distinct pictures until its memory stops
growing (vLLM's renderer fills its 4 GiB processor cache, and is measured once it recycles memory). CPU seconds per
picture: every process of the server (its whole tree; for stoker the API, the workers and both Valkeys), read from
/proc before and after the scenario's three phases, divided by the pictures sent in them. stoker's cache Valkey is
filled to its memory before the first scenario (`fill`), as a cache that has been running is.

`--profile-pictures N` (0: none) then renders N distinct 1280×960 pictures in this process as stoker's CPU worker and
API do (decode, the processor, the cast to vLLM's item, its msgpack, a Valkey write and read, the answer's base64 and
JSON), and says where the CPU per picture goes, with the processor's hottest functions (cProfile).

Writes bench/results/render.json and render.md and prints the tables; the clients are `bench.rawload`'s coroutines,
whose own CPU is reported beside the servers'.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import cProfile
import functools
import json
import os
import pstats
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httptools
import redis

from bench.cost import resident_mb, tree
from bench.rawload import Connections
from bench.report import percentile
from bench.stack import Device, bench_stack
from bench.workload import png_bomb, scene_jpeg
from stoker.adapters.heap import keep_freed_memory
from stoker.adapters.render import RenderedPicture, Renderer
from stoker.adapters.vllm_render import features, idefics3_tensors, request_json_pieces
from stoker.core.imaging import DecodeParams, decode_rgb
from stoker.settings import ApiSettings
from workers.broker import free_port, start_embedded
from workers.procs import ROOT
from workers.vllm_peer import PEER_VENV, render_server

RESULTS = ROOT / "bench" / "results"
MODEL = Path("~/.cache/stoker/models/tiny-vlm-v1").expanduser()
PATH = "/v1/chat/completions/render"
TIMEOUT_S = 120.0
T = TypeVar("T")


# -- the requests --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """What each request of a scenario carries."""

    key: str
    title: str
    pictures: int
    size: tuple[int, int]
    #: Share of the pictures that repeat one sent earlier in the same phase (byte-identical).
    repeat: float = 0.0
    #: Share of the requests whose one picture is broken or oversized.
    bad: float = 0.0


SCENARIOS = {
    s.key: s
    for s in (
        Scenario("a", "one distinct 1280×960 photo a request", 1, (1280, 960)),
        Scenario("b", "four distinct 1280×720 pictures a request", 4, (1280, 720)),
        Scenario("c", "one 1280×960 photo a request, 40 % repeated", 1, (1280, 960), repeat=0.4),
        Scenario("d", "one 1280×960 photo a request, 5 % broken or oversized", 1, (1280, 960), bad=0.05),
    )
}


@dataclass(frozen=True)
class RenderRequest:
    """One request's JSON body and what it carries."""

    body: bytes
    pictures: int
    #: Its readable pictures not sent before in its phase.
    distinct: int
    bad: bool = False


def requests_for(scenario: Scenario, phase: str, n: int, seed: int, model: str) -> list[RenderRequest]:
    """The phase's requests: the same for the same seed, and pictures no other phase has."""
    rng = random.Random(f"{seed}:{scenario.key}:{phase}")
    seen: list[bytes] = []
    out = []
    for _ in range(n):
        if rng.random() < scenario.bad:
            out.append(RenderRequest(_body([broken(rng)], model), 1, 0, bad=True))
            continue
        pictures, before = [], len(seen)
        for _ in range(scenario.pictures):
            if seen and rng.random() < scenario.repeat:
                pictures.append(rng.choice(seen))
            else:
                seen.append(scene_jpeg(rng, *scenario.size))
                pictures.append(seen[-1])
        out.append(RenderRequest(_body(pictures, model), len(pictures), len(seen) - before))
    return out


def broken(rng: random.Random) -> bytes:
    """A truncated JPEG (a third of one), or a PNG whose header claims 40,000 × 40,000 pixels."""
    if rng.random() < 0.5:
        good = scene_jpeg(rng, 1280, 960)
        return good[: len(good) // 3]
    return png_bomb(40_000, 40_000)


def _body(pictures: Sequence[bytes], model: str) -> bytes:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": _data_url(p)}} for p in pictures]
    parts.append({"type": "text", "text": "What is in this picture?"})
    body = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": parts}]}
    return json.dumps(body).encode()


def _data_url(picture: bytes) -> str:
    kind = "image/png" if picture.startswith(b"\x89PNG") else "image/jpeg"
    return f"data:{kind};base64,{base64.b64encode(picture).decode()}"


# -- the servers ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A renderer under test: where it answers, and the root of each kind of its processes."""

    name: str
    base: str
    roots: dict[str, int]

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far per process kind: each root's whole tree (children that exited included)."""
        return {kind: sum(p.cpu_s for p in tree(pid)) for kind, pid in self.roots.items()}

    def resident_mb(self) -> float:
        """Resident memory of every process of the server now (MB)."""
        return resident_mb([p.pid for pid in self.roots.values() for p in tree(pid)])


@contextmanager
def pinned(cores: int | None) -> Iterator[None]:
    """While the servers start, this thread on the machine's first `cores` CPUs: their processes, and every process
    or thread those start, inherit it (what `taskset -c` does); this thread as before afterwards. None: no pinning."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(before)[:cores])
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def vllm_server(model: Path, cores: int | None, logs: Path, venv: Path) -> Iterator[Server]:
    """`vllm launch render` from its own venv on a free port, until it answers."""
    port = free_port()
    with ExitStack() as stack:
        with pinned(cores):
            process = stack.enter_context(render_server(model, port, logs / "vllm.log", vllm=venv / "bin" / "vllm"))
        yield Server("vLLM", f"http://127.0.0.1:{port}", {"vLLM renderer": process.pid})


@contextmanager
def valkey(policy: str, maxmemory_mb: int) -> Iterator[tuple[int, int]]:
    """An embedded Valkey of this run's own, in memory only, as `stoker up` starts it: its pid and port."""
    with tempfile.TemporaryDirectory(prefix="stoker-render-valkey-") as data:
        keep = ApiSettings().heap_keep_mb if policy == "allkeys-lru" else 0  # a cache, as `stoker up` starts it
        proc, port = start_embedded(
            data_dir=Path(data), maxmemory_mb=maxmemory_mb, persist=False, policy=policy, keep_freed_mb=keep
        )
        try:
            yield proc.pid, port
        finally:
            proc.terminate()
            proc.wait(10)


#: The stack's settings for renders: the tiny VLM; decode's time limits (a picture's render included) as the tests
#: raise them on a CPU other work shares, so that a neighbour's burst is not counted as a render's failure.
STOKER_SETTINGS = {"STOKER_DECODE_SOFT_S": "20", "STOKER_DECODE_HARD_S": "25"}


#: The cache Valkey's memory: 2 GB, a picture's rendering 8 MB.
CACHE_MB = 2048
#: What fills the cache before a run (`fill`): one key, under a prefix stoker never reads.
FILLER = 8 * 1024 * 1024


def fill(port: int, maxmemory_mb: int) -> None:
    """Fill a cache Valkey to its memory, so that it evicts from the first render as a cache that has been running
    does: each picture's entry then takes memory an evicted one freed. Into an empty server, each entry is memory
    the server has never touched, and the first touch of a page is a fault and the page's zeroing: 1,960 faults a
    picture, measured on a 2-core VM at 5 ms of the Valkey's CPU when the machine had been quiet and at 20 ms just
    after vLLM's renderer had rendered 160 pictures (the kernel's `clear_page` 72 % of the Valkey's samples, the same
    faults). That is the cost of filling a cache once, not of a render: left in, it lands on whichever scenario
    runs first, at a price set by what ran before it."""
    filler = b"\0" * FILLER
    with redis.Redis(port=port) as client:
        for n in range(maxmemory_mb * 1024 * 1024 // FILLER + 8):  # past maxmemory: evicting
            client.set(f"bench-fill:{n}", filler)
        assert client.info("stats")["evicted_keys"] > 0, "the cache was filled without reaching its memory"


@contextmanager
def stoker_server(model: Path, cores: int | None, logs: Path) -> Iterator[Server]:
    """A pipeline-mode stack serving the model, over a store Valkey (noeviction) and a cache Valkey (allkeys-lru)."""
    with ExitStack() as stack:
        with pinned(cores):
            store_pid, store_port = stack.enter_context(valkey("noeviction", 2048))
            cache_pid, cache_port = stack.enter_context(valkey("allkeys-lru", CACHE_MB))
            fill(cache_port, CACHE_MB)
            settings = STOKER_SETTINGS | {
                "STOKER_MODEL": str(model),
                "STOKER_CACHE_URL": f"redis://127.0.0.1:{cache_port}/0",
            }
            running = stack.enter_context(
                bench_stack("pipeline", Device(), f"redis://127.0.0.1:{store_port}", logs, None, None, **settings)
            )
        roots = {_label(p.args): p.pid for p in running.procs}
        roots |= {"Valkey (store, broker)": store_pid, "Valkey (cache)": cache_pid}
        yield Server("stoker", running.base, roots)


def _label(args: Any) -> str:
    """`python -m stoker.cli worker cpu ...` → `cpu worker`; `... api --port N` → `api`."""
    words = [str(a) for a in args][3:]
    return f"{words[1]} worker" if words[0] == "worker" else words[0]


# -- the load ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One request's outcome: its status (None: no answer) and seconds from its arrival to its answer's last byte."""

    status: int | None
    latency_s: float
    error: str | None = None
    #: The start of a refusal's body (a 4xx or 5xx), to say what it was.
    detail: str = ""
    #: The answer's length in bytes (a 200's body is counted, not kept: `bench.rawload`).
    length: int = 0


async def _send(connections: Connections, request: bytes, since: float) -> Answer:
    try:
        reply = await connections.exchange(request, TIMEOUT_S)
    except (OSError, TimeoutError, ConnectionError, httptools.HttpParserError) as exc:
        return Answer(None, time.monotonic() - since, type(exc).__name__)
    detail = "" if reply.status == 200 else reply.body[:160].decode(errors="replace")
    return Answer(reply.status, time.monotonic() - since, None, detail, reply.length)


def closed_loop(base: str, bodies: Sequence[bytes], clients: int) -> list[Answer]:
    """`clients` clients, each sending its next request as soon as its last is answered."""
    connections = Connections(base, ok_body=False)
    requests = [connections.request("POST", PATH, body, "application/json") for body in bodies]
    answers: list[Answer | None] = [None] * len(requests)
    pending = iter(enumerate(requests))  # shared: each request is sent once

    async def client() -> None:
        for i, request in pending:
            answers[i] = await _send(connections, request, time.monotonic())

    async def main() -> None:
        await asyncio.gather(*(client() for _ in range(clients)))
        connections.close()

    asyncio.run(main())
    return [a for a in answers if a is not None]


def open_loop(base: str, bodies: Sequence[bytes], rate: float, seed: int) -> list[Answer]:
    """Each request at its arrival time (Poisson at `rate` a second), whatever the server is doing; its latency
    counted from the arrival, so a load generator running late is counted against the server, not hidden."""
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    for _ in bodies:
        at += rng.expovariate(rate)
        arrivals.append(at)
    connections = Connections(base, ok_body=False)
    requests = [connections.request("POST", PATH, body, "application/json") for body in bodies]

    async def one(request: bytes, due: float) -> Answer:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        return await _send(connections, request, due)

    async def main() -> list[Answer]:
        start = time.monotonic()
        answers = await asyncio.gather(*(one(r, start + a) for r, a in zip(requests, arrivals, strict=True)))
        connections.close()
        return list(answers)

    return asyncio.run(main())


# -- the phases ----------------------------------------------------------------------------------------------------


@dataclass
class Phase:
    """One server's share of one phase: what it was sent, what it answered, and what its processes spent meanwhile."""

    scenario: str
    server: str
    phase: str
    offered_per_s: float | None
    wall_s: float
    answers: list[Answer]
    pictures: int
    distinct: int
    cpu_s: dict[str, float]
    generator_cpu_s: float

    @property
    def renders(self) -> int:
        """The requests rendered (200)."""
        return sum(a.status == 200 for a in self.answers)

    def latency(self, q: float) -> float | None:
        """The q-quantile of the rendered requests' latencies (s)."""
        return percentile([a.latency_s for a in self.answers if a.status == 200], q)

    def statuses(self) -> Counter[str]:
        """Answers by status (`none`: no answer at all: a timeout or a dropped connection)."""
        return Counter(str(a.status) if a.status is not None else "none" for a in self.answers)


def measure(
    scenario: str,
    server: Server,
    phase: str,
    offered: float | None,
    requests: list[RenderRequest],
    send: Callable[[list[bytes]], list[Answer]],
) -> Phase:
    """Send a phase's requests to one server (`send`: the loop), reading its processes' CPU before and after."""
    before, generator, started = server.cpu_s(), time.process_time(), time.monotonic()
    answers = send([r.body for r in requests])
    wall = time.monotonic() - started
    spent = {k: v - before.get(k, 0.0) for k, v in server.cpu_s().items()}
    pictures, distinct = sum(r.pictures for r in requests), sum(r.distinct for r in requests)
    return Phase(
        scenario, server.name, phase, offered, wall, answers, pictures, distinct, spent, time.process_time() - generator
    )


@dataclass(frozen=True)
class Sizes:
    """Requests per phase."""

    closed: int
    open: int
    clients: int
    warm: int = 2


def sitting(scenario: Scenario, servers: Sequence[Server], sizes: Sizes, seed: int, model: str) -> list[Phase]:
    """One scenario on every server in one sitting: a closed loop each, then open loops at 50 % and 90 % of the
    first server's (vLLM's) closed-loop rate, the order flipped between the two so drift hits both."""
    requests = {
        p: requests_for(scenario, p, n, seed, model) for p, n in (("closed", sizes.closed), ("warm", sizes.warm))
    }
    for server in servers:  # first-of-a-kind costs (a processor loaded, a worker's first render) are not the run's
        closed_loop(server.base, [r.body for r in requests["warm"]], 1)
    phases = []
    for server in servers:
        send = functools.partial(_closed_from, server.base, sizes.clients)
        phases.append(measure(scenario.key, server, "closed", None, requests["closed"], send))
    rate = phases[0].renders / phases[0].wall_s
    for share, order in ((0.5, servers), (0.9, list(reversed(servers)))):
        load = requests_for(scenario, f"open{share}", sizes.open, seed, model)
        for server in order:
            send = functools.partial(_open_from, server.base, rate * share, seed)
            phases.append(measure(scenario.key, server, f"{share:.0%}", rate * share, load, send))
    return phases


@dataclass(frozen=True)
class Settled:
    """How a server was brought to its steady state before the scenarios (`settle`)."""

    server: str
    rounds: int
    resident_mb: tuple[float, float]
    #: CPU ms a picture, every process of the server, in the first and the last round.
    cpu_ms: tuple[float, float]

    @property
    def pictures(self) -> int:
        """The pictures sent to settle it."""
        return self.rounds * SETTLE_PICTURES


#: The settling rounds: distinct (a) pictures from `SETTLE_CLIENTS` clients, until a round grows the server's resident
#: memory by less than `SETTLE_GROWTH`, after at least `SETTLE_MIN` rounds (`SETTLE_MAX` at most). The least is 480
#: pictures: vLLM's processor cache holds about 165 of them (26 MB each in 4 GiB), and its CPU a picture was still
#: falling for a few hundred more after its memory had stopped growing (measured on a 2-core VM: 115 → 89 ms a
#: picture over 400 pictures alone; settled on memory alone after 280, it spent 142 ms a picture in (a)).
SETTLE_PICTURES, SETTLE_CLIENTS, SETTLE_GROWTH, SETTLE_MIN, SETTLE_MAX = 40, 8, 0.03, 12, 20


def settle(server: Server, seed: int, model: str, max_rounds: int = SETTLE_MAX) -> Settled:
    """Bring a server to the state a long-running one is in before it is measured: rounds of distinct pictures until
    its memory stops growing. vLLM's renderer keeps each picture's processor output in its processor cache (4 GiB by
    default) until the cache is full: while it fills, every picture's tensors land on memory the process has never
    touched, a page fault and a zeroed page at a time (measured on a 2-core VM: 2.4 → 7.5 GB resident over 400
    pictures, its system CPU 55 → 19 ms a picture, its renders/s 10.6 → 13.5); a server that has been running
    recycles memory its cache evicted. Measured cold, it would be charged for filling its cache once, as stoker's
    cache Valkey would (`fill`)."""
    cpu_ms: list[float] = []
    resident = [server.resident_mb()]
    while len(cpu_ms) < max_rounds:
        requests = requests_for(SCENARIOS["a"], f"settle{len(cpu_ms)}", SETTLE_PICTURES, seed, model)
        before = sum(server.cpu_s().values())
        closed_loop(server.base, [r.body for r in requests], SETTLE_CLIENTS)
        cpu_ms.append((sum(server.cpu_s().values()) - before) * 1000 / len(requests))
        resident.append(server.resident_mb())
        if steady(resident):
            break
    return Settled(server.name, len(cpu_ms), (resident[0], resident[-1]), (cpu_ms[0], cpu_ms[-1]))


def steady(resident: Sequence[float]) -> bool:
    """Whether a server is settled, by its resident memory before the first round and after each: at least
    `SETTLE_MIN` rounds, the last of which grew it by less than `SETTLE_GROWTH`."""
    rounds = len(resident) - 1
    return rounds >= SETTLE_MIN and resident[-1] - resident[-2] < SETTLE_GROWTH * resident[-2]


def _closed_from(base: str, clients: int, bodies: list[bytes]) -> list[Answer]:
    return closed_loop(base, bodies, clients)


def _open_from(base: str, rate: float, seed: int, bodies: list[bytes]) -> list[Answer]:
    return open_loop(base, bodies, rate, seed)


# -- the report ----------------------------------------------------------------------------------------------------


def summarise(phases: Sequence[Phase]) -> list[dict[str, Any]]:
    """One row per scenario and server: its closed-loop rate, its open-loop latencies, its CPU per picture over the
    three phases, and how its answers ended."""
    rows = []
    for scenario, server in dict.fromkeys((p.scenario, p.server) for p in phases):
        mine = {p.phase: p for p in phases if (p.scenario, p.server) == (scenario, server)}
        rows.append({"scenario": scenario, "server": server, **_row(mine)})
    return rows


def _row(mine: dict[str, Phase]) -> dict[str, Any]:
    closed, half, most = mine["closed"], mine["50%"], mine["90%"]
    every = list(mine.values())
    cpu: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    for phase in every:
        cpu.update(phase.cpu_s)
        statuses.update(phase.statuses())
    pictures, distinct = sum(p.pictures for p in every), sum(p.distinct for p in every)
    return {
        "renders_per_s": round(closed.renders / closed.wall_s, 2),
        "closed_p50_s": closed.latency(0.5),
        "closed_p99_s": closed.latency(0.99),
        "offered_per_s": [round(half.offered_per_s or 0.0, 2), round(most.offered_per_s or 0.0, 2)],
        "p50_p99_at_50_s": [half.latency(0.5), half.latency(0.99)],
        "p50_p99_at_90_s": [most.latency(0.5), most.latency(0.99)],
        "pictures": pictures,
        "distinct_pictures": distinct,
        "cpu_s_per_picture": round(sum(cpu.values()) / max(pictures, 1), 4),
        "cpu_s_per_distinct_picture": round(sum(cpu.values()) / max(distinct, 1), 4),
        "cpu_ms_per_picture_by_process": {k: round(v * 1000 / max(pictures, 1), 1) for k, v in cpu.most_common()},
        "load_generator_cpu_s_per_picture": round(sum(p.generator_cpu_s for p in every) / max(pictures, 1), 4),
        "statuses": dict(statuses),
        "4xx": sum(n for s, n in statuses.items() if s.startswith("4")),
        "5xx": sum(n for s, n in statuses.items() if s.startswith("5")),
        "no_answer": statuses.get("none", 0),
        "refusals": dict(Counter((a.error or a.detail)[:100] for p in every for a in p.answers if a.status != 200)),
    }


def _pair(p50_p99: list[float | None]) -> str:
    return " / ".join("n/a" if v is None else f"{v:.2f}" for v in p50_p99)


def table(rows: Sequence[dict[str, Any]], clients: int) -> str:
    """The results, one line per scenario and server, then each scenario's stoker ÷ vLLM."""
    head = (
        f"| scenario | server | renders/s, closed loop ({clients} clients) | p50 / p99 s at 50 % of vLLM's rate "
        "| p50 / p99 s at 90 % | CPU s per picture | CPU s per distinct picture | 4xx | 5xx | no answer |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        offered = r["offered_per_s"]
        lines.append(
            f"| ({r['scenario']}) | {r['server']} | {r['renders_per_s']:.2f} "
            f"| {_pair(r['p50_p99_at_50_s'])} ({offered[0]:.2f}/s) "
            f"| {_pair(r['p50_p99_at_90_s'])} ({offered[1]:.2f}/s) "
            f"| {r['cpu_s_per_picture']:.3f} | {r['cpu_s_per_distinct_picture']:.3f} "
            f"| {r['4xx']} | {r['5xx']} | {r['no_answer']} |"
        )
    for scenario, ratio in ratios(rows).items():
        lines.append(
            f"| ({scenario}) | **stoker ÷ vLLM** | **{ratio['renders']:.2f}×** | | p99 **{ratio['p99_at_90']:.2f}×** "
            f"| {ratio['cpu']:.2f}× | **{ratio['cpu_distinct']:.2f}×** | | | |"
        )
    return "\n".join(lines)


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per scenario, stoker's figures over vLLM's: renders/s, p99 at 90 %, CPU per picture and per distinct one."""
    found = {(r["scenario"], r["server"]): r for r in rows}
    out = {}
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        ours, theirs = found.get((scenario, "stoker")), found.get((scenario, "vLLM"))
        if ours is None or theirs is None:
            continue
        out[scenario] = {
            "renders": _over(ours["renders_per_s"], theirs["renders_per_s"]),
            "p99_at_90": _over(ours["p50_p99_at_90_s"][1], theirs["p50_p99_at_90_s"][1]),
            "cpu": _over(ours["cpu_s_per_picture"], theirs["cpu_s_per_picture"]),
            "cpu_distinct": _over(ours["cpu_s_per_distinct_picture"], theirs["cpu_s_per_distinct_picture"]),
        }
    return out


def _over(a: float | None, b: float | None) -> float:
    return round(a / b, 2) if a is not None and b else float("nan")


def by_process(rows: Sequence[dict[str, Any]]) -> str:
    """stoker's CPU ms per picture per process, per scenario; the load generator's beside it."""
    ours = [r for r in rows if r["server"] == "stoker"]
    kinds = list(dict.fromkeys(k for r in ours for k in r["cpu_ms_per_picture_by_process"]))
    lines = ["| process | " + " | ".join(f"({r['scenario']}) ms/picture" for r in ours) + " |"]
    lines.append("|---|" + "---|" * len(ours))
    for kind in kinds:
        cells = [f"{r['cpu_ms_per_picture_by_process'].get(kind, 0.0):.1f}" for r in ours]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append(
        "| (load generator) | " + " | ".join(f"{r['load_generator_cpu_s_per_picture'] * 1000:.1f}" for r in ours) + " |"
    )
    return "\n".join(lines)


# -- the profile ---------------------------------------------------------------------------------------------------


@dataclass
class Steps:
    """CPU seconds per step of a picture's way through stoker, in this process."""

    spent: dict[str, float] = field(default_factory=dict)

    def run(self, step: str, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)`, its CPU time (this process's) added to `step`."""
        started = time.process_time()
        try:
            return call(*args)
        finally:
            self.spent[step] = self.spent.get(step, 0.0) + time.process_time() - started


def profile(model: Path, n: int, seed: int) -> dict[str, Any]:
    """N distinct 1280×960 pictures through the steps stoker's CPU worker and API take for a render, in this process
    (one thread, as one pool child and the API's loop run them): CPU ms per picture per step, the Valkey's own for its
    writes and reads, the bytes each picture becomes, and the processor's hottest functions."""
    import torch  # loaded with the image processor already

    torch.set_num_threads(1)  # as `tasks.lifecycle` sets it in a CPU pool child
    keep_freed_memory(ApiSettings().heap_keep_mb, ApiSettings().heap_arenas)  # as the API and the CPU workers keep it
    renderer = Renderer(str(model), "bfloat16")
    assert renderer.preparer is not None, f"{model} reads no pictures"
    rng = random.Random(f"{seed}:profile")
    jpegs = [scene_jpeg(rng, 1280, 960) for _ in range(n + 1)]
    steps, processor = Steps(), cProfile.Profile(time.process_time)
    sizes: Counter[str] = Counter()
    with valkey("allkeys-lru", 2048) as (pid, port), redis.Redis(port=port) as client:
        _picture(renderer, steps, processor, client, jpegs[0], sizes)  # first-of-a-kind costs, not counted
        steps.spent.clear()
        sizes.clear()
        processor = cProfile.Profile(time.process_time)
        server_before = sum(p.cpu_s for p in tree(pid))
        for jpeg in jpegs[1:]:
            _picture(renderer, steps, processor, client, jpeg, sizes)
        steps.spent["Valkey: the write and the read (its own CPU)"] = sum(p.cpu_s for p in tree(pid)) - server_before
    return {
        "pictures": n,
        "cpu_ms_per_picture": {k: round(v * 1000 / n, 2) for k, v in steps.spent.items()},
        "bytes_per_picture": {k: v // n for k, v in sizes.items()},
        "processor_hottest": _hottest(processor, n),
    }


def _picture(
    renderer: Renderer,
    steps: Steps,
    processor: cProfile.Profile,
    client: redis.Redis[bytes],
    jpeg: bytes,
    sizes: Counter[str],
) -> None:
    """One picture the way a render takes it: the CPU worker's steps, then the API's."""
    assert renderer.preparer is not None
    rgb = steps.run("worker: decode the JPEG (full size, RGB)", decode_rgb, jpeg, DecodeParams())
    processor.enable()
    prepared = steps.run("worker: image processor (resize, rescale, normalise, tiles)", renderer.preparer.prepare, rgb)
    processor.disable()
    item = steps.run("worker: cast to vLLM's item (bfloat16)", idefics3_tensors, prepared.tensors, "bfloat16")
    picture = RenderedPicture.of_tensors(renderer.preparer.layout(prepared), item)
    entry = steps.run("worker: cache entry (msgpack, the mask as bits)", picture.to_bytes)
    steps.run("worker: cache write (client)", client.set, "render-profile", entry)
    found = steps.run("API: cache read (client)", client.get, "render-profile")
    assert found is not None
    back = steps.run("API: cache entry read back (msgpack, a view of its bytes)", RenderedPicture.from_bytes, found)
    wire = steps.run("API: item as sent (msgpack framing, base64 in pieces)", lambda: back.wire)
    answer = steps.run("API: features", features, ["0" * 64], [(0, 1)], [wire])
    body = steps.run("API: the answer's JSON (in pieces, as written)", request_json_pieces, {"features": answer})
    sizes.update({"JPEG": len(jpeg), "cache entry": len(entry), "answer's JSON": sum(len(piece) for piece in body)})


def _hottest(profiled: cProfile.Profile, n: int, top: int = 8) -> list[tuple[str, float]]:
    """The processor's functions with the most CPU of their own (ms per picture; CPU time, not wall time, so a busy
    machine does not inflate them)."""
    stats: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = pstats.Stats(profiled).stats  # type: ignore[attr-defined]
    own = sorted(((tt, where) for where, (_, _, tt, _, _) in stats.items()), reverse=True)[:top]
    return [(f"{func} ({Path(file).name}:{line})", round(tt * 1000 / n, 2)) for tt, (file, line, func) in own]


def profile_table(found: dict[str, Any]) -> str:
    """The profile as a table, and the processor's hottest functions as a line."""
    per = found["cpu_ms_per_picture"]
    total = sum(per.values())
    lines = [f"| step ({found['pictures']} distinct 1280×960 pictures, in-process) | CPU ms per picture | share |"]
    lines.append("|---|---|---|")
    lines += [f"| {step} | {ms:.1f} | {ms / total:.0%} |" for step, ms in per.items()]
    lines.append(f"| **all steps** | **{total:.1f}** | |")
    sizes = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in found["bytes_per_picture"].items())
    hot = ", ".join(f"`{name}` {ms:.1f} ms" for name, ms in found["processor_hottest"])
    return "\n".join(lines) + f"\n\nBytes per picture: {sizes}.\n\nThe processor's own time, hottest first: {hot}."


# -- the run -------------------------------------------------------------------------------------------------------

FULL = Sizes(closed=160, open=120, clients=8)
QUICK = Sizes(closed=40, open=30, clients=8)


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"fewer requests: {QUICK.closed} closed, {QUICK.open} open")
    p.add_argument("--scenarios", default="a,b,c,d", help="of a, b, c, d (comma-separated)")
    p.add_argument("--cores", type=int, default=None, help="start both servers on the first N cores (taskset)")
    p.add_argument("--clients", type=int, default=None, help="closed-loop clients (8)")
    p.add_argument("--requests", type=int, default=None, help="requests per closed-loop phase")
    p.add_argument("--open-requests", type=int, default=None, help="requests per open-loop phase")
    p.add_argument("--profile-pictures", type=int, default=12, help="pictures profiled in-process (0: none)")
    p.add_argument("--settle-rounds", type=int, default=SETTLE_MAX, help="at most this many settling rounds (0: none)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--model", type=Path, default=MODEL, help="the model directory both serve (the tiny VLM)")
    p.add_argument("--peer-venv", type=Path, default=PEER_VENV, help="vLLM's own venv (`make peer`)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def sizes_of(args: argparse.Namespace) -> Sizes:
    """The phases' sizes: the quick or the full ones, less what the command line says."""
    base = QUICK if args.quick else FULL
    return Sizes(args.requests or base.closed, args.open_requests or base.open, args.clients or base.clients)


def main(argv: Sequence[str] | None = None) -> int:
    """Both servers, every scenario asked for, the profile; the tables. 1 when a phase rendered nothing."""
    args = parser().parse_args(argv)
    scenarios = [SCENARIOS[k.strip()] for k in args.scenarios.split(",") if k.strip()]
    sizes, logs = sizes_of(args), args.out / "logs" / "render"
    logs.mkdir(parents=True, exist_ok=True)
    started, phases = time.monotonic(), []
    with ExitStack() as stack:
        servers = [
            stack.enter_context(vllm_server(args.model, args.cores, logs, args.peer_venv)),
            stack.enter_context(stoker_server(args.model, args.cores, logs)),
        ]
        settled = [settle(s, args.seed, args.model.name, args.settle_rounds) for s in servers if args.settle_rounds]
        for s in settled:
            print(f"settled: {s}", flush=True)
        for scenario in scenarios:
            print(f"({scenario.key}) {scenario.title}…", flush=True)
            phases += sitting(scenario, servers, sizes, args.seed, args.model.name)
            for row in summarise([p for p in phases if p.scenario == scenario.key]):
                print(f"  {row['server']}: {json.dumps({k: v for k, v in row.items() if k != 'refusals'})}", flush=True)
    found = profile(args.model, args.profile_pictures, args.seed) if args.profile_pictures else None
    rows = summarise(phases)
    text = report(args, rows, found, sizes, time.monotonic() - started, settled)
    args.out.mkdir(parents=True, exist_ok=True)
    facts = {"rows": rows, "ratios": ratios(rows), "profile": found, "phases": [_facts(p) for p in phases]}
    facts["settled"] = [asdict(s) for s in settled]
    (args.out / "render.json").write_text(json.dumps(facts, indent=1))
    (args.out / "render.md").write_text(text + "\n")
    print(f"\n{text}")
    return 1 if any(p.renders == 0 for p in phases) else 0


def _facts(phase: Phase) -> dict[str, Any]:
    facts = asdict(phase)
    facts["answers"] = [[a.status, round(a.latency_s, 3)] for a in phase.answers]
    return facts


def report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    found: dict[str, Any] | None,
    sizes: Sizes,
    wall_s: float,
    settled: Sequence[Settled] = (),
) -> str:
    """The run's head (when, where, what), the results, stoker's CPU by process, and the profile."""
    cores = f"both servers on {args.cores} core(s)" if args.cores else "both servers on every core"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = (
        f"`python -m bench.render {' '.join(sys.argv[1:])}` ({when}, {wall_s:.0f} s; {_host()}; commit {_commit()}; "
        f"{cores}; {sizes.closed} requests closed loop, {sizes.open} per open-loop phase)"
    )
    parts = [head, settled_line(settled), table(rows, sizes.clients)]
    parts += ["stoker's CPU per picture, by process:", by_process(rows)]
    refusals = {f"({r['scenario']}) {r['server']}": r["refusals"] for r in rows if r["refusals"]}
    if refusals:
        parts.append("Answers other than 200: " + json.dumps(refusals, ensure_ascii=False))
    if found is not None:
        parts.append(profile_table(found))
    return "\n\n".join(parts)


def settled_line(settled: Sequence[Settled]) -> str:
    """How each server was settled before the scenarios."""
    if not settled:
        return "Not settled (`--settle-rounds 0`): each server measured from its start."
    each = [
        f"{s.server} {s.pictures} pictures in {s.rounds} rounds, resident {s.resident_mb[0]:,.0f} → "
        f"{s.resident_mb[1]:,.0f} MB, {s.cpu_ms[0]:.0f} → {s.cpu_ms[1]:.0f} CPU ms a picture"
        for s in settled
    ]
    least, growth = SETTLE_MIN * SETTLE_PICTURES, f"{SETTLE_GROWTH * 100:.0f} %"
    return f"Settled first (≥ {least} distinct (a) pictures, until a round grows memory < {growth}): {'; '.join(each)}"


def _host() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{os.cpu_count()} cores"


def _commit() -> str:
    head = ROOT / ".git" / "HEAD"
    with contextlib.suppress(OSError):
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            return (ROOT / ".git" / ref[5:]).read_text().strip()[:7]
        return ref[:7]
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
