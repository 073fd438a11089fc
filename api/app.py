"""The FastAPI application: create_app(settings) builds the API's context (`api.context`) and wires the routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.audio import router as audio_router
from api.chat import router as chat_router
from api.completions import router as completions_router
from api.context import ApiContext, close_clients
from api.files import router as files_router
from api.headers import SHOULD_RETRY, retry_headers
from api.limits import BodyLimitMiddleware
from api.openai_batch_feeder import OpenAIBatchFeeder
from api.openai_batches import router as openai_batches_router
from api.render import router as render_router
from api.responses import router as responses_router
from api.routes import router
from api.tokenization import router as tokenization_router
from stoker.adapters.cache import StageCache
from stoker.adapters.heap import keep_freed_memory
from stoker.adapters.metrics import REQUESTS, serve_api_metrics
from stoker.adapters.store.clients import StoreOutOfMemory, async_store_client
from stoker.adapters.tracing import instrument_celery, setup_tracing
from stoker.core.errors import BrokerUnavailable, PayloadTooLarge, StokerError, StoreFull, Unauthorized, error_envelope
from stoker.settings import ApiSettings
from tasks.pipeline import Submitter

log = logging.getLogger(__name__)


def create_app(settings: ApiSettings | None = None, submitter: Submitter | None = None) -> FastAPI:
    """Build the API for these settings; the submitter is the seam to the queue (Celery by default)."""
    settings = settings or ApiSettings()
    keep_freed_memory(settings.heap_keep_mb, settings.heap_arenas)
    if setup_tracing("stoker-api", settings.trace_exporter, settings.trace_file):
        instrument_celery()  # the job's trace context rides in the headers of the messages it publishes
    context = ApiContext.build(settings, submitter)
    shown = settings.api_docs
    app = FastAPI(
        title="stoker",
        version="0.1.0",
        lifespan=_lifespan(context),
        docs_url="/docs" if shown else None,
        redoc_url="/redoc" if shown else None,
        openapi_url="/openapi.json" if shown else None,
    )
    app.state.context = context  # read back, typed, by `api.context.api_context`
    # A file upload streams to storage: its own, larger limit (with room for the multipart framing).
    uploads = {"/v1/files": settings.files_max_bytes + 64 * 1024}
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, per_path=uploads)
    app.add_middleware(RequestTimer)
    app.include_router(router)
    app.include_router(chat_router)
    app.include_router(audio_router)
    app.include_router(completions_router)
    app.include_router(files_router)
    app.include_router(openai_batches_router)
    app.include_router(render_router)
    app.include_router(responses_router)
    app.include_router(tokenization_router)
    _add_error_handlers(app)
    return app


#: How long the app's shutdown waits for its background tasks to stop once cancelled.
SHUTDOWN_WAIT_S = 5.0


def _lifespan(context: ApiContext) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """While the app serves: the queue monitor samples, the tokenizer loads, announcements are listened to (over
    an asyncio client of the serving loop's own); then every client is closed."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        listener = async_store_client(context.settings)
        settings = context.settings
        stop_metrics = serve_api_metrics(settings.api_metrics_port, settings.metrics_host, context.metrics)
        background = [
            asyncio.create_task(context.monitor.run()),
            asyncio.create_task(asyncio.to_thread(context.prompts.load)),
            asyncio.create_task(context.announcements.run(listener)),
        ]
        if settings.batch_feeder:
            background.append(asyncio.create_task(OpenAIBatchFeeder(context).run()))
        background.append(asyncio.create_task(_write_cache_counts(context.cache)))
        yield
        for task in background:
            task.cancel()
        # Stopped before their clients close under them, within a bound: a task that outlived its cancel would
        # otherwise hold up the serving loop's own shutdown.
        await asyncio.wait(background, timeout=SHUTDOWN_WAIT_S)
        context.cache.defer_counts(None)
        await asyncio.to_thread(context.cache.write_counts)  # what was counted since the last write
        if stop_metrics:
            stop_metrics()
        await listener.aclose()  # type: ignore[attr-defined]  # redis>=5 has it; the stubs lag
        await context.loop.aclose()
        close_clients(context)

    return lifespan


#: How long the API keeps the stage cache's counts (a hit per cached submission) before writing them.
CACHE_COUNTS_EVERY_S = 1.0


async def _write_cache_counts(cache: StageCache) -> None:
    """Write the cache's counts (`StageCache.defer_counts`) a second after the first one since the last write:
    one round trip a second under load instead of one per submission, and no wake-up while nothing is counted."""
    loop, counted = asyncio.get_running_loop(), asyncio.Event()
    cache.defer_counts(lambda: loop.call_soon_threadsafe(counted.set))
    while True:
        await counted.wait()
        await asyncio.sleep(CACHE_COUNTS_EVERY_S)
        counted.clear()  # before the write takes them: a count after it is announced again
        await asyncio.to_thread(cache.write_counts)


class RequestTimer:
    """Request latency by route template (not raw path: ids would explode the label set) and status, up to the
    response's head (a streamed answer counts until it starts).

    A plain ASGI middleware, not Starlette's `BaseHTTPMiddleware` (`app.middleware("http")`): that one runs every
    request's app in a task of its own behind memory streams, which cost the API more CPU per job than the metric
    is worth, and hides the client's `http.disconnect` from a waiting route (`api.disconnects`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; observe when its response starts."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", "unmatched")
                elapsed = time.perf_counter() - started
                REQUESTS.labels(scope["method"], route, str(message["status"])).observe(elapsed)
            await send(message)

        await self.app(scope, receive, timed)


def error_response(exc: StokerError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The structured error envelope with the error's HTTP status."""
    return JSONResponse(exc.envelope(), status_code=exc.http_status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StokerError)
    async def stoker_error(_: Request, exc: StokerError) -> JSONResponse:
        return error_response(exc, _error_headers(exc))

    @app.exception_handler(StoreOutOfMemory)
    async def store_full(_: Request, exc: redis.RedisError) -> JSONResponse:
        full = StoreFull("the job store is full: try again soon")
        return error_response(full, _error_headers(full))

    @app.exception_handler(redis.RedisError)
    async def store_error(_: Request, exc: redis.RedisError) -> JSONResponse:
        # a stopped, partitioned or restarting store: the client should come back, not see a 500
        log.warning("job store unavailable: %r", exc)
        unavailable = BrokerUnavailable("the job store cannot be reached")
        return error_response(unavailable, _error_headers(unavailable))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        body = error_envelope(422, "invalid_request", f"{where}: {err['msg']}", param=where)
        return JSONResponse(body, status_code=422, headers={SHOULD_RETRY: "false"})

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        body = error_envelope(exc.status_code, code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers={SHOULD_RETRY: "false"})


def _error_headers(exc: StokerError) -> dict[str, str]:
    """What a client needs besides the body: whether a retry can help and when to come back (transient), the
    auth scheme to use (401)."""
    headers = retry_headers(exc)
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="stoker"'
    if isinstance(exc, PayloadTooLarge):  # refused mid-body: closing spares reading (and discarding) the rest
        headers["Connection"] = "close"
    return headers
