"""An ASGI app served by uvicorn on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from workers.broker import free_port
from workers.procs import wait_for


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve app for the duration of the block; yields its base URL (http://127.0.0.1:PORT)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn", [])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
