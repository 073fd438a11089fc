"""How the API is served: uvicorn's config built from settings in one place, so that `stoker api` (what `stoker up`,
the Dockerfile, Compose and Kubernetes all run) bounds what one connection may cost the one event loop.

uvicorn's defaults bound nothing of a request's head: httptools (its default parser) buffers a header value or a
request target of any length, at a cost that grows with the square of its length (a 64 MiB header held the loop
for seconds), and no clock limits how long a head, or a body, may take to arrive. `HeadBoundedProtocol` is uvicorn's
httptools protocol with these bounds (in `api.uvicorn_server`, the one module that overrides uvicorn's hooks).
httptools, not h11: h11 bounds a head itself, but parsing and writing HTTP in pure Python took about a seventh of
the API's CPU per job (`python -m bench.cost`'s profile), httptools' C parser a fraction of that.
"""

from __future__ import annotations

import logging
import resource

from fastapi import FastAPI

from api.app import create_app
from api.context import context_of
from api.uvicorn_server import ApiServer, ApiServerConfig, HeadBoundedProtocol
from stoker.settings import ApiSettings

log = logging.getLogger(__name__)


def serve(settings: ApiSettings) -> None:
    """Serve the API for these settings until a signal stops it."""
    open_files_up_to_hard_limit()
    app = create_app(settings)
    ApiServer(server_config(settings, app), on_stop=context_of(app).announcements.stop).run()


def open_files_up_to_hard_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (the most the operator allows).

    Every client connection holds a descriptor for as long as it is kept alive (`keep_alive_s`, longer than its
    clients keep it), and many systems start a service at a soft limit of 1024: past it, asyncio's server stops
    accepting connections for a second at a time. A hard limit of "unlimited" is not taken literally (Linux refuses
    a soft limit over `fs.nr_open`): the soft limit is then left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)


def server_config(settings: ApiSettings, app: FastAPI | None = None) -> ApiServerConfig:
    """uvicorn's config for the API (its app built from settings unless given): httptools with a bounded head,
    deadlines on the head and the body, and no WebSocket protocol (no route serves one)."""
    return ApiServerConfig(
        create_app(settings) if app is None else app,
        header_timeout_s=settings.header_timeout_s,
        max_head_bytes=settings.max_header_bytes,
        body_timeout_s=settings.body_timeout_s,
        body_min_bytes_per_s=settings.body_min_bytes_per_s,
        host=settings.host,
        port=settings.port,
        http=HeadBoundedProtocol,
        ws="none",
        timeout_keep_alive=settings.keep_alive_s,
        access_log=settings.access_log,
        # No `limit_concurrency`: uvicorn counts open connections against it, so connections that trickle their
        # heads would get every other client a 503 until the header timeout closes them.
    )
