"""The one error taxonomy: every failure that reaches a job record or a client is one of these."""

from __future__ import annotations

from typing import Any, ClassVar


class StokerError(Exception):
    """Something went wrong in stoker."""

    code: ClassVar[str] = "internal_error"
    #: A permanent error is not retried: the input is bad, or the request can never succeed.
    permanent: ClassVar[bool] = True
    #: HTTP status when the error reaches a client synchronously.
    http_status: ClassVar[int] = 500

    def __init__(self, message: str | None = None, *, stage: str | None = None, param: str | None = None) -> None:
        self.message = message or (self.__doc__ or self.code).strip()
        self.stage = stage
        #: The request field at fault, where one is (OpenAI's `param`).
        self.param = param
        super().__init__(self.message)

    def to_dict(self) -> dict[str, Any]:
        """The structured form that job records and API answers carry."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.stage:
            body["stage"] = self.stage
        return body

    def envelope(self) -> dict[str, Any]:
        """The body of an HTTP error answer: stoker's code and message in OpenAI's error shape, so that both the
        job API's clients and OpenAI's clients (which raise their typed exceptions from it) read it."""
        return error_envelope(self.http_status, self.code, self.message, param=self.param, stage=self.stage)


#: OpenAI's error `type` for each HTTP status an answer can have (5xx: server_error).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_envelope(
    status: int, code: str, message: str, *, param: str | None = None, stage: str | None = None
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` (and the stage, where there is one)."""
    body: dict[str, Any] = {
        "message": message,
        "type": _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": param,
        "code": code,
    }
    if stage:
        body["stage"] = stage
    return {"error": body}


class InputError(StokerError):
    """The input cannot be processed."""

    code = "invalid_input"
    http_status = 400


class InvalidRequest(InputError):
    """The request is malformed or misses a required field."""

    code = "invalid_request"
    http_status = 422


class TooManyTokens(InputError):
    """The request asks for more new tokens than this server gives one answer (its cap)."""

    code = "max_tokens_over_cap"
    http_status = 400


class PromptTooLong(InvalidRequest):
    """The prompt material (every turn's text, its tool calls, the tools, the answer's schema) passes the limit."""

    code = "prompt_too_long"


class ContextLengthExceeded(InputError):
    """The prompt has more tokens than the model's context leaves it: it is refused, never cut (vLLM and OpenAI
    answer 400 `context_length_exceeded`)."""

    code = "context_length_exceeded"
    http_status = 400


class AnswerTooLarge(InputError):
    """The answers asked for would hold more token entries (n × max_tokens × (top_logprobs + 1)) than allowed."""

    code = "answer_too_large"
    http_status = 400


class UnsupportedParameter(InputError):
    """The request asks for something this server does not serve (a legacy completion's `echo` or `suffix`, several
    prompts in one request, a prompt of token ids)."""

    code = "unsupported_parameter"
    http_status = 400


class InvalidTokens(InputError):
    """Token ids outside the model's vocabulary."""

    code = "invalid_token_ids"
    http_status = 400


class GrammarRefused(InputError):
    """The answer's format or a tool's parameters cannot be compiled into a grammar for decoding."""

    code = "unsupported_schema"
    http_status = 400


class UnsupportedMediaType(InputError):
    """The file's content is not an allowed media format."""

    code = "unsupported_media_type"
    http_status = 415


class PayloadTooLarge(InputError):
    """The request body is larger than the configured limit."""

    code = "payload_too_large"
    http_status = 413


class RecordTooLarge(PayloadTooLarge):
    """The job's stored record would pass the size a record may have."""

    code = "record_too_large"


class ResultTooLarge(StokerError):
    """The model's answer is larger than a job's stored result may be."""

    code = "result_too_large"


class MalformedRequest(InputError):
    """The request is not valid HTTP/1.1."""

    code = "malformed_request"
    http_status = 400


class HeadersTooLarge(InputError):
    """The request line and headers are larger than the configured limit."""

    code = "headers_too_large"
    http_status = 431


class RequestTimeout(InputError):
    """The request's head, or its body, did not arrive within the configured time."""

    code = "request_timeout"
    http_status = 408


