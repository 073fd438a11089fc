"""The API process: `ApiSettings`, composed of the common settings and the API's own parts."""

from __future__ import annotations

from pydantic import Field

from stoker.core.tenancy import TenantLimits
from stoker.settings.base import MiB, SettingsPart
from stoker.settings.batch_api import BatchApiSettings
from stoker.settings.benchmark import SyncBaselineApiSettings
from stoker.settings.common import CommonSettings
from stoker.settings.tenancy import TenancySettings


class InputSizeSettings(SettingsPart):
    """Which inputs are small and which large: small ones' stages are taken first (Redis broker)."""

    small_pixels: int = Field(
        1_500_000,
        ge=0,
        description="A picture of at most this many pixels is small: its stages are taken before larger inputs' "
        "(Redis broker; the reaper's `small_first_max_age_s` bounds how long a larger one waits for that).",
    )
    large_pixels: int = Field(6_000_000, ge=0, description="A picture above this many pixels is large: taken last.")
    small_audio_s: float = Field(
        10.0, ge=0, description="A recording of at most this many seconds is small: transcribed before longer ones."
    )
    large_audio_s: float = Field(60.0, ge=0, description="A recording above this many seconds is large.")


class RequestLimitSettings(SettingsPart):
    """How large a request may be, and how many inputs it may carry."""

    max_body_bytes: int = Field(
        20 * MiB,
        ge=1024,
        description="Request body limit, from Content-Length or while streaming (413 `payload_too_large`).",
    )
    max_images: int = Field(4, ge=0, description="Images per job (more: 422 `too_many_inputs`).")
    max_audio: int = Field(1, ge=0, description="Audio inputs per job.")
    max_video: int = Field(1, ge=0, description="Video inputs per job.")
    max_prompt_chars: int = Field(
        32_000,
        ge=1,
        description="The longest prompt, in characters; a chat's counts all its prompt material: every turn's text, "
        "the tool calls its turns carry (ids, names, arguments), its tools' JSON and its `response_format` (over it: "
        "422 `prompt_too_long`, before anything is built from it). A multipart field over 4 × this many bytes is "
        "refused by the parser (400 `bad_request`).",
    )
    truncate_prompts: bool = Field(
        False,
        description="A prompt over the model's context is trimmed to fit (attachment text first, then the oldest "
        "turns, pictures, the last turn's text; a completion keeps its end) instead of refused 400 "
        "`context_length_exceeded`, and its answer says so (`x-stoker-truncated: true`, `result.truncated`); a "
        "request's `stoker_truncate` decides for itself.",
    )


class DeadlineSettings(SettingsPart):
    """How long a request may wait, and a job's deadline."""

    max_long_poll_s: float = Field(
        30.0,
        ge=0,
        description="The longest `?wait=` is honoured; every wait of an API process shares one announcement listener.",
    )
    deadline_ms: int = Field(
        60_000, ge=100, description="A job's deadline when the request names none (form field or JSON `deadline_ms`)."
    )
    max_deadline_ms: int = Field(3_600_000, ge=100, description="The most a request's `deadline_ms` may ask.")
    infer_reserve_ms: int = Field(
        5_000,
        ge=0,
        description="Kept back from the deadline for waiting on and running the model (at most half the "
        "deadline): when the rest is spent, the job goes to inference with the inputs that are ready.",
    )


class ApiTokenizeSettings(SettingsPart):
    """Tokenizing in the API: which jobs, on how many threads."""

    api_tokenize: bool = Field(
        True,
        description="Tokenize jobs with nothing to preprocess (text only, or every input cached) here, off the "
        "event loop, and send them to the inference queue in one hop; needs the model's tokenizer files on the "
        "API's host.",
    )
    api_tokenize_threads: int = Field(
        4,
        ge=1,
        le=64,
        description="Threads the API tokenizes on (text-only and cached jobs, `api_tokenize`). Each one that has "
        "tokenized keeps its own native memory (several MB), so a few bound the API's size; too few make requests "
        "queue for them under load (docs/benchmarks.md, the cost of a job).",
    )
    api_tokenize_cache_min_chars: int = Field(
        1024,
        ge=0,
        description="A job with no attachment and no tools whose text (prompt, or every turn of a chat with the tool "
        "calls its turns carry) is at most this long is tokenized on the API's event loop, without the stage "
        "cache: rendering and tokenizing it again costs less CPU than looking it up and writing it back (0: every "
        "prompt goes through the cache). A longer one is tokenized on the API's tokenizing threads.",
    )


