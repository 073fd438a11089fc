"""`stoker up`'s embedded servers: the broker and job store never evict and the stage cache on a server of its own
does, so a full cache refuses no job; they write no file while they run, and their directories are gone once the
stack has stopped."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from rich.console import Console

from api.app import create_app
from stoker.adapters.cache import StageCache
from stoker.core.cachekeys import CacheAddress
from stoker.settings import ApiSettings, StackSettings
from tests.fleet import client_context
from tests.integration.conftest import SpySubmitter
from workers import stack as stack_module
from workers.broker import free_port, start_embedded
from workers.procs import wait_for
from workers.stack import BROKER, CACHE, Stack, _ensure_broker

#: The embedded servers' limits here: the store's smallest, and a cache a quarter of it.
STORE_MB, CACHE_MB = 64, 16


@pytest.fixture
def embedded() -> Iterator[tuple[StackSettings, Stack]]:
    """`stoker up`'s embedded servers, as it starts them where nothing answers, with small limits."""
    nobody = f"redis://127.0.0.1:{free_port()}"
    settings = StackSettings(
        broker_url=f"{nobody}/0",
        result_url=f"{nobody}/1",
        cache_url=f"{nobody}/2",
        embedded_maxmemory_mb=STORE_MB,
        embedded_cache_maxmemory_mb=CACHE_MB,
    )
    stack = Stack(tether=lambda: None)
    try:
        _ensure_broker(settings, stack)
        yield settings, stack
    finally:
        stack.stop(grace_s=10)


def test_the_embedded_servers_keep_jobs_in_memory_and_their_directories_go_with_the_stack() -> None:
    nobody = f"redis://127.0.0.1:{free_port()}"
    settings = StackSettings(broker_url=f"{nobody}/0", result_url=f"{nobody}/1", cache_url=f"{nobody}/2")
    stack = Stack(tether=lambda: None)
    try:
        urls = _ensure_broker(settings, stack)
        assert set(stack.procs) == {BROKER, CACHE}
        assert len(stack.scratch) == 2
        assert all(directory.is_dir() for directory in stack.scratch)
        with redis.Redis.from_url(urls["STOKER_RESULT_URL"]) as store:
            store.hset("stoker:job:" + "0" * 32, mapping={"prompt": "private", "tenant": "acme"})
            store.set("stoker:blob:" + "1" * 64, b"an upload")
            assert store.hget("stoker:job:" + "0" * 32, "prompt") == b"private"
        with redis.Redis.from_url(urls["STOKER_CACHE_URL"]) as cache:
            cache.set("stoker:cache:page", b"a decoded page")
        # No AOF, no snapshot: job records, uploads and cached pages never touch the disk.
        assert [list(directory.rglob("*")) for directory in stack.scratch] == [[], []]
    finally:
        stack.stop(grace_s=10)
    assert all(proc.poll() is not None for proc in stack.procs.values())
    assert not any(directory.exists() for directory in stack.scratch)


def test_the_store_never_evicts_and_the_cache_on_its_own_server_does(embedded: tuple[StackSettings, Stack]) -> None:
    settings, _ = embedded
    assert settings.cache_url.rsplit(":", 1)[1] != settings.result_url.rsplit(":", 1)[1]  # two servers
    for url, policy, limit_mb in (
        (settings.result_url, "noeviction", STORE_MB),
        (settings.cache_url, "allkeys-lru", CACHE_MB),
    ):
        with redis.Redis.from_url(url) as server:
            memory = server.info("memory")
            assert (memory["maxmemory_policy"], memory["maxmemory"]) == (policy, limit_mb << 20), url


def _faults_per_write(keep_freed_mb: int) -> float:
    """The page faults an embedded cache takes per 8 MiB entry written (and read) once it evicts: 2,048 pages each."""
    proc, port = start_embedded(persist=False, maxmemory_mb=64, policy="allkeys-lru", keep_freed_mb=keep_freed_mb)
    try:
        cache = StageCache.connect(ApiSettings(cache_url=f"redis://127.0.0.1:{port}/0"))
        value = os.urandom(8 << 20)
        for n in range(12):  # past its memory: evicting
            assert cache.put_bytes(_address(n), value)
        before = _faults(proc.pid)
        for n in range(12, 32):
            assert cache.put_bytes(_address(n), value)
            assert cache.get_bytes(_address(n)) == value
        return (_faults(proc.pid) - before) / 20
    finally:
        proc.terminate()
        proc.wait(10)


