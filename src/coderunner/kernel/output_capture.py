"""Bounded capture of one call's output.

The kernel may print without end. The host keeps a head and a tail in memory (together at
most `limit_chars`), writes the whole stream to a file in the workspace once the limit is
passed (at most `spill_limit_bytes`), and keeps images within a byte budget, saving the rest
as files. Files are created through directory fds with O_NOFOLLOW|O_EXCL, because the
workspace is writable by the untrusted code and may hold symlinks planted for the host.

A collector fed on the event loop (a kernel run) is made with `defer_files=True`: its file writes
queue up and `drain()` does them in a worker thread (offload.py), so a slow workspace never stalls
other calls. Without it (a collector used inside a worker thread) they are done at once.
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import functools
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coderunner.offload import off_loop

ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
SPILL_DIR = ".coderunner"
IMAGE_SUFFIX = {"image/png": ".png", "image/jpeg": ".jpg"}
#: Images one reply carries inline, whatever their size (a client draws each one).
MAX_INLINE_IMAGES = 20
#: Images one call saves to the workspace beyond those; the rest are only counted.
MAX_SAVED_IMAGES = 100


def strip_ansi(text: str) -> str:
    """Remove terminal escape sequences, and any stray ESC left over (it starts every one of them)."""
    return ANSI_ESCAPE.sub("", text).replace("\x1b", "")


@dataclass(frozen=True)
class ImageOutput:
    mime_type: str
    data_b64: str


@dataclass
class WorkspaceWriter:
    """Creates new files in a workspace the sandbox can also write, without following its links.

    `host_root` is the workspace on the host; `sandbox_root` is the same folder as the code sees it.
    """

    host_root: Path
    sandbox_root: str
    #: Host (uid, gid) the sandbox runs as, when that is not the server's own user.
    owner: tuple[int, int] | None = None

    def create(self, prefix: str, suffix: str) -> tuple[int, str]:
        """Open a fresh file under SPILL_DIR; returns (fd, path as seen inside the sandbox)."""
        root_fd = os.open(self.host_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(SPILL_DIR, 0o755, dir_fd=root_fd)
            dir_fd = os.open(SPILL_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
            if self.owner is not None:
                os.fchown(dir_fd, *self.owner)
        finally:
            os.close(root_fd)
        try:
            name = f"{prefix}-{secrets.token_hex(4)}{suffix}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
            if self.owner is not None:
                os.fchown(fd, *self.owner)
        finally:
            os.close(dir_fd)
        return fd, f"{self.sandbox_root}/{SPILL_DIR}/{name}"


@dataclass
class OutputCollector:
    """Collects text and images of one execution within fixed bounds."""

    limit_chars: int
    spill_limit_bytes: int
    image_limit_bytes: int
    writer: WorkspaceWriter | None = None
    #: Queue file writes for drain() instead of doing them in add_text/add_image (see the module doc).
    defer_files: bool = False
    head: list[str] = field(default_factory=list)
    tail: collections.deque[str] = field(default_factory=collections.deque)
    images: list[ImageOutput] = field(default_factory=list)
    saved_images: list[str] = field(default_factory=list)
    total_chars: int = 0
    spill_path: str | None = None
    spill_error: str | None = None
    spill_truncated: bool = False
    _head_chars: int = 0
    _tail_chars: int = 0
    _image_bytes: int = 0
    _spill_fd: int | None = None
    _spill_started: bool = False
    _spilled_bytes: int = 0
    _image_count: int = 0
    _images_to_save: int = 0
    _pending: list[Callable[[], None]] = field(default_factory=list)
    #: Images neither shown nor saved (over MAX_SAVED_IMAGES).
    dropped_images: int = 0

    @property
    def truncated(self) -> bool:
        return self.total_chars > self.limit_chars

    def add_text(self, text: str) -> None:
        if not text:
            return
        text = strip_ansi(text)
        self.total_chars += len(text)
        if self.truncated:
            self._spill(text)
        half = self.limit_chars // 2
        if self._head_chars < half:
            take = text[: half - self._head_chars]
            self.head.append(take)
            self._head_chars += len(take)
            text = text[len(take) :]
        if text:
            self.tail.append(text)
            self._tail_chars += len(text)
            while self._tail_chars - len(self.tail[0]) >= half and len(self.tail) > 1:
                self._tail_chars -= len(self.tail.popleft())
            if self._tail_chars > 2 * half and len(self.tail) == 1:
                only = self.tail[0][-half:]
                self.tail[0] = only
                self._tail_chars = len(only)

    def fits_inline(self, data_b64: str) -> bool:
        """Whether an image this size would still go in the reply (else it is saved to the workspace)."""
        fits = self._image_bytes + len(data_b64.strip()) <= self.image_limit_bytes
        return fits and len(self.images) < MAX_INLINE_IMAGES

    def add_image(self, mime_type: str, data_b64: str) -> None:
        data_b64 = data_b64.strip()
        self._image_count += 1
        if self.fits_inline(data_b64):
            self._image_bytes += len(data_b64)
            self.images.append(ImageOutput(mime_type, data_b64))
            return
        if self.writer is None or self._images_to_save >= MAX_SAVED_IMAGES:
            self.dropped_images += 1
            return
        self._images_to_save += 1
        self._file_work(functools.partial(self._save_image, self.writer, mime_type, data_b64, self._image_count))

    def _save_image(self, writer: WorkspaceWriter, mime_type: str, data_b64: str, number: int) -> None:
        try:
            raw = base64.b64decode(data_b64, validate=False)
            fd, path = writer.create(f"image-{number}", IMAGE_SUFFIX.get(mime_type, ".bin"))
            with os.fdopen(fd, "wb") as handle:
                handle.write(raw[: self.spill_limit_bytes])
            self.saved_images.append(path)
        except (OSError, binascii.Error, ValueError) as exc:
            self.saved_images.append(f"(an image could not be saved: {exc})")

    @property
    def pending(self) -> bool:
        """File writes are queued (defer_files): await drain() before reading spill_path or saved_images."""
        return bool(self._pending)

    async def drain(self) -> None:
        """Do the queued file writes in a worker thread, in order; the event loop never waits on the disk."""
        while self._pending:
            work, self._pending = self._pending, []
            await off_loop(_run_all, work)

    def _file_work(self, work: Callable[[], None]) -> None:
        if self.defer_files:
            self._pending.append(work)
        else:
            work()

    def text(self) -> str:
        """Everything when it fits; otherwise head, a marker naming the full file, and tail."""
        if not self.truncated:
            return "".join(self.head) + "".join(self.tail)
        tail = "".join(self.tail)[-(self.limit_chars // 2) :]
        omitted = self.total_chars - self._head_chars - len(tail)
        head = "".join(self.head)
        where = self.spill_path or "not saved"
        if self.spill_error:
            where = f"not saved: {self.spill_error}"
        elif self.spill_path:  # the file holds everything from the start: the omitted part begins after the head
            where += f" (read_file offset={len(head.encode('utf-8', 'replace'))} for what is omitted here"
            where += "; cut at the spill limit)" if self.spill_truncated else ")"
        marker = f"\n\n[... {omitted:,} characters omitted; full output: {where}]\n\n"
        return head + marker + tail

    def tail_text(self, chars: int = 500) -> str:
        return "".join(self.tail)[-chars:] if self.tail else "".join(self.head)[-chars:]

    def close(self) -> None:
        """Finish the spill file. Writes never drained (a caller that did not await drain) are done here."""
        if self._pending:
            work, self._pending = self._pending, []
            _run_all(work)
        self._close_spill()

    def _close_spill(self) -> None:
        if self._spill_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._spill_fd)
            self._spill_fd = None

    def _spill(self, text: str) -> None:
        """Queue `text` for the spill file, within spill_limit_bytes (counted here, as it is queued)."""
        if self.writer is None or self.spill_error or self.spill_truncated:
            return
        pieces = []
        if not self._spill_started:
            self._spill_started = True
            # Everything seen so far, then this chunk. The tail deque may already have dropped
            # some middle text; only the head and tail were ever kept, so say so.
            earlier = "".join(self.head) + "".join(self.tail)
            pieces.append(earlier)
            if self.total_chars - len(text) > len(earlier):
                pieces.append("\n[... earlier output was not kept ...]\n")
        pieces.append(text)
        data = "".join(pieces).encode("utf-8", "replace")
        room = self.spill_limit_bytes - self._spilled_bytes
        if len(data) > room:
            data = data[: max(room, 0)]
            self.spill_truncated = True
        self._spilled_bytes += len(data)
        self._file_work(functools.partial(self._write_spill, self.writer, data, self.spill_truncated))

    def _write_spill(self, writer: WorkspaceWriter, data: bytes, last: bool) -> None:
        if self.spill_error:
            return
        try:
            if self._spill_fd is None:
                self._spill_fd, self.spill_path = writer.create("output", ".txt")
            view = memoryview(data)
            while view:
                view = view[os.write(self._spill_fd, view) :]
        except OSError as exc:
            self.spill_error = str(exc)
            self._close_spill()
            return
        if last:
            self._close_spill()


def _run_all(work: list[Callable[[], None]]) -> None:
    for item in work:
        item()
