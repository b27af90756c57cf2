"""What a cluster one-shot run saves to /mnt/outputs, brought to the front door's export_dir/<client>.

A one-shot run is one Ray task, and its sandbox and outbox are gone when the task answers, so its
files cannot be read in pieces afterwards as a session's are (remote_exports.py). Instead the node
exports them as one machine would, with its own Exporter (the same bounds, links never followed),
but into a host-only temporary folder of the task's instead of the node's export_dir, within
ONESHOT_EXPORT_MB; the task's answer carries those files, and the front door writes them with an
ExportWriter into its client's folder. The reply's note names the front door's folder.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coderunner.hostfs.exports import (
    ExportReport,
    ExportWriter,
    OutboxScan,
    OverLimit,
    client_folder,
    folder_owner,
    open_regular,
    over_limit,
    prepare_export_dir,
    read_pieces,
    skip_reason,
)

#: What one cluster one-shot run brings back at most (its task's answer holds it whole).
ONESHOT_EXPORT_MB = 64


@dataclass
class OneShotExports:
    """The files a one-shot's node exported, as its task returns them."""

    #: Where the node put them (the note names it until the front door names its own).
    folder: str
    files: list[tuple[str, bytes]] = field(default_factory=list)


@contextlib.contextmanager
def node_export_folder(sent: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """On the node: the settings a one-shot runs with there (a temporary export_dir of its own, the
    smaller limit), or none at all when the front door has no export folder."""
    if sent.get("export_dir") is None:
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="coderunner-oneshot-out-") as held:
        limit = min(int(sent["export_limit_mb"]), ONESHOT_EXPORT_MB)
        yield {"export_dir": Path(held).resolve(), "export_limit_mb": limit}  # resolved, as the note names it


def collect(export_dir: Path, client: str) -> OneShotExports:
    """On the node, after the run: what its Exporter wrote to `export_dir` (a folder only this task writes)."""
    folder = client_folder(export_dir, client)
    found = OneShotExports(str(folder))
    scan = OutboxScan(folder)
    for rel, parent_fd, _info in scan.changed(ExportReport(folder)):
        opened = open_regular(parent_fd, rel)
        if opened is not None:
            fd, _ = opened
            try:
                found.files.append((rel, b"".join(read_pieces(fd))))
            finally:
                os.close(fd)
    return found


def write_here(
    exports: OneShotExports, export_dir: Path, client: str, limit_bytes: int, note: str | None
) -> str | None:
    """At the front door (a worker thread): write the files into the client's folder; the run's note,
    naming that folder, and what could not be written here."""
    root = prepare_export_dir(export_dir)
    target = client_folder(root, client)
    writer = ExportWriter(target, limit_bytes, folder_owner(root))
    failed: list[str] = []
    try:
        writer.open()
        for rel, data in exports.files:
            if len(data) > writer.room():
                failed.append(over_limit(rel, len(data), writer.room()))
                continue
            try:
                writer.write(rel, [data])
            except (OverLimit, OSError) as exc:
                failed.append(f"{rel} ({skip_reason(exc)})")
    except OSError as exc:
        failed = [f"the export folder {target} cannot be used ({exc.strerror or exc})"]
    finally:
        writer.close()
    if note is not None:
        note = note.replace(f" to {exports.folder}: ", f" to {target}: ", 1)
    if failed:
        note = "; ".join([*([note] if note else []), "not written here: " + "; ".join(failed)])
    return note
