"""What a cluster one-shot run saves to /mnt/outputs, brought to the front door's export_dir/<client>.

A one-shot run is one call of a node agent (oneshot_side.py), and its sandbox and outbox are gone when
the call answers, so its files cannot be read in pieces afterwards as a session's are (remote_exports.py).
Instead the node exports them as one machine would, with its own Exporter (the same bounds, links never
followed), but into a host-only folder of the run's, within ONESHOT_EXPORT_MB; the call's answer
carries those files, and the front door writes them with an ExportWriter into its client's folder. The
reply's note names the front door's folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coderunner.hostfs.exports import (
    DIR_FLAGS,
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

if TYPE_CHECKING:
    from coderunner.config import Settings

#: What one cluster one-shot run brings back at most (its task's answer holds it whole).
ONESHOT_EXPORT_MB = 64
#: A run's folder in the node's export_dir: never a client's folder name (those start with a letter or digit).
HELD_PREFIX = ".oneshot-"
#: Folders of dead runs one run removes at most.
MAX_SWEPT = 64


@dataclass
class OneShotExports:
    """The files a one-shot's node exported, as its task returns them."""

    #: Where the node put them (the note names it until the front door names its own).
    folder: str
    files: list[tuple[str, bytes]] = field(default_factory=list)


@contextlib.contextmanager
def node_export_folder(node: Settings) -> Iterator[dict[str, Any]]:
    """On the node: what a one-shot's settings change there (an export_dir of its own, the smaller
    limit), or nothing when the front door has no export folder. The folder is made in the node's own
    export_dir (host-only: no sandbox sees it; nothing else is copied there in cluster mode), locked
    while the run goes, and removed after; one left by an agent killed mid-run is removed by the next
    run on that node, once its lock is free."""
    if node.export_dir is None:
        yield {}
        return
    base = prepare_export_dir(node.export_dir)
    _sweep(base)
    held = Path(tempfile.mkdtemp(prefix=HELD_PREFIX, dir=base))
    fd = os.open(held, DIR_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield {"export_dir": held, "export_limit_mb": min(node.export_limit_mb, ONESHOT_EXPORT_MB)}
    finally:
        shutil.rmtree(held, ignore_errors=True)
        os.close(fd)


def _sweep(base: Path) -> None:
    """Remove the folders of runs whose worker died (their lock is free)."""
    with os.scandir(base) as entries:
        left = [entry.path for entry in entries if entry.name.startswith(HELD_PREFIX)]
    for path in left[:MAX_SWEPT]:
        try:
            fd = os.open(path, DIR_FLAGS)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a run going on now
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


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
        if exports.files:  # only links or FIFOs were there: no folder is made for nothing
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
