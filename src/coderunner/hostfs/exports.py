"""The export folder: what a sandbox saves to /mnt/outputs reaches export_dir/<client>/ on the host.

No sandbox ever sees the host's export folder. Its /mnt/outputs is the session's own outbox:
on a root server a folder inside its size-capped workspace (`.coderunner/outputs`), staged by
fd so that no path the sandbox can write is ever bound by name; otherwise a fresh host-private
folder. After each call and at close the host copies new and changed regular files out, through
directory fds with O_NOFOLLOW, skipping links, FIFOs, sockets and devices, bounded in entries,
depth and bytes; each lands via a temporary name and a rename, which replaces a name and never
writes through a link. So one client never sees another's exports, and what one session puts on
the host counts against `export_limit_mb` (and, as root, its workspace's disk_mb first).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: Where the outbox lives in a workspace (root servers); hidden beside spill files and packages.
WORKSPACE_OUTBOX = (".coderunner", "outputs")
#: Entries one copy-out looks at, and how deep it goes.
MAX_ENTRIES = 10_000
MAX_DEPTH = 16
#: Skipped files named in one report at most.
MAX_REPORTED = 20
CHUNK = 1 << 20
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ExportError(OSError):
    """The export folder cannot be used; the message says what to do."""


@dataclass
class ExportReport:
    """What one copy-out did, for the reply."""

    folder: Path
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes: int = 0

    def note(self, mount: str) -> str | None:
        if not self.copied and not self.skipped:
            return None
        parts = []
        if self.copied:
            shown = ", ".join(self.copied[:MAX_REPORTED]) + (" …" if len(self.copied) > MAX_REPORTED else "")
            parts.append(f"copied {len(self.copied)} file(s) from {mount} to {self.folder}: {shown}")
        if self.skipped:
            parts.append("not exported: " + "; ".join(self.skipped[:MAX_REPORTED]))
        return "; ".join(parts)


@dataclass
class OutboxScan:
    """The source side: which regular files of one outbox (hostile contents) are new or changed since
    last looked. The node of a cluster session runs it too, so its bounds are the one place they live."""

    outbox: Path
    #: rel path -> (size, mtime_ns, ino, ctime_ns) as last exported (or found at open).
    _seen: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)

    def baseline(self) -> None:
        """Count what the outbox already holds (a reopened workspace) as exported: never re-copy it."""
        for rel, _fd, info in self._files():
            self._seen[rel] = _signature(info)

    def changed(self, report: ExportReport) -> Iterator[tuple[str, int, os.stat_result]]:
        """(relative path, parent dir fd, lstat) of each new or changed file; the fd is open only
        until the next item. Call mark() once a file is dealt with (copied or reported)."""
        for rel, parent_fd, info in self._files(report):
            if self._seen.get(rel) != _signature(info):
                yield rel, parent_fd, info

    def mark(self, rel: str, info: os.stat_result) -> None:
        self._seen[rel] = _signature(info)

    def forget(self, rel: str) -> None:
        """Not dealt with after all (its copy could not be written): changed() names it again."""
        self._seen.pop(rel, None)

    def empty(self) -> bool:
        """Whether the outbox holds no entry at all (its first directory read; nothing followed)."""
        try:
            fd = os.open(self.outbox, DIR_FLAGS)
        except OSError:
            return True  # changed() finds nothing either
        try:
            with os.scandir(fd) as entries:
                return next(entries, None) is None
        finally:
            os.close(fd)

    def _files(self, report: ExportReport | None = None) -> Iterator[tuple[str, int, os.stat_result]]:
        """(relative path, parent dir fd, lstat) of each regular file in the outbox; no link followed."""
        try:
            root = os.open(self.outbox, DIR_FLAGS)
        except OSError:
            return
        stack: list[tuple[int, str, int]] = [(root, "", 0)]
        seen_entries = 0
        try:
            while stack:
                fd, prefix, depth = stack.pop()
                try:
                    names = sorted(os.listdir(fd))
                except OSError:
                    os.close(fd)
                    continue
                try:
                    for name in names:
                        seen_entries += 1
                        if seen_entries > MAX_ENTRIES:
                            if report is not None:
                                report.skipped.append(f"more than {MAX_ENTRIES} entries: the rest was not looked at")
                            return
                        rel = f"{prefix}{name}"
                        try:
                            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        except OSError:
                            continue
                        if stat.S_ISREG(info.st_mode):
                            yield rel, fd, info
                        elif stat.S_ISDIR(info.st_mode):
                            if depth + 1 >= MAX_DEPTH:
                                if report is not None:
                                    report.skipped.append(f"{rel}/ (deeper than {MAX_DEPTH} levels)")
                                continue
                            with contextlib.suppress(OSError):
                                stack.append((os.open(name, DIR_FLAGS, dir_fd=fd), rel + "/", depth + 1))
                        elif report is not None and self._seen.get(rel) is None:
                            self._seen[rel] = (0, 0, 0, 0)
                            report.skipped.append(f"{rel} (not a regular file)")
                finally:
                    os.close(fd)
        finally:
            for fd, _, _ in stack:
                with contextlib.suppress(OSError):
                    os.close(fd)


def open_regular(parent_fd: int, rel: str) -> tuple[int, os.stat_result] | None:
    """An fd and fstat of a file changed() named, opened without following a link; None if it is gone
    or is no longer a regular file (swapped since the scan)."""
    try:
        src = os.open(rel.rsplit("/", 1)[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                      dir_fd=parent_fd)  # fmt: skip
    except OSError:
        return None
    opened = os.fstat(src)
    if not stat.S_ISREG(opened.st_mode):
        os.close(src)
        return None
    return src, opened


def read_pieces(fd: int) -> Iterator[bytes]:
    while chunk := os.read(fd, CHUNK):
        yield chunk


@dataclass
class ExportWriter:
    """The target side: writes files into one client's export folder, each via a temporary name and a
    rename under a dir fd (never through a link), within the client's export limit. Takes the bytes
    as pieces, so the source may be a local fd or a cluster node's outbox."""

    target: Path
    limit_bytes: int
    #: Owner given to exported files and folders (root server), e.g. the export folder's owner.
    owner: tuple[int, int] | None = None
    used_bytes: int = 0
    _fd: int | None = None

    def room(self) -> int:
        return self.limit_bytes - self.used_bytes

    def open(self) -> None:
        """Open the export folder (OSError if it cannot be used); only once there is something to copy."""
        if self._fd is None:
            self._fd = open_target(self.target, self.owner)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def write(self, rel: str, pieces: Iterable[bytes]) -> int:
        """Write rel from pieces; raises OverLimit past the room left, OSError otherwise."""
        self.open()
        assert self._fd is not None
        parts = rel.split("/")
        dest_dir = _make_dirs(self._fd, parts[:-1], self.owner)
        try:
            copied = self._write(pieces, dest_dir, parts[-1], self.room())
        finally:
            os.close(dest_dir)
        self.used_bytes += copied
        return copied

    def _write(self, pieces: Iterable[bytes], dest_dir: int, name: str, room: int) -> int:
        temp = f".{name[:200]}.coderunner-{secrets.token_hex(4)}"
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                      dir_fd=dest_dir)  # fmt: skip
        copied = 0
        try:
            try:
                for chunk in pieces:
                    copied += len(chunk)
                    if copied > room:
                        raise OverLimit
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out, view) :]
                if self.owner is not None:
                    os.fchown(out, *self.owner)
            finally:
                os.close(out)
            os.rename(temp, name, src_dir_fd=dest_dir, dst_dir_fd=dest_dir)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dest_dir)
            raise
        return copied


