"""The taxonomy's roots: `StokerError` (its code, HTTP status and OpenAI error envelope), `InputError` (permanent: the
input or request is at fault) and `TransientError` (retried later), and the lookup of a stored code's class."""

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


def error_class(code: str) -> type[StokerError]:
    """The taxonomy's class of a stored error's code (its HTTP status with it); the root for an unknown code."""
    todo: list[type[StokerError]] = [StokerError]
    while todo:
        cls = todo.pop()
        if cls.code == code:
            return cls
        todo.extend(cls.__subclasses__())
    return StokerError
