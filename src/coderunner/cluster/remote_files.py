"""A session's files as the front door sees them when the session lives on another node.

The tools use a SandboxFiles view in worker threads (offload.py): list, read, write, and
open_read/open_write for streaming copies and read_file. RemoteFiles offers the same calls over
the session's agent, in pieces of PIECE_BYTES through Ray's object store (never its control store),
each bounded. Every path is resolved again on the node, by the node's own SandboxFiles, which
never follows a link: nothing here touches a path on any host.

A read is brought into an anonymous memory file (memfd) at the front door, whole and within
`limit` bytes; a write is staged the same way and sent when its `with` block ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from coderunner.cluster.wire import PIECE_BYTES
from coderunner.hostfs.sandbox_files import Entry, FileAccessError, SandboxFiles
from coderunner.kernel.output_capture import SPILL_DIR, WorkspaceWriter

log = logging.getLogger(__name__)

#: Runs one agent call from a worker thread and returns its answer (bounded; see remote_session.py).
Call = Callable[..., Any]


class RemoteFiles(SandboxFiles):
    """SandboxFiles over a session in a node agent. `limit`: the most bytes one read or write may move."""

    def __init__(self, call: Call, limit: int) -> None:
        super().__init__([])
        self._call = call
        self.limit = limit

    def describe(self) -> str:
        return "the session's workspace and mounts, on its node"

    def list(self, path: str = "/workspace", depth: int = 1) -> list[Entry]:
        return list(self._call("list_files", path, depth))

    def read(self, path: str, offset: int = 0, limit: int | None = None) -> tuple[bytes, int, str]:
        want = self.limit if limit is None else min(limit, self.limit)
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
        if size > self.limit:
            raise FileAccessError(
                f"{resolved} is {size:,} bytes, over the limit of {self.limit:,} for a file moved from its node"
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
            self.send(fd, path, overwrite)
        finally:
            os.close(fd)

    def write(self, path: str, data: bytes, *, overwrite: bool = True) -> str:
        fd = os.memfd_create("coderunner-write", os.MFD_CLOEXEC)
        try:
            os.pwrite(fd, data, 0)
            return self.send(fd, path, overwrite)
        finally:
            os.close(fd)

    def send(self, fd: int, path: str, overwrite: bool) -> str:
        """Stage the memfd's bytes on the node piece by piece, then write them to `path` there."""
        size = os.fstat(fd).st_size
        if size > self.limit:
            raise FileAccessError(f"{path}: {size:,} bytes is over the limit of {self.limit:,}")
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


class RemoteWorkspaceWriter(WorkspaceWriter):
    """Where a reply too big to send spills, for a session on another node: each file is the write end
    of a pipe, streamed by a thread of its own to a new file under the workspace's SPILL_DIR on the
    node (created there with O_EXCL, never following a link) when the writer closes it."""

    def __init__(self, files: RemoteFiles, sandbox_root: str) -> None:
        super().__init__(Path("/nonexistent"), sandbox_root)
        self._files = files

    def create(self, prefix: str, suffix: str) -> tuple[int, str]:
        path = f"{self.sandbox_root}/{SPILL_DIR}/{prefix}-{secrets.token_hex(4)}{suffix}"
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        threading.Thread(target=self._send, args=(read_end, path), name="coderunner-spill", daemon=True).start()
        return write_end, path

    def _send(self, read_end: int, path: str) -> None:
        staged = os.memfd_create("coderunner-spill", os.MFD_CLOEXEC)
        try:
            size = 0
            while chunk := os.read(read_end, PIECE_BYTES):
                size += len(chunk)
                if size > self._files.limit:
                    return  # the writer bounds what it writes; this never holds more than the transfer limit
                os.write(staged, chunk)
            self._files.send(staged, path, overwrite=False)
        except Exception as exc:  # a reply's spill file is a courtesy: its loss is logged, not raised
            log.warning("a spill file for %s was not saved: %r", path, exc)
        finally:
            os.close(read_end)
            os.close(staged)
