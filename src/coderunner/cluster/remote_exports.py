"""The front door's half of a cluster session's export: its node's outbox into this machine's export_dir.

What a session saves to /mnt/outputs reaches the user's export_dir/<client>/ here, as on one
machine, though the session lives on another node. The node lists what is new or changed
(cluster/node_exports.py); this writes each listed file with the same ExportWriter a local
session uses (a temporary name and a rename under a dir fd, within export_limit_mb), taking the
bytes from the listing's inline head and then in pieces of PIECE_BYTES through Ray's object store.
The reply's note is the one a local session's copy-out gives.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from coderunner.cluster.wire import PIECE_BYTES, ExportItem, ExportListing
from coderunner.errors import CodeRunnerError
from coderunner.hostfs.exports import (
    ExportReport,
    ExportWriter,
    OverLimit,
    client_folder,
    folder_owner,
    over_limit,
    prepare_export_dir,
    skip_reason,
)

if TYPE_CHECKING:
    from pathlib import Path

    from coderunner.config import Settings

log = logging.getLogger(__name__)

#: Sends several calls of one agent method at once and returns their answers in order (RemoteSession.call_each).
CallEach = Callable[[str, list[tuple[Any, ...]]], list[Any]]


#: Pieces of one file in flight at once (each a 1 MiB object in Ray's store): 4 MiB of memory here at most.
PIECES_AT_ONCE = 4


class FileGone(Exception):
    """The listed file is no longer there on the node (or its name leads elsewhere now): not copied."""


class RemoteExports:
    """Copies one cluster session's outbox listings into its client's export folder here. One per
    session and front door: its writer counts what this session put here against export_limit_mb."""

    def __init__(self, export_dir: Path, settings: Settings, client: str, call_each: CallEach) -> None:
        self._export_dir = export_dir
        self._limit = settings.export_limit_mb * 2**20
        self._mount = settings.export_mount
        self._client = client
        self._call_each = call_each
        self._writer: ExportWriter | None = None

    @property
    def target(self) -> Path:
        return client_folder(self._export_dir.expanduser().resolve(), self._client)

    def pull(self, listing: ExportListing) -> str | None:
        """Copy what `listing` names; the note for the reply. Blocking (agent calls, file I/O): a worker thread."""
        report = ExportReport(self.target, skipped=list(listing.skipped))
        try:
            writer = self._open()
        except OSError as exc:
            report.skipped.append(f"the export folder {self.target} cannot be used ({exc.strerror or exc})")
            with contextlib.suppress(CodeRunnerError):
                self._call_each("forget_exports", [([item.rel for item in listing.items],)])  # listed again next time
            return report.note(self._mount)
        try:
            for item in listing.items:
                if item.size > writer.room():
                    report.skipped.append(over_limit(item.rel, item.size, writer.room()))
                    continue
                try:
                    report.bytes += writer.write(item.rel, self._pieces(item))
                except FileGone:
                    continue  # as on one machine: a file gone since its listing is not reported
                except (OverLimit, OSError) as exc:
                    report.skipped.append(f"{item.rel} ({skip_reason(exc)})")
                    continue
                except CodeRunnerError as exc:  # the node stopped answering: what is left stays there
                    report.skipped.append(f"{item.rel} and what followed it ({exc})")
                    break
                report.copied.append(item.rel)
        finally:
            writer.close()
        return report.note(self._mount)

    def _open(self) -> ExportWriter:
        if self._writer is None:
            root = prepare_export_dir(self._export_dir)
            self._writer = ExportWriter(client_folder(root, self._client), self._limit, folder_owner(root))
        self._writer.open()
        return self._writer

    def _pieces(self, item: ExportItem) -> Iterator[bytes]:
        """The file's bytes as listed: its inline head, then pieces read on the node up to its listed size,
        PIECES_AT_ONCE in flight. Without a head the first pieces are read now, so that nothing is made
        here for a file gone on the node."""
        offsets = list(range(len(item.head), item.size, PIECE_BYTES))
        windows = [offsets[at : at + PIECES_AT_ONCE] for at in range(0, len(offsets), PIECES_AT_ONCE)]
        first = [] if item.head or not windows else self._read(item, windows.pop(0))

        def pieces() -> Iterator[bytes]:
            if item.head:
                yield item.head
            for batch in [first, *(self._read(item, window) for window in windows)]:
                for offset, piece in batch:
                    yield piece
                    if len(piece) < min(PIECE_BYTES, item.size - offset):
                        return  # it shrank since its listing: what there was

        return pieces()

    def _read(self, item: ExportItem, offsets: list[int]) -> list[tuple[int, bytes]]:
        wanted = [(item.rel, item.ino, offset, min(PIECE_BYTES, item.size - offset)) for offset in offsets]
        pieces = self._call_each("read_export_piece", wanted)
        if any(piece is None for piece in pieces):
            raise FileGone(item.rel)
        return [(offset, bytes(piece)) for offset, piece in zip(offsets, pieces, strict=True)]