class Exporter:
    """Copies one outbox (a host path whose contents are hostile) to one client's export folder:
    an OutboxScan feeding an ExportWriter on one machine."""

    def __init__(self, outbox: Path, target: Path, limit_bytes: int, owner: tuple[int, int] | None = None) -> None:
        self.scan = OutboxScan(outbox)
        self.writer = ExportWriter(target, limit_bytes, owner)

    @property
    def target(self) -> Path:
        """The client's export folder, the writer's: a pooled session's taker changes it (manager.py)."""
        return self.writer.target

    @target.setter
    def target(self, folder: Path) -> None:
        self.writer.target = folder

    def redirect(self, target: Path, limit_bytes: int) -> None:
        """Copy to `target` instead, within `limit_bytes` at most (a cluster one-shot's folder of its own)."""
        self.writer.close()
        self.writer.target = target
        self.writer.limit_bytes = min(self.writer.limit_bytes, limit_bytes)

    def baseline(self) -> None:
        self.scan.baseline()

    def outbox_empty(self) -> bool:
        """Cheap enough for the event loop, unlike a walk: then export() has nothing to copy."""
        return self.scan.empty()

    def export(self) -> ExportReport:
        """Copy what is new or changed. Runs after every call, mostly to find nothing: the export
        folder is opened only once there is something to copy."""
        report = ExportReport(self.target)
        try:
            for rel, parent_fd, info in self.scan.changed(report):
                try:
                    self.writer.open()
                except OSError as exc:
                    report.skipped.append(f"the export folder {self.target} cannot be used ({exc.strerror})")
                    return report
                if not self._fits(rel, info, report):
                    continue
                opened = open_regular(parent_fd, rel)
                if opened is None:
                    continue
                src, opened_info = opened
                try:
                    copied = self.writer.write(rel, read_pieces(src))
                except (OverLimit, OSError) as exc:
                    report.skipped.append(f"{rel} ({skip_reason(exc)})")
                    self.scan.mark(rel, info)
                    continue
                finally:
                    os.close(src)
                self.scan.mark(rel, opened_info)
                report.copied.append(rel)
                report.bytes += copied
        finally:
            self.writer.close()
        return report

    def _fits(self, rel: str, info: os.stat_result, report: ExportReport) -> bool:
        room = self.writer.room()
        if info.st_size <= room:
            return True
        self.scan.mark(rel, info)  # reported once, not after every call
        report.skipped.append(over_limit(rel, info.st_size, room))
        return False


