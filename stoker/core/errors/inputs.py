"""Permanent errors of an input or a request (`InputError`): the job degrades or the API answers 4xx."""

from __future__ import annotations

from stoker.core.errors.base import InputError


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


class IdempotencyKeyReused(InputError):
    """This Idempotency-Key was used for a different request: use a new key for a new request."""

    code = "idempotency_key_reused"
    http_status = 422
