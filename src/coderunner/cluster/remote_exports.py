"""The front door's half of a cluster session's export: its node's outbox into this machine's export_dir.

What a session saves to /mnt/outputs reaches the user's export_dir/<client>/ here, as on one
machine, though the session lives on another node. The node lists what is new or changed
(cluster/node_exports.py); this writes each listed file with the same ExportWriter a local
session uses (a temporary name and a rename under a dir fd, within export_limit_mb), taking the
bytes from the listing's inline head and then in pieces of PIECE_BYTES through Ray's object store.
The reply's note is the one a local session's copy-out gives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from coderunner.cluster.remote_files import Call
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


class FileGone(Exception):
    """The listed file is no longer there on the node (or its name leads elsewhere now): not copied."""


class RemoteExports:
    """Copies one cluster session's outbox listings into its client's export folder here. One per
    session and front door: its writer counts what this session put here against export_limit_mb."""

    def __init__(self, export_dir: Path, settings: Settings, client: str, call: Call) -> None:
        self._export_dir = export_dir
        self._limit = settings.export_limit_mb * 2**20
        self._mount = settings.export_mount
        self._client = client
        self._call = call
        self._writer: ExportWriter | None = None

    @property
    def target(self) -> Path:
        return client_folder(self._export_dir.expanduser().resolve(), self._client)

    def pull(self, listing: ExportListing) -> str | None:
        """Copy what `listing` names; the note for the reply. Blocking (actor calls, file I/O): a worker thread."""
        report = ExportReport(self.target, skipped=list(listing.skipped))
        try:
            writer = self._open()
        except OSError as exc:
            report.skipped.append(f"the export folder {self.target} cannot be used ({exc.strerror or exc})")
            self._call("forget_exports", [item.rel for item in listing.items])  # listed again next time
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
        """The file's bytes as listed: its inline head (or its first piece, read now, so that nothing is
        made here for a file gone on the node), then pieces read on the node up to its listed size."""
        first = item.head or self._read(item, 0)

        def pieces() -> Iterator[bytes]:
            yield first
            offset = len(first)
            while offset < item.size:
                piece = self._read(item, offset)
                if not piece:
                    return  # it shrank since its listing: what there was
                yield piece
                offset += len(piece)

        return pieces()

    def _read(self, item: ExportItem, offset: int) -> bytes:
        piece = self._call("read_export_piece", item.rel, item.ino, offset, min(PIECE_BYTES, item.size - offset))
        if piece is None:
            raise FileGone(item.rel)
        return bytes(piece)
