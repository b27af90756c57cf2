"""A cluster session's outbox, read on its node for the front door that copies it out.

On one machine the host copies what a sandbox saves to /mnt/outputs into export_dir/<client>
itself (hostfs/exports.py). In a cluster the session lives on a node while its user's export
folder is on the front door's machine, so the copy is split where Exporter splits: the node runs
the session's OutboxScan (the same bounds in entries, depth and file kinds) and lists what is new
or changed, with the first bytes of small files inline; the front door reads the rest in pieces
and writes all of it with an ExportWriter (cluster/remote_exports.py). The node's own export
folder is never written.

Each later read resolves the name again under the outbox's dir fd, one component at a time with
O_NOFOLLOW, and reads only the inode it listed: a name swapped for a link, a FIFO or another file
since the listing is not read.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from coderunner.cluster.wire import PIECE_BYTES, ExportItem, ExportListing
from coderunner.hostfs.exports import DIR_FLAGS, MAX_DEPTH, ExportReport, OutboxScan, open_regular

#: Bytes of file heads one listing carries at most: a run's charts and small files need no read of their own.
INLINE_BYTES = PIECE_BYTES


class NodeOutbox:
    """One session's outbox on its node. Blocking file I/O: call it from a worker thread."""

    def __init__(self, scan: OutboxScan) -> None:
        self.scan = scan
        self._lock = threading.Lock()  # two calls ending at once must not list one file twice

    def empty(self) -> bool:
        """One directory read: cheap enough for the event loop (most calls save nothing)."""
        return self.scan.empty()

    def listing(self) -> ExportListing | None:
        """What is new or changed since the last listing (counted as dealt with from now on, as a local
        copy-out counts a file it copied or reported); None when there is nothing."""
        with self._lock:
            report = ExportReport(Path())
            listing = ExportListing()
            budget = INLINE_BYTES
            for rel, parent_fd, info in self.scan.changed(report):
                item = ExportItem(rel, info.st_size, info.st_ino)
                if 0 < info.st_size <= budget:
                    item = self._with_head(parent_fd, rel, item) or item
                    budget -= len(item.head)
                self.scan.mark(rel, info)
                listing.items.append(item)
            listing.skipped = report.skipped
            return listing or None

    def _with_head(self, parent_fd: int, rel: str, item: ExportItem) -> ExportItem | None:
        opened = open_regular(parent_fd, rel)
        if opened is None:
            return None
        fd, info = opened
        try:
            if info.st_ino != item.ino:
                return None
            return ExportItem(item.rel, item.size, item.ino, os.pread(fd, item.size, 0))
        except OSError:
            return None
        finally:
            os.close(fd)

    def forget(self, rels: list[str]) -> None:
        """The front door could not write these: list them again next time."""
        with self._lock:
            for rel in rels:
                self.scan.forget(rel)

    def read_piece(self, rel: str, ino: int, offset: int, size: int) -> bytes | None:
        """Up to `size` bytes (PIECE_BYTES at most) of the listed file at `offset`; None when that
        name no longer leads to the inode listed (gone, or swapped since)."""
        parts = rel.split("/")
        if len(parts) > MAX_DEPTH or any(part in ("", ".", "..") for part in parts):
            return None  # not a name a listing gives
        try:
            fd = os.open(self.scan.outbox, DIR_FLAGS)
        except OSError:
            return None
        try:
            for part in parts[:-1]:
                inner = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = inner
            opened = open_regular(fd, parts[-1])
        except OSError:
            return None
        finally:
            os.close(fd)
        if opened is None:
            return None
        src, info = opened
        try:
            if info.st_ino != ino:
                return None
            with contextlib.suppress(OSError):
                return os.pread(src, max(0, min(size, PIECE_BYTES)), max(0, offset))
            return None
        finally:
            os.close(src)