def over_limit(rel: str, size: int, room: int) -> str:
    return f"{rel} ({size:,} bytes: over the export limit, {max(room, 0):,} left)"


def skip_reason(exc: BaseException) -> str:
    if isinstance(exc, OverLimit):
        return "grew past the export limit while being copied"
    return (exc.strerror if isinstance(exc, OSError) else None) or "failed"


class OverLimit(Exception):
    """A file grew past the export limit while being written."""


def _signature(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns)


def _make_dirs(root_fd: int, parts: list[str], owner: tuple[int, int] | None) -> int:
    """An fd of root/parts..., creating folders, never following a link (ELOOP/ENOTDIR otherwise)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                next_fd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                next_fd = os.open(part, DIR_FLAGS, dir_fd=fd)
                if owner is not None:
                    os.fchown(next_fd, *owner)
            os.close(fd)
            fd = next_fd
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_target(folder: Path, owner: tuple[int, int] | None) -> int:
    """The client's export folder (created in export_dir, which only the host writes)."""
    parent = os.open(folder.parent, DIR_FLAGS)
    try:
        return _make_dirs(parent, [folder.name], owner)
    finally:
        os.close(parent)


#: A client's folder name as owners.py makes it: one component, lowercase ASCII, so that no two
#: clients' folders can be one folder on a case-insensitive or normalising file system.
CLIENT_FOLDER = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def client_folder(export_dir: Path, client: str) -> Path:
    """export_dir/<client>; refuses a name that is not canonical (owners.folder_name makes them)."""
    if not CLIENT_FOLDER.fullmatch(client):
        raise ExportError(errno.EINVAL, f"{client[:80]!r} is not a client folder name")
    return export_dir / client


def folder_owner(export_dir: Path, sandbox_uid: int | None = None) -> tuple[int, int] | None:
    """A root server gives exported files to the export folder's owner (the user who reads them),
    unless that is the sandbox user (older versions handed the folder to it): then they stay root's."""
    if os.getuid() != 0:
        return None
    info = os.stat(export_dir)
    if info.st_uid in (0, sandbox_uid):
        return None
    return (info.st_uid, info.st_gid)


def prepare_export_dir(path: Path) -> Path:
    """Create the export folder if missing; only the host writes it (sandboxes never see it)."""
    path = path.expanduser()
    try:
        path.mkdir(parents=True, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise ExportError(errno.EIO, f"the export folder {path} cannot be created: {exc.strerror}") from None
    return path.resolve()
