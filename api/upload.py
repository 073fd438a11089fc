"""A `multipart/form-data` file upload streamed straight into the file storage as it arrives: never held whole in
memory nor spooled to a temporary file first (Starlette's `request.form()` would spool it), counted against the
size, line and quota limits while it streams, so an upload over one is refused as soon as it passes it.

python-multipart does the parsing (the parser Starlette itself drives); only its callbacks are written here,
because Starlette offers no hook to send a part's bytes anywhere but its own temporary file.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from stoker.adapters.files import FileWriter
from stoker.core.errors import (
    InvalidRequest,
    MalformedRequest,
    PayloadTooLarge,
    UnsupportedMediaType,
)

#: The most bytes a form field other than the file (`purpose`) may have.
MAX_FIELD_BYTES = 1024
#: Fields a file upload may carry besides the file.
FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")


@dataclass
class Uploaded:
    """What an upload brought: its form fields, and the file's name, size and lines."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0
    lines: int = 0
    ends_in_newline: bool = True


@dataclass
class _Part:
    name: str = ""
    is_file: bool = False
    data: bytearray = field(default_factory=bytearray)


class _Receiver:
    """python-multipart's callbacks: the file part's bytes queued for the writer, other fields kept (small)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.upload = Uploaded()
        self.queued: list[bytes] = []
        self._part = _Part()
        self._header = (b"", b"")
        self._disposition = b""
        #: The closing boundary arrived: a body cut short never stores what it had.
        self.complete = False

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._begin,
            "on_part_data": self._data,
            "on_part_end": self._end,
            "on_header_field": lambda d, s, e: self._grow(d[s:e], 0),
            "on_header_value": lambda d, s, e: self._grow(d[s:e], 1),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_end": self._finished,
        }

    def _finished(self) -> None:
        self.complete = True

    def _begin(self) -> None:
        self._part, self._disposition = _Part(), b""

    def _grow(self, data: bytes, which: int) -> None:
        name, value = self._header
        self._header = (name + data, value) if which == 0 else (name, value + data)
        if len(self._header[0]) + len(self._header[1]) > MAX_FIELD_BYTES * 4:
            raise MalformedRequest("a part's headers are too long")

    def _header_end(self) -> None:
        if self._header[0].lower() == b"content-disposition":
            self._disposition = self._header[1]
        self._header = (b"", b"")

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._part.name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in options:
            if self._part.name != "file" or self.upload.filename is not None:
                raise InvalidRequest("send one file, in the field `file`", param="file")
            self._part.is_file = True
            self.upload.filename = options[b"filename"].decode("utf-8", "replace")
        elif self._part.name not in FIELDS:
            raise InvalidRequest(f"unknown form field: {self._part.name}", param=self._part.name)

    def _data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if not self._part.is_file:
            if len(self._part.data) + len(chunk) > MAX_FIELD_BYTES:
                raise InvalidRequest(f"the field {self._part.name} is too long", param=self._part.name)
            self._part.data.extend(chunk)
            return
        upload = self.upload
        upload.size += len(chunk)
        if upload.size > self.max_bytes:
            raise PayloadTooLarge(f"a file may hold at most {self.max_bytes} bytes")
        if chunk:
            upload.lines += chunk.count(b"\n")
            upload.ends_in_newline = chunk.endswith(b"\n")
            self.queued.append(chunk)

    def _end(self) -> None:
        if not self._part.is_file:
            self.upload.fields[self._part.name] = self._part.data.decode("utf-8", "replace")


async def stream_upload(
    request: Request, writer: FileWriter, max_bytes: int, room: Callable[[int], Awaitable[None]] | None = None
) -> Uploaded:
    """Parse the multipart body as it streams in, writing the `file` part's bytes to `writer` (in the thread pool,
    a chunk at a time); past `max_bytes` it is refused at once, and `room` (the tenant's stored-files quota) is
    asked for the file's bytes so far after each chunk, refusing it when they do not fit."""
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise UnsupportedMediaType("send multipart/form-data with a `file` and its `purpose`")
    receiver = _Receiver(max_bytes)
    parser = MultipartParser(options[b"boundary"], receiver.callbacks())  # type: ignore[arg-type]
    async for chunk in request.stream():
        try:
            parser.write(chunk)
        except MultipartParseError as exc:
            raise MalformedRequest("the multipart body is malformed") from exc
        if room is not None:
            await room(receiver.upload.size)
        if receiver.queued:
            pending, receiver.queued = b"".join(receiver.queued), []
            await run_in_threadpool(writer.write, pending)
    parser.finalize()
    if not receiver.complete:
        raise MalformedRequest("the multipart body ended before its closing boundary")
    upload = receiver.upload
    if upload.filename is None:
        raise InvalidRequest("the upload has no file (field `file`)", param="file")
    upload.lines += 0 if upload.ends_in_newline or upload.size == 0 else 1
    return upload
