"""Copying a folder tree the sandbox can write, by directory fds: links kept as links and never
followed, other mounts not entered, fifos, sockets and devices left out and named, and bounded in
depth, entries and bytes. The snapshot store copies workspaces out with it and back in.

Every entry is opened relative to its parent's fd with O_NOFOLLOW (a fifo cannot hold the open:
O_NONBLOCK) and checked by fstat after opening, so a name swapped for a link mid-copy is refused,
never followed. Files are copied with copy_file_range (a reflink where the file system shares
extents across the two paths, an in-kernel copy elsewhere); across file systems (a loop-mounted
workspace and the store) the kernel refuses it, and sendfile copies in the kernel instead (four
times faster than read/write through Python, which stays the last resort).
The caller supplies its own errors (past the byte cap, a destination that cannot be written).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from coderunner.hostfs import dirfd as hostfs

#: Folders below the top a copy enters at most, and entries it takes at most.
MAX_DEPTH = 64
MAX_ENTRIES = 200_000
#: Entries a copy's report names one by one; past these it counts them.
MAX_SKIPPED_NAMED = 100

#: Opening an entry the sandbox can write: never through a link, and a FIFO cannot hold the open.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: copy_file_range (or sendfile) cannot serve this pair of files: try the next way.
NO_COPY_RANGE = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
CHUNK = 1 << 30
#: The ways copy_bytes tries, in order: each next one only where the kernel refuses the one before.
COPY_RANGE, SENDFILE, READ_WRITE = "copy_file_range", "sendfile", "read/write"
READ_CHUNK = 1 << 20
SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


@dataclass
class CopyReport:
    """What one copy took, and what it left out (with why) so a reply can say it."""

    files: int = 0
    folders: int = 0
    links: int = 0
    bytes: int = 0
    #: "path: why" for each entry left out (fifo, socket, device, too deep, unreadable).
    skipped: list[str] = field(default_factory=list)


@dataclass
class ByteCap:
    """Bytes a copy (or several into one place) may still take."""

    limit: int
    #: The error to raise past the limit, from (the size so far, the limit): the caller's words.
    too_large: Callable[[int, int], Exception]
    used: int = 0

    @property
    def left(self) -> int:
        return self.limit - self.used


def copy_bytes(src: int, dst: int, limit: int) -> int:
    """Copy from `src`'s position to `dst`'s, at most `limit` + 1 bytes (one past the cap tells a file
    that grew beyond it); copy_file_range first (a reflink where the file system shares extents),
    sendfile where the two files are on different file systems, read/write where the kernel serves
    neither. Returns the bytes copied."""
    done = 0
    way = COPY_RANGE
    while done <= limit:
        want = min(limit + 1 - done, CHUNK)
        if way == READ_WRITE:
            data = os.read(src, min(want, READ_CHUNK))
            count = len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view) :]
        else:
            try:
                count = os.copy_file_range(src, dst, want) if way == COPY_RANGE else os.sendfile(dst, src, None, want)
            except OSError as exc:
                if exc.errno not in NO_COPY_RANGE:
                    raise
                way = SENDFILE if way == COPY_RANGE else READ_WRITE
                continue
        if count == 0:
            break
        done += count
    return done


def bounded_names(fd: int, limit: int) -> list[str]:
    """The names in folder `fd`, at most `limit` + 1 of them (a huge folder is not read whole)."""
    names: list[str] = []
    with os.scandir(fd) as listing:
        for entry in listing:
            names.append(entry.name)
            if len(names) > limit:
                break
    return names


def fast_mount_id(fd: int) -> int:
    """hostfs.mount_id without the text-file layer: it runs once per entry copied, and this form
    takes less than half the time (a third of a small-file copy went there)."""
    info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(info, 8192)
    finally:
        os.close(info)
    start = data.find(b"\nmnt_id:")
    if start < 0:
        raise hostfs.HostFsError(errno.EINVAL, "no mnt_id in fdinfo")
    start += len(b"\nmnt_id:")
    end = data.find(b"\n", start)
    return int(data[start : end if end >= 0 else len(data)])


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


@dataclass
class _Level:
    """One folder being copied: the source and destination fds, its path for reports, what is left."""

    src: int
    dst: int
    rel: str
    names: list[str]
    #: The folder's mode and times, set on the destination once it is filled (None: the top).
    info: os.stat_result | None = None


class TreeCopy:
    """One copy of a folder tree that may be hostile: links kept as links and never followed, one fd
    per level, other mounts not entered, bounded in depth, entries and bytes."""

    def __init__(
        self,
        cap: ByteCap,
        *,
        write_failed: Callable[[OSError], Exception],
        owner: tuple[int, int] | None,
        file_bits: int,
        dir_bits: int,
        exclude: str | None = None,
    ) -> None:
        self.cap = cap
        #: The error for a destination that cannot be written (a full disk): the caller's words.
        self.write_failed = write_failed
        self.owner = owner
        self.file_bits = file_bits
        self.dir_bits = dir_bits
        self.exclude = exclude
        self.report = CopyReport()
        self.seen = 0
        #: Entries left out past MAX_SKIPPED_NAMED: counted, not named.
        self.unnamed = 0

    def run(self, src_top: int, dst_top: int) -> CopyReport:
        self.top_mount = fast_mount_id(src_top)
        stack: list[_Level] = []
        try:
            stack.append(_Level(os.dup(src_top), os.dup(dst_top), "", []))
            stack[0].names = self._names(stack[0].src, "")
            while stack:
                level = stack[-1]
                if not level.names:
                    self._finish(stack.pop())
                    continue
                if self.seen >= MAX_ENTRIES:
                    where = shown(level.rel or ".")
                    self.report.skipped.append(f"{where}: more than {MAX_ENTRIES} entries, the rest left out")
                    break
                self.seen += 1
                name = level.names.pop()
                child = self._entry(level, name, depth=len(stack))
                if child is not None:
                    stack.append(child)
        finally:
            for level in stack:
                _close(level.src)
                _close(level.dst)
        if self.unnamed:
            self.report.skipped.append(f"... and {self.unnamed} more entries left out")
        return self.report

    def _skip(self, rel: str, why: str) -> None:
        if len(self.report.skipped) < MAX_SKIPPED_NAMED:
            self.report.skipped.append(f"{shown(rel)}: {why}")
        else:
            self.unnamed += 1

    def _names(self, fd: int, rel: str) -> list[str]:
        names = bounded_names(fd, MAX_ENTRIES - self.seen)
        names.sort(reverse=True)  # popped from the end: copied in name order
        return names

    def _entry(self, level: _Level, name: str, depth: int) -> _Level | None:
        rel = f"{level.rel}/{name}" if level.rel else name
        if rel == self.exclude:
            return None
        try:
            info = os.stat(name, dir_fd=level.src, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._skip(rel, f"unreadable ({exc.strerror})")
            return None
        if stat.S_ISDIR(info.st_mode):
            if depth > MAX_DEPTH:
                self._skip(rel, f"folder more than {MAX_DEPTH} levels deep, left out")
                return None
            return self._enter(level, name, rel)
        if stat.S_ISREG(info.st_mode):
            self._copy_file(level, name, rel)
        elif stat.S_ISLNK(info.st_mode):
            self._copy_link(level, name, rel)
        else:
            self._skip(rel, f"{kind_of(info.st_mode)}, left out")
        return None

    def _enter(self, level: _Level, name: str, rel: str) -> _Level | None:
        try:
            src = hostfs.open_dir(name, dir_fd=level.src)
        except OSError as exc:
            self._skip(rel, changed_reason(exc))
            return None
        try:
            info = os.fstat(src)
            if fast_mount_id(src) != self.top_mount:
                self._skip(rel, "another mount, left out")
                _close(src)
                return None
            names = self._names(src, rel)
            dst = self._make_dir(level.dst, name)
        except BaseException:
            _close(src)
            raise
        self.report.folders += 1
        return _Level(src, dst, rel, names, info)

    def _make_dir(self, parent: int, name: str) -> int:
        """The destination folder: made fresh, or (in a restore's fresh workspace, which the host
        made and no sandbox has seen yet) one the host made before, entered without following."""
        try:
            return hostfs.make_private_dir(parent, name, 0o700, self.owner)
        except FileExistsError:
            pass
        except OSError as exc:
            raise self.write_failed(exc) from exc
        try:
            fd = hostfs.open_dir(name, dir_fd=parent)
            if self.owner is not None:
                os.fchown(fd, *self.owner)
        except OSError as exc:
            raise self.write_failed(exc) from exc
        return fd

    def _finish(self, level: _Level) -> None:
        try:
            if level.info is not None:
                os.fchmod(level.dst, (stat.S_IMODE(level.info.st_mode) & ~SPECIAL_BITS) | self.dir_bits)
                os.utime(level.dst, ns=(level.info.st_atime_ns, level.info.st_mtime_ns))
        finally:
            _close(level.src)
            _close(level.dst)

    def _copy_file(self, level: _Level, name: str, rel: str) -> None:
        try:
            src = os.open(name, FILE_FLAGS, dir_fd=level.src)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._skip(rel, changed_reason(exc))
            return
        try:
            info = os.fstat(src)
            if not stat.S_ISREG(info.st_mode):
                self._skip(rel, f"changed while copied ({kind_of(info.st_mode)}), left out")
                return
            if fast_mount_id(src) != self.top_mount:
                self._skip(rel, "another mount, left out")
                return
            if info.st_size > self.cap.left:
                raise self.cap.too_large(self.cap.used + info.st_size, self.cap.limit)
            try:
                dst = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=level.dst)
            except FileExistsError:
                self._skip(rel, "already in the workspace, kept as it was")
                return
            except OSError as exc:
                raise self.write_failed(exc) from exc
            try:
                try:
                    count = copy_bytes(src, dst, self.cap.left)
                except OSError as exc:
                    raise self.write_failed(exc) from exc
                if count > self.cap.left:
                    raise self.cap.too_large(self.cap.used + count, self.cap.limit)
                self.cap.used += count
                self.report.bytes += count
                self.report.files += 1
                if self.owner is not None:
                    os.fchown(dst, *self.owner)
                os.fchmod(dst, (stat.S_IMODE(info.st_mode) & ~SPECIAL_BITS) | self.file_bits)
                os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))
            finally:
                os.close(dst)
        finally:
            os.close(src)

    def _copy_link(self, level: _Level, name: str, rel: str) -> None:
        try:
            target = os.readlink(name, dir_fd=level.src)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._skip(rel, changed_reason(exc))
            return
        try:
            os.symlink(target, name, dir_fd=level.dst)
        except FileExistsError:
            self._skip(rel, "already in the workspace, kept as it was")
            return
        except OSError as exc:
            raise self.write_failed(exc) from exc
        try:
            if self.owner is not None:
                os.chown(name, *self.owner, dir_fd=level.dst, follow_symlinks=False)
        except OSError as exc:
            raise self.write_failed(exc) from exc
        self.report.links += 1


def shown(rel: str) -> str:
    """A path fit for a reply: bytes that are not UTF-8 and control characters (a name may hold a
    newline to forge a line) become '?', and a long path is cut."""
    text = rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    text = "".join("?" if ch < " " or ch == "\x7f" or ch == "\ufffd" else ch for ch in text)
    return text if len(text) <= 300 else text[:297] + "..."


def kind_of(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISLNK(mode):
        return "a link"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def changed_reason(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EINVAL):
        return "changed while copied, left out"
    return f"unreadable ({exc.strerror}), left out"
