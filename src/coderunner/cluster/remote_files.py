"""A session's files as the front door sees them when the session lives on another node.

The tools use a SandboxFiles view in worker threads (offload.py): list, read, write, and
open_read/open_write for streaming copies and read_file. RemoteFiles offers the same calls over
the session's actor, in pieces of PIECE_BYTES through Ray's object store (never its control store),
each bounded. Every path is resolved again on the node, by the node's own SandboxFiles, which
never follows a link: nothing here touches a path on any host.

A read is brought into an anonymous memory file (memfd) at the front door, whole and within
`limit` bytes; a write is staged the same way and sent when its `with` block ends.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from coderunner.cluster.wire import PIECE_BYTES
from coderunner.hostfs.sandbox_files import Entry, FileAccessError, SandboxFiles

#: Runs one actor call from a worker thread and returns its answer (bounded; see remote_session.py).
Call = Callable[..., Any]


class RemoteFiles(SandboxFiles):
    """SandboxFiles over a session actor. `limit`: the most bytes one read or write may move."""

    def __init__(self, call: Call, limit: int) -> None:
        super().__init__([])
        self._call = call
        self._limit = limit

    def describe(self) -> str:
        return "the session's workspace and mounts, on its node"

    def list(self, path: str = "/workspace", depth: int = 1) -> list[Entry]:
        return list(self._call("list_files", path, depth))

    def read(self, path: str, offset: int = 0, limit: int | None = None) -> tuple[bytes, int, str]:
        want = self._limit if limit is None else min(limit, self._limit)
        pieces: list[bytes] = []
        got, size, resolved = 0, 0, path
        while True:
            data, size, resolved = self._call("read_piece", path, offset + got, min(PIECE_BYTES, want - got))
            pieces.append(data)
            got += len(data)
            if not data or got >= want or offset + got >= size:
                return b"".join(pieces), size, resolved

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[tuple[int, int, str]]:
        _, size, resolved = self._call("read_piece", path, 0, 0)
        if size > self._limit:
            raise FileAccessError(
                f"{resolved} is {size:,} bytes, over the limit of {self._limit:,} for a file moved from its node"
            )
        data, size, resolved = self.read(path, 0, size)
        fd = os.memfd_create("coderunner-read", os.MFD_CLOEXEC)
        try:
            os.pwrite(fd, data, 0)
            yield fd, len(data), resolved
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def open_write(self, path: str, *, overwrite: bool = True) -> Iterator[tuple[int, str]]:
        fd = os.memfd_create("coderunner-write", os.MFD_CLOEXEC)
        try:
            yield fd, self.normalize(path)
            self._send(fd, path, overwrite)
        finally:
            os.close(fd)

    def write(self, path: str, data: bytes, *, overwrite: bool = True) -> str:
        fd = os.memfd_create("coderunner-write", os.MFD_CLOEXEC)
        try:
            os.pwrite(fd, data, 0)
            return self._send(fd, path, overwrite)
        finally:
            os.close(fd)

    def _send(self, fd: int, path: str, overwrite: bool) -> str:
        """Stage the memfd's bytes on the node piece by piece, then write them to `path` there."""
        size = os.fstat(fd).st_size
        if size > self._limit:
            raise FileAccessError(f"{path}: {size:,} bytes is over the limit of {self._limit:,}")
        upload, offset = "", 0
        while True:  # at least one piece: an empty file is still written
            piece = os.pread(fd, PIECE_BYTES, offset)
            upload = self._call("stage_piece", upload, piece)
            offset += len(piece)
            if offset >= size:
                return str(self._call("commit_upload", upload, path, overwrite))

    def resolve(self, path: str) -> Any:
        raise FileAccessError("paths of a session on another node are resolved on its node")

    def confine(self, arguments: dict[str, Any], names: Any) -> dict[str, Any]:
        raise FileAccessError("paths of a session on another node are confined on its node")
