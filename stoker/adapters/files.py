"""Where uploaded and produced files' bytes live: one small interface (`FileStorage`), a directory behind it by
default (`STOKER_FILES_DIR`, shared by every API host of a deployment, e.g. a volume). An object store can take
its place by implementing the same four calls; file records (owner, size, expiry) live in the job store."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

#: Bytes read at a time when a file is streamed back.
CHUNK = 1 << 20


class FileWriter(Protocol):
    """A file being written: bytes appended in order, kept only if the block that opened it ends normally."""

    def write(self, data: bytes, /) -> int:
        """Append bytes; how many were written."""


class FileStorage(Protocol):
    """The bytes of files, by id."""

    def create(self, file_id: str) -> contextlib.AbstractContextManager[FileWriter]:
        """A writer for a new file: what it wrote is there once the block ends, nothing if it raised."""

    def read(self, file_id: str, offset: int = 0) -> Iterator[bytes]:
        """The file's bytes from `offset`, in chunks; raises FileNotFoundError if there is no such file."""

    def delete(self, file_id: str) -> None:
        """Forget the file (nothing if there is none)."""

    def exists(self, file_id: str) -> bool:
        """Whether the file's bytes are there."""


class DirectoryStorage:
    """Files as plain files in one directory: written to a temporary name and renamed when complete, so a reader
    (on this host or another sharing the directory) never sees half a file."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, file_id: str) -> Path:
        if not file_id or "/" in file_id or file_id.startswith("."):
            raise FileNotFoundError(file_id)
        return self.root / file_id

    @contextlib.contextmanager
    def create(self, file_id: str) -> Iterator[FileWriter]:
        """A writer for a new file (see `FileStorage.create`)."""
        self.root.mkdir(parents=True, exist_ok=True)
        target = self._path(file_id)
        fd, temporary = tempfile.mkstemp(dir=self.root, prefix=f".{file_id}.")
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise

    def read(self, file_id: str, offset: int = 0) -> Iterator[bytes]:
        """The file's bytes from `offset`, a chunk at a time."""
        handle = self._path(file_id).open("rb")  # raises FileNotFoundError now, not on the first chunk
        return _chunks(handle, offset)

    def delete(self, file_id: str) -> None:
        """Remove the file if it is there."""
        with contextlib.suppress(FileNotFoundError):
            self._path(file_id).unlink()

    def exists(self, file_id: str) -> bool:
        """Whether the file is there."""
        try:
            return self._path(file_id).is_file()
        except FileNotFoundError:
            return False


def _chunks(handle: BinaryIO, offset: int) -> Iterator[bytes]:
    with handle:
        handle.seek(offset)
        while chunk := handle.read(CHUNK):
            yield chunk