class TooManyInputs(InputError):
    """The request carries more inputs than allowed."""

    code = "too_many_inputs"
    http_status = 422


class ImageCorrupt(InputError):
    """The image data is corrupt or truncated."""

    code = "image_corrupt"
    http_status = 422


class ImageTooLarge(InputError):
    """The image has more pixels than the configured limit."""

    code = "image_too_large"
    http_status = 422


class MediaCorrupt(InputError):
    """The audio or video data is corrupt or unreadable."""

    code = "media_corrupt"
    http_status = 422


class MediaTooLong(InputError):
    """The media is longer than the configured limit."""

    code = "media_too_long"
    http_status = 422


class StorageQuotaExceeded(InputError):
    """Storing this input would take its tenant over the input bytes it may have stored at once."""

    code = "storage_quota_exceeded"
    http_status = 413


class MediaEmpty(InputError):
    """The media holds nothing to process."""

    code = "media_empty"
    http_status = 422


class InputExpired(InputError):
    """The input's bytes are no longer in the store."""

    code = "input_expired"


class OcrTimeout(InputError):
    """OCR did not finish within its time limit."""

    code = "ocr_timeout"


class OcrFailed(InputError):
    """OCR failed on this image."""

    code = "ocr_failed"


class StageTimeout(InputError):
    """The stage did not finish within its time limit."""

    code = "stage_timeout"


class ImageDecodeTimeout(StageTimeout):
    """Decoding the image did not finish within its time limit."""

    code = "image_decode_timeout"


class AsrTimeout(StageTimeout):
    """Transcription did not finish within its time limit."""

    code = "asr_timeout"


class ImageTensorsMissing(InputExpired):
    """The image's prepared tensors are no longer in the cache, nor its bytes in the store: send the job again."""

    code = "image_tensors_missing"


class AsrFailed(InputError):
    """Transcription failed on this media."""

    code = "asr_failed"


class DeadlineExceeded(InputError):
    """The job's deadline (or its preprocessing budget) ran out before this step."""

    code = "deadline_exceeded"
    http_status = 504


class UrlRejected(InputError):
    """The URL may not be fetched: not http(s), malformed, a forbidden address, or too many redirects."""

    code = "url_rejected"
    http_status = 422


class FetchFailed(InputError):
    """The URL could not be fetched: the server refused it, answered an error, or could not be reached."""

    code = "fetch_failed"
    http_status = 502


class FetchTooLarge(InputError):
    """The content at the URL is larger than the configured limit."""

    code = "fetch_too_large"
    http_status = 413


class FetchTimeout(StageTimeout):
    """Fetching the URL did not finish within its time limit."""

    code = "fetch_timeout"


class WorkerLost(InputError):
    """The stage killed its worker on every delivery; it was given up instead of retried forever."""

    code = "worker_lost"


class StageKilled(InputError):
    """The stage was killed (hard time limit or lost worker) before it could report."""

    code = "stage_killed"


class JobNotFound(StokerError):
    """No job with that id."""

    code = "job_not_found"
    http_status = 404


class ResponseNotFound(StokerError):
    """No stored response with that id (the Responses API: never stored, expired, deleted, or another tenant's)."""

    code = "response_not_found"
    http_status = 404


class IdempotencyKeyReused(InputError):
    """This Idempotency-Key was used for a different request: use a new key for a new request."""

    code = "idempotency_key_reused"
    http_status = 422


class FileNotFound(StokerError):
    """No such file."""

    code = "file_not_found"
    http_status = 404


class BatchNotFound(StokerError):
    """No such batch."""

    code = "batch_not_found"
    http_status = 404


class BatchAlreadyEnded(StokerError):
    """The batch has ended: it cannot be cancelled."""

    code = "batch_already_ended"
    http_status = 409


class BatchCancelled(StokerError):
    """The batch was cancelled before this request ran."""

    code = "batch_cancelled"
    http_status = 409


class BatchExpired(StokerError):
    """This request could not be executed before the batch's completion window expired."""

    code = "batch_expired"
    http_status = 504