def _faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_an_embedded_cache_keeping_its_freed_memory_writes_entries_into_it() -> None:
    # A cache runs full and frees an entry of megabytes for each it writes; `stoker up` starts its embedded cache
    # with glibc's heap keeping freed memory (`freed_memory_environment`), so the next entry lands in it instead of
    # fresh pages (measured: about 410 faults an entry with glibc's defaults, 0 to 103 kept).
    handed_back, kept = _faults_per_write(0), _faults_per_write(512)
    assert kept < handed_back / 2, (kept, handed_back)


def _address(n: int) -> CacheAddress:
    return CacheAddress(stage="decode", version="1", digest=f"{n:064x}", fingerprint="f", scope="tenant")


def test_a_cache_filled_past_its_memory_is_evicted_and_never_refuses_a_job(
    embedded: tuple[StackSettings, Stack],
) -> None:
    """Decoded pages and prepared pictures, distinct and large, past what the cache may hold: the cache forgets the
    oldest, the store's memory (what `store_full` reads) stays its own, and every job is admitted and kept."""
    stack_settings, _ = embedded
    urls = {name: getattr(stack_settings, name) for name in ("broker_url", "result_url", "cache_url")}
    settings = ApiSettings(auth=False, **urls)
    cache = StageCache.connect(settings)
    values = 5 * CACHE_MB  # 1 MiB each: five times the cache, more than the store's whole memory
    with TestClient(create_app(settings, submitter=SpySubmitter(forward=False))) as api:
        jobs, kept = [], []
        for n in range(values):
            kept.append(cache.put_bytes(_address(n), n.to_bytes(4, "big") + os.urandom((1 << 20) - 4)))
            if n % 8 == 0:
                answer = api.post("/v1/jobs", data={"prompt": f"page {n}"})
                assert answer.status_code == 202, answer.text
                jobs.append(answer.json()["id"])
        filled = time.time()
        monitor = client_context(api).monitor
        wait_for(lambda: bool(monitor.memory and monitor.memory.at > filled), 15, "a memory sample after the fill", [])
        assert monitor.store_full() is None
        assert monitor.memory is not None
        assert monitor.memory.used < STORE_MB << 19  # the store's memory alone: under half of it
        answer = api.post("/v1/jobs", data={"prompt": "after the fill"})
        assert answer.status_code == 202, answer.text
        jobs.append(answer.json()["id"])
        for job in jobs:  # nothing lost from the store
            assert api.get(f"/v1/jobs/{job}").status_code == 200, job
    assert all(kept)  # the cache made room for every value: it evicted instead of refusing writes
    assert cache.redis is not None
    assert int(cache.redis.info("stats")["evicted_keys"]) > 0
    assert cache.get_bytes(_address(0)) is None  # the least recently used went
    last = cache.get_bytes(_address(values - 1))
    assert last is not None  # the most recent stayed
    assert last[:4] == (values - 1).to_bytes(4, "big")


def _said_at_startup(settings: StackSettings, monkeypatch: pytest.MonkeyPatch) -> str:
    """What `stoker up` prints while it finds its broker, store and cache (a broker answers: nothing is started)."""
    said = io.StringIO()
    monkeypatch.setattr(stack_module, "console", Console(file=said, width=400))
    assert _ensure_broker(settings, Stack(tether=lambda: None)) == {}
    return said.getvalue()


def test_a_cache_on_the_store_s_server_is_warned_about_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    base, broker = os.environ["STOKER_TEST_REDIS"], os.environ["STOKER_BROKER_URL"]
    shared = _said_at_startup(
        StackSettings(broker_url=broker, result_url=f"{base}/13", cache_url=f"{base}/11"), monkeypatch
    )
    assert "the stage cache" in shared
    assert "store_full" in shared
    assert "allkeys-lru" in shared
    apart = StackSettings(broker_url=broker, result_url=f"{base}/13", cache_url="redis://cache.invalid:6379/0")
    assert _said_at_startup(apart, monkeypatch) == ""
    off = StackSettings(broker_url=broker, result_url=f"{base}/13", cache_url=f"{base}/11", cache_enabled=False)
    assert _said_at_startup(off, monkeypatch) == ""  # no cache, nothing shared
