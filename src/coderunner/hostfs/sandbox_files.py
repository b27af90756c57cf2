"""The sandbox's files as the host may touch them: the workspace and the mounts, nothing else.

Paths are sandbox paths (`/workspace/a.csv`, `/data/x`, or relative to /workspace). Every
folder here is writable by untrusted code, which can plant symlinks, FIFOs and swap them
between a check and a use. So the host never lets the kernel follow a link for it: each path
component is opened relative to its parent's fd with O_NOFOLLOW; a symlink is read and its
target re-resolved *as a sandbox path* (so it can only lead to another place the sandbox could
see anyway, or be refused); only regular files are read or written.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import posixpath
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coderunner.errors import CodeRunnerError
from coderunner.vocabulary.mounts import Mount
from coderunner.vocabulary.sandbox_layout import WORKSPACE

#: How many symlinks one resolution may follow (the kernel's own limit).
MAX_SYMLINK_HOPS = 40
#: Entries one folder listing (read_file on a folder) returns at most.
MAX_LIST_ENTRIES = 2000


class FileAccessError(CodeRunnerError):
    """A file request that is refused or failed; the message is meant for the caller."""


@dataclass(frozen=True)
class Entry:
    path: str
    kind: str  # "file", "dir", "link", "other"
    size: int


@dataclass(frozen=True)
class Resolved:
    mount: Mount
    parts: tuple[str, ...]

    @property
    def sandbox_path(self) -> str:
        return posixpath.join(self.mount.sandbox, *self.parts) if self.parts else self.mount.sandbox


class SandboxFiles:
    """One session's file view: its workspace plus its mounts."""

    def __init__(
        self,
        mounts: list[Mount],
        owner: tuple[int, int] | None = None,
        owners: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        # Longest sandbox path first, so /mnt/outputs wins over a mount at /mnt.
        self.mounts = sorted(mounts, key=lambda mount: len(mount.sandbox), reverse=True)
        self.owner = owner
        #: Per mount (by sandbox path): who gets what the host creates there, instead of `owner`.
        self.owners = owners or {}

    def _owner_of(self, mount: Mount) -> tuple[int, int] | None:
        return self.owners.get(mount.sandbox, self.owner)

    def describe(self) -> str:
        return ", ".join(f"{m.sandbox} ({'rw' if m.writable else 'ro'})" for m in sorted(self.mounts, key=str))

    # --- resolution ---------------------------------------------------------------------------

    def _mount_of(self, path: str) -> Resolved:
        for mount in self.mounts:
            if path == mount.sandbox or path.startswith(mount.sandbox.rstrip("/") + "/"):
                rest = path[len(mount.sandbox) :].strip("/")
                return Resolved(mount, tuple(part for part in rest.split("/") if part))
        raise FileAccessError(
            f"{path} is outside what the sandbox shares with you: the workspace and mounts are {self.describe()}"
        )

    @staticmethod
    def normalize(path: str, base: str = WORKSPACE) -> str:
        if "\x00" in path:
            raise FileAccessError("a path cannot contain a NUL byte")
        joined = path if path.startswith("/") else posixpath.join(base, path)
        return posixpath.normpath(joined).replace("//", "/")

    def resolve(self, path: str) -> Resolved:
        """Map a sandbox path to (mount, parts), following symlinks the way the sandbox would see them.

        Only resolves; it opens nothing for use. The opening methods below walk again, with
        O_NOFOLLOW, so a link swapped in after this check is caught there.
        """
        current = self.normalize(path)
        for _ in range(MAX_SYMLINK_HOPS):
            resolved = self._mount_of(current)
            link = self._first_symlink(resolved)
            if link is None:
                return resolved
            index, target = link
            parent = posixpath.join(resolved.mount.sandbox, *resolved.parts[:index])
            rest = resolved.parts[index + 1 :]
            current = self.normalize(posixpath.join(target, *rest), base=parent)
        raise FileAccessError(f"{path}: too many levels of symbolic links")

    def confine(self, arguments: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
        """A copy of `arguments` whose named paths (a path, or a list of them) are resolved here first.

        A guest tool is handed only paths the host resolved in this view, so what it may touch is the
        host's decision; an escape is refused with FileAccessError before the guest is called.
        """
        confined = dict(arguments)
        for name in names:
            value = confined.get(name)
            if isinstance(value, str):
                confined[name] = self.resolve(value).sandbox_path
            elif isinstance(value, list):
                confined[name] = [self.resolve(str(item)).sandbox_path for item in value]
        return confined

    def _first_symlink(self, resolved: Resolved) -> tuple[int, str] | None:
        """(index, target) of the first component that is a symlink, or None."""
        fd = _open_dir(resolved.mount.host)
        try:
            for index, part in enumerate(resolved.parts):
                try:
                    info = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    return None  # the rest does not exist yet (write_file may create it)
                try:
                    if stat.S_ISLNK(info.st_mode):
                        return index, os.readlink(part, dir_fd=fd)
                    if index == len(resolved.parts) - 1 or not stat.S_ISDIR(info.st_mode):
                        return None
                    next_fd = _open_dir(part, dir_fd=fd)
                except OSError:  # swapped between the stat and this step: the sandbox is racing the host
                    raise FileAccessError(
                        f"{resolved.sandbox_path}: it changed while being looked up (a link swapped in or out); "
                        "nothing was read. Try again once nothing in the sandbox is changing it"
                    ) from None
                os.close(fd)
                fd = next_fd
            return None
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _parent_fd(self, resolved: Resolved, create: bool = False) -> Iterator[int]:
        """An fd for the folder holding the final component, walked with O_NOFOLLOW from the mount root."""
        fd = _open_dir(resolved.mount.host)
        try:
            for part in resolved.parts[:-1]:
                try:
                    next_fd = _open_dir(part, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.fsync(fd)  # the new folder's entry, for a write into it to be durable
                    next_fd = _open_dir(part, dir_fd=fd)
                    if (owner := self._owner_of(resolved.mount)) is not None:
                        os.fchown(next_fd, *owner)
                os.close(fd)
                fd = next_fd
            yield fd
        finally:
            os.close(fd)

    # --- operations ---------------------------------------------------------------------------

    def list(self, path: str = WORKSPACE, depth: int = 1) -> list[Entry]:
        resolved = self.resolve(path)
        entries: list[Entry] = []
        try:
            fd = self._open_resolved_dir(resolved)
        except OSError as exc:
            raise _refusal(resolved.sandbox_path, exc) from None
        try:
            self._walk(fd, resolved.sandbox_path, depth, entries)
        finally:
            os.close(fd)
        return entries

    def _open_resolved_dir(self, resolved: Resolved) -> int:
        if not resolved.parts:
            return _open_dir(resolved.mount.host)
        with self._parent_fd(resolved) as parent:
            return _open_dir(resolved.parts[-1], dir_fd=parent)

    def _walk(self, fd: int, prefix: str, depth: int, entries: builtins.list[Entry]) -> None:
        for name in sorted(os.listdir(fd)):
            if len(entries) >= MAX_LIST_ENTRIES:
                return
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            kind = _kind(info.st_mode)
            entries.append(Entry(posixpath.join(prefix, name), kind, info.st_size if kind == "file" else 0))
            if kind == "dir" and depth > 1:
                with contextlib.suppress(OSError):
                    child = _open_dir(name, dir_fd=fd)
                    try:
                        self._walk(child, posixpath.join(prefix, name), depth - 1, entries)
                    finally:
                        os.close(child)

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[tuple[int, int, str]]:
        """(fd, size, sandbox path) of a regular file, opened without following any link."""
        resolved = self.resolve(path)
        if not resolved.parts:
            raise FileAccessError(f"{resolved.sandbox_path} is a folder")
        try:
            with self._parent_fd(resolved) as parent:
                fd = os.open(resolved.parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=parent)  # fmt: skip
        except OSError as exc:
            raise _refusal(resolved.sandbox_path, exc) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FileAccessError(f"{resolved.sandbox_path} is not a regular file ({_kind(info.st_mode)})")
            yield fd, info.st_size, resolved.sandbox_path
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def open_write(self, path: str, *, overwrite: bool = True) -> Iterator[tuple[int, str]]:
        """(fd, sandbox path) of a regular file to write, creating folders; refuses read-only mounts.
        Once the caller's block ends without an error the file and its folder are fsynced."""
        resolved = self.resolve(path)
        if not resolved.parts:
            raise FileAccessError(f"{resolved.sandbox_path} is a folder")
        if not resolved.mount.writable:
            raise FileAccessError(f"{resolved.sandbox_path} is on the read-only mount {resolved.mount.sandbox}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        flags |= os.O_TRUNC if overwrite else os.O_EXCL
        try:
            with self._parent_fd(resolved, create=True) as parent:
                folder = os.dup(parent)
                try:
                    fd = os.open(resolved.parts[-1], flags, 0o644, dir_fd=parent)
                except BaseException:
                    os.close(folder)
                    raise
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                raise FileAccessError(f"{resolved.sandbox_path} already exists (pass overwrite=true)") from None
            raise _refusal(resolved.sandbox_path, exc) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FileAccessError(f"{resolved.sandbox_path} is not a regular file")
            if (owner := self._owner_of(resolved.mount)) is not None:
                os.fchown(fd, *owner)
            yield fd, resolved.sandbox_path
            # Written: on disk before the tool says so (a persistent workspace outlives the server).
            try:
                os.fsync(fd)
                os.fsync(folder)
            except OSError as exc:
                raise _refusal(resolved.sandbox_path, exc) from None
        finally:
            os.close(fd)
            os.close(folder)

    def read(self, path: str, offset: int = 0, limit: int | None = None) -> tuple[bytes, int, str]:
        """(bytes from offset, total size, sandbox path); at most `limit` bytes."""
        with self.open_read(path) as (fd, size, resolved):
            os.lseek(fd, offset, os.SEEK_SET)
            return _read_up_to(fd, size if limit is None else limit), size, resolved

    def write(self, path: str, data: bytes, *, overwrite: bool = True) -> str:
        with self.open_write(path, overwrite=overwrite) as (fd, resolved):
            try:
                _write_all(fd, data)
            except OSError as exc:
                raise _refusal(resolved, exc) from None
            return resolved


def copy(
    source: SandboxFiles, source_path: str, target: SandboxFiles, target_path: str, *, limit: int, overwrite: bool
) -> tuple[int, str, str]:
    """Stream one file between two views within `limit` bytes: (bytes, source path, target path)."""
    with source.open_read(source_path) as (src, size, resolved_source):
        if size > limit:
            raise FileAccessError(f"{resolved_source} is {size:,} bytes, over the transfer limit of {limit:,}")
        with target.open_write(target_path, overwrite=overwrite) as (dst, resolved_target):
            copied = 0
            try:
                while chunk := os.read(src, 1 << 20):
                    copied += len(chunk)
                    if copied > limit:
                        raise FileAccessError(f"{resolved_source} grew past the transfer limit while copying")
                    _write_all(dst, chunk)
            except OSError as exc:
                raise _refusal(resolved_target, exc) from None
    return copied, resolved_source, resolved_target


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _open_dir(path: str | Path, dir_fd: int | None = None) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _read_up_to(fd: int, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "other"


def _refusal(path: str, exc: OSError) -> FileAccessError:
    reasons = {
        errno.ENOENT: "does not exist",
        errno.ELOOP: "changed into a symbolic link while being opened; try again",
        errno.ENOTDIR: "has a part that is not a folder (or changed into a link)",
        errno.EISDIR: "is a folder",
        errno.EACCES: "is not accessible",
        errno.EROFS: "is on a read-only file system",
        errno.ENOSPC: "does not fit: the workspace is full",
        errno.ENXIO: "is not a regular file",
        errno.EEXIST: "already exists",
    }
    return FileAccessError(f"{path} {reasons.get(exc.errno or 0, exc.strerror or 'failed')}")