class ApiServingSettings(SettingsPart):
    """The interactive docs, a stop's grace for waiting requests, and SSE keep-alives."""

    api_docs: bool = Field(
        True,
        description="The interactive API docs (`/docs`, `/redoc`) and `/openapi.json`; turn off where the schema "
        "should not be public.",
    )
    stop_grace_s: float = Field(
        30.0,
        ge=0,
        description="On a stop signal, a request waiting on its job (a chat answer, streamed or not, a `?wait=` "
        "submission or long-poll) goes on this long for its job to end (the server takes no new connections "
        "meanwhile); one still waiting then ends: a stream with a `server_stopping` error event, a chat with a 503 "
        "`server_stopping`, a `?wait=` with the job as it stands; its job goes on (read it at `/v1/jobs/{id}`). "
        "Keep it under the stop timeout of whatever stops the API (Kubernetes' `terminationGracePeriodSeconds`, "
        "Compose's `stop_grace_period`).",
    )
    sse_keepalive_s: float = Field(
        10.0,
        gt=0,
        description="A streamed chat answer (`stream: true`) sends an SSE comment this often while it waits, so "
        "proxies keep the connection open during preprocessing.",
    )


class ConnectionLimitSettings(SettingsPart):
    """What one connection may cost the API's one event loop (`api.server` builds uvicorn's config from these: the
    server `stoker api` runs, as `stoker up` and every deploy file do, uvicorn over httptools)."""

    max_header_bytes: int = Field(
        16 * 1024,
        ge=1024,
        description="The request line and headers together; a longer head is refused 431 `headers_too_large` once "
        "this much has arrived.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A request's head must be in this long after the connection opened (or its first byte, on a "
        "kept-alive connection); a later one is answered 408 `request_timeout` and closed.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request's body must be in this long after its head, plus the time its bytes so far take at "
        "`body_min_bytes_per_s` (a large upload on a slow link gets its time, a trickle does not); a later one is "
        "answered 408 `request_timeout` and closed (closed only, where its answer was sent before its body was read).",
    )
    body_min_bytes_per_s: int = Field(
        64 * 1024,
        ge=0,
        description="The slowest pace a request's body may arrive at past `body_timeout_s` (0: the body must be in "
        "within `body_timeout_s`, whatever its size).",
    )
    keep_alive_s: int = Field(
        75,
        ge=1,
        description="An idle kept-alive connection is closed after this long. Longer than clients keep theirs idle "
        "(httpx and the openai client: 5 s; nginx's and load balancers' upstream pools: 60 s), so a client always "
        "retires a connection before the server closes it: a server that closes first races the client's next "
        "request on it (sent as the close crosses it, it fails with a reset, and a POST's client cannot tell whether "
        "its job was made).",
    )
    access_log: bool = Field(
        False,
        description="uvicorn's access log, a line per HTTP request (off: it cost the API a few per cent of its CPU "
        "per job; every job still leaves its one line when it ends, and request latency is a metric).",
    )
    max_json_values: int = Field(
        16_384,
        ge=256,
        description="A JSON body may hold this many values (`,` `[` `{` outside strings, counted as it streams in: "
        "a prompt's commas are no values); past that it is refused 413 before it is parsed: what parsing costs, all "
        "of it holding the GIL, grows with the values, not the bytes (base64 media stays within `max_body_bytes`).",
    )


# Its parts, in the order docs/configuration.md lists their settings (after the class's own).
class ApiSettings(
    CommonSettings,
    InputSizeSettings,
    RequestLimitSettings,
    DeadlineSettings,
    SyncBaselineApiSettings,
    TenancySettings,
    ApiTokenizeSettings,
    ApiServingSettings,
    ConnectionLimitSettings,
    BatchApiSettings,
):
    """The API process."""

    host: str = Field("127.0.0.1", description="The address `stoker api` serves on (`--host`).")
    port: int = Field(8000, description="The API's public port (`--port`).")
    api_metrics_port: int = Field(
        9105,
        ge=0,
        le=65535,
        description="The API's Prometheus metrics, on a listener of their own at `metrics_host` (0: none): never "
        "on `port`, which faces clients.",
    )
    store_timeout_s: float = Field(
        3.0,
        gt=0,
        description="The API waits this long on its store (connect, one answer) and then answers 503 "
        "`broker_unavailable`.",
    )

    @property
    def tenant_limits(self) -> TenantLimits:
        """What each tenant may do."""
        return TenantLimits(
            self.rate_limit_per_s,
            self.rate_limit_burst,
            self.max_jobs_in_flight,
            share_capacity=self.cpu_queue_limit if self.tenant_max_share > 0 else 0,
            max_share=self.tenant_max_share,
            max_stored_bytes=self.tenant_max_stored_bytes,
            max_result_bytes=self.tenant_max_result_bytes,
        )
