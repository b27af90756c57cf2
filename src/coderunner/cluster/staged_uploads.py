"""Uploads to a session on this node, staged piece by piece before they are written to its files.

A front door sends an upload in pieces (cluster/remote_files.py), each one agent call. The pieces
gather in a memfd (never a path the sandbox could reach), bounded in count, bytes and age; a commit
writes them through the session's files view, which resolves the target on the node without
following a link.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass

import anyio

from coderunner.cluster.wire import PIECE_BYTES
from coderunner.hostfs.sandbox_files import FileAccessError, SandboxFiles

#: Uploads staged at once per session, and how long an unfinished one may sit.
MAX_UPLOADS = 4
STALE_AFTER_S = 300.0


@dataclass
class _Staged:
    fd: int
    size: int
    touched: float


class StagedUploads:
    """One session's uploads under way, by id."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._uploads: dict[str, _Staged] = {}

    async def stage(self, upload_id: str, data: bytes) -> str:
        """Add a piece to an upload; '' starts a new one. Returns the upload's id."""
        if not upload_id:
            self._drop_stale()
            if len(self._uploads) >= MAX_UPLOADS:
                raise FileAccessError("too many uploads to this session at once; try again")
            upload_id = secrets.token_hex(8)
            self._uploads[upload_id] = _Staged(
                os.memfd_create("coderunner-upload", os.MFD_CLOEXEC), 0, time.monotonic()
            )
        staged = self._uploads.get(upload_id)
        if staged is None:
            raise FileAccessError("that upload is gone (too slow, or a second commit)")
        if staged.size + len(data) > self.limit_bytes:
            self.drop(upload_id)
            raise FileAccessError(f"over the transfer limit of {self.limit_bytes:,} bytes")
        await anyio.to_thread.run_sync(os.pwrite, staged.fd, data, staged.size)
        staged.size += len(data)
        staged.touched = time.monotonic()
        return upload_id

    async def commit(self, upload_id: str, files: SandboxFiles, path: str, overwrite: bool) -> str:
        """Write a staged upload to `path` in `files`; returns its sandbox path. The upload ends either way."""
        staged = self._uploads.get(upload_id)
        if staged is None:
            raise FileAccessError("that upload is gone (too slow, or a second commit)")

        def write() -> str:
            with files.open_write(path, overwrite=overwrite) as (target, written):
                offset = 0
                while offset < staged.size:
                    piece = os.pread(staged.fd, min(PIECE_BYTES, staged.size - offset), offset)
                    if not piece:
                        break
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(target, view) :]
                    offset += len(piece)
                return written

        try:
            return await anyio.to_thread.run_sync(write)
        finally:
            self.drop(upload_id)

    def drop(self, upload_id: str) -> None:
        staged = self._uploads.pop(upload_id, None)
        if staged is not None:
            os.close(staged.fd)

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for upload_id, staged in list(self._uploads.items()):
            if now - staged.touched > STALE_AFTER_S:
                self.drop(upload_id)