class JobAlreadyEnded(StokerError):
    """The job has already ended: there is nothing left to cancel."""

    code = "job_already_ended"
    http_status = 409


class Cancelled(StokerError):
    """The job was cancelled: its work stops and nothing of it is kept."""

    code = "cancelled"
    http_status = 409


class Unauthorized(StokerError):
    """A valid API key is required: send `Authorization: Bearer <key>`."""

    code = "unauthorized"
    http_status = 401


class TransientError(StokerError):
    """A temporary failure; retrying later may succeed."""

    code = "transient_error"
    permanent = False
    http_status = 503
    #: When to come back (the Retry-After header of an answer): each kind's default, or what the raiser knows.
    retry_after_s: int = 5

    def __init__(
        self,
        message: str | None = None,
        *,
        retry_after_s: int | None = None,
        stage: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message, stage=stage, param=param)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class Overloaded(TransientError):
    """The queues are full: come back after Retry-After seconds."""

    code = "overloaded"
    http_status = 429


class TenantLimited(TransientError):
    """This tenant is over one of its limits: come back after Retry-After seconds."""

    code = "tenant_limited"
    http_status = 429
    retry_after_s = 1


class RateLimited(TenantLimited):
    """This tenant sent more requests than its rate allows: come back after Retry-After seconds."""

    code = "rate_limited"


class TooManyJobsInFlight(TenantLimited):
    """This tenant has as many unfinished jobs as it may: come back when one has ended."""

    code = "too_many_jobs_in_flight"


class TenantOverShare(TenantLimited):
    """This tenant's unfinished jobs hold its fair share of the queues: come back when some have ended."""

    code = "tenant_over_share"


class TenantStorageFull(TenantLimited):
    """This tenant's unfinished jobs hold as many input bytes as it may store: come back when some have ended."""

    code = "tenant_storage_full"


class TooManyBatches(TenantLimited):
    """This tenant has as many batches running as it may: come back when one has ended."""

    code = "too_many_batches"
    retry_after_s = 60


class BrokerUnavailable(TransientError):
    """The broker or the job store cannot be reached."""

    code = "broker_unavailable"


class StoreFull(TransientError):
    """The job store is nearly full: new jobs wait until running ones end and free their inputs."""

    code = "store_full"


class RenderingLost(TransientError):
    """A picture's rendering left the stage cache before its render was answered: send the render again."""

    code = "rendering_lost"


class IdempotencyKeyInUse(TransientError):
    """A request with this Idempotency-Key is still being taken in: retry in a moment."""

    code = "idempotency_key_in_use"
    http_status = 409
    retry_after_s = 1


class FetchUnavailable(TransientError):
    """The URL's server could not be reached or answered a temporary error; fetching again later may work."""

    code = "fetch_unavailable"


class ServerStopping(TransientError):
    """This API process is stopping and could not wait any longer for the job, which goes on: read its answer at
    `/v1/jobs/{id}` (its id is in the `X-Stoker-Job-Id` header), from any API process."""

    code = "server_stopping"
    retry_after_s = 1


class ModelUnavailable(TransientError):
    """The model is not available yet."""

    code = "model_unavailable"


class ModelNotFound(StokerError):
    """No such model is served here."""

    code = "model_not_found"
    http_status = 404


class EndpointNotServed(StokerError):
    """This endpoint is not served here: the served models cannot answer it."""

    code = "endpoint_not_served"
    http_status = 404


class ClientGone(StokerError):
    """The client closed the connection before the answer was ready; the job was given up."""

    code = "client_disconnected"
    http_status = 499


class InferenceFailed(StokerError):
    """The model failed on this request."""

    code = "inference_failed"


class ImageFeaturesMismatch(InferenceFailed):
    """The prompt's image tokens and the pictures' features do not match: the model cannot place them."""

    code = "image_features_mismatch"


def error_class(code: str) -> type[StokerError]:
    """The taxonomy's class of a stored error's code (its HTTP status with it); the root for an unknown code."""
    todo: list[type[StokerError]] = [StokerError]
    while todo:
        cls = todo.pop()
        if cls.code == code:
            return cls
        todo.extend(cls.__subclasses__())
    return StokerError
