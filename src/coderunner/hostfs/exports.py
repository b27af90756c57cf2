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
class Exporter:
    """Copies one outbox (a host path whose contents are hostile) to one client's export folder."""

    outbox: Path
    target: Path
    limit_bytes: int
    #: Owner given to exported files and folders (root server), e.g. the export folder's owner.
    owner: tuple[int, int] | None = None
    #: rel path -> (size, mtime_ns, ino, ctime_ns) as last exported (or found at open).
    _seen: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    used_bytes: int = 0

    def baseline(self) -> None:
        """Count what the outbox already holds (a reopened workspace) as exported: never re-copy it."""
        for rel, _fd, info in self._files():
            self._seen[rel] = _signature(info)

    def export(self) -> ExportReport:
        """Copy what is new or changed. Runs after every call, mostly to find nothing: the export
        folder is opened only once there is something to copy."""
        report = ExportReport(self.target)
        target_fd: int | None = None
        try:
            for rel, parent_fd, info in self._files(report):
                if self._seen.get(rel) == _signature(info):
                    continue
                if target_fd is None:
                    try:
                        target_fd = open_target(self.target, self.owner)
                    except OSError as exc:
                        report.skipped.append(f"the export folder {self.target} cannot be used ({exc.strerror})")
                        return report
                self._copy_one(parent_fd, rel, info, target_fd, report)
        finally:
            if target_fd is not None:
                os.close(target_fd)
        return report

    def outbox_empty(self) -> bool:
        """Whether the outbox holds no entry at all (its first directory read; nothing followed): then
        export() has nothing to copy. Cheap enough for the event loop, unlike a walk."""
        try:
            fd = os.open(self.outbox, DIR_FLAGS)
        except OSError:
            return True  # export() finds nothing either
        try:
            with os.scandir(fd) as entries:
                return next(entries, None) is None
        finally:
            os.close(fd)

    def _files(self, report: ExportReport | None = None):
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

    def _copy_one(self, parent_fd: int, rel: str, info: os.stat_result, target_fd: int,
                  report: ExportReport) -> None:  # fmt: skip
        name = rel.rsplit("/", 1)[-1]
        room = self.limit_bytes - self.used_bytes
        if info.st_size > room:
            self._seen[rel] = _signature(info)  # reported once, not after every call
            report.skipped.append(f"{rel} ({info.st_size:,} bytes: over the export limit, {max(room, 0):,} left)")
            return
        try:
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent_fd)
        except OSError:
            return
        try:
            opened = os.fstat(src)
            if not stat.S_ISREG(opened.st_mode):
                return
            dest_dir = _make_dirs(target_fd, rel.split("/")[:-1], self.owner)
            try:
                copied = self._write(src, dest_dir, name, room)
            finally:
                os.close(dest_dir)
        except _OverLimit:
            report.skipped.append(f"{rel} (grew past the export limit while being copied)")
            self._seen[rel] = _signature(info)
            return
        except OSError as exc:
            report.skipped.append(f"{rel} ({exc.strerror or 'failed'})")
            self._seen[rel] = _signature(info)
            return
        finally:
            os.close(src)
        self.used_bytes += copied
        self._seen[rel] = _signature(opened)
        report.copied.append(rel)
        report.bytes += copied

    def _write(self, src: int, dest_dir: int, name: str, room: int) -> int:
        temp = f".{name[:200]}.coderunner-{secrets.token_hex(4)}"
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                      dir_fd=dest_dir)  # fmt: skip
        copied = 0
        try:
            try:
                while chunk := os.read(src, CHUNK):
                    copied += len(chunk)
                    if copied > room:
                        raise _OverLimit
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


class _OverLimit(Exception):
    pass


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
