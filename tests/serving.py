"""Servers in a thread of the test process: an ASGI app under uvicorn, or a plain `http.server` handler (media
servers and webhook receivers that record what they were asked)."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import uvicorn

from workers.broker import free_port
from workers.procs import wait_for


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve app for the duration of the block; yields its base URL (http://127.0.0.1:PORT)."""
    port = free_port()
    with serve_with(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))) as base:
        yield base


@contextmanager
def serve_with(server: uvicorn.Server) -> Iterator[str]:
    """Run a uvicorn server (its config on 127.0.0.1 and a port of its own) for the duration of the block; yields
    its base URL."""
    port = server.config.port
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn", [])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def serve_handler(host: str, handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None = None) -> Iterator[int]:
    """Serve handler on host (HTTPS with tls) for the duration of the block; yields the port it got."""
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def answers(port: int) -> bool:
    """Whether an API on this loopback port answers `/healthz` (a readiness probe to wait on)."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
