"""`stoker up`'s embedded broker leaves nothing behind: it writes no file while it runs, and its directory is gone
once the stack has stopped."""

from __future__ import annotations

import redis

from stoker.settings import StackSettings
from workers.broker import free_port
from workers.stack import Stack, _ensure_broker


def test_the_embedded_broker_keeps_jobs_in_memory_and_its_directory_goes_with_the_stack() -> None:
    nobody = f"redis://127.0.0.1:{free_port()}"
    settings = StackSettings(broker_url=f"{nobody}/0", result_url=f"{nobody}/1", cache_url=f"{nobody}/2")
    stack = Stack(tether=lambda: None)
    try:
        urls = _ensure_broker(settings, stack)
        (data_dir,) = stack.scratch
        assert data_dir.is_dir()
        with redis.Redis.from_url(urls["STOKER_RESULT_URL"]) as store:
            store.hset("stoker:job:" + "0" * 32, mapping={"prompt": "private", "tenant": "acme"})
            store.set("stoker:blob:" + "1" * 64, b"an upload")
            assert store.hget("stoker:job:" + "0" * 32, "prompt") == b"private"
        assert list(data_dir.rglob("*")) == []  # no AOF, no snapshot: job records and uploads never touch the disk
    finally:
        stack.stop(grace_s=10)
    assert stack.procs["valkey"].poll() is not None
    assert not data_dir.exists()
