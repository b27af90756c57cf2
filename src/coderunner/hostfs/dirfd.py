"""File operations the host may do where the sandbox can write, and only these.

Everything a sandbox can write is hostile at every moment: any name in it may be a link, a FIFO,
a socket or a deep tree by the time the host looks. So the host never resolves a path there.
It holds directory fds, opens each entry relative to one with O_NOFOLLOW, checks the type (and
where it matters the owner) of what it got, and removes trees without recursion, without
following links and without leaving the mount it started on.

One idea: the fd primitives the host may use where a sandbox writes (open, walk, copy, rename, remove, sync),
kept together so every caller gets the same O_NOFOLLOW discipline.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Bound on the entries one tree removal or size walk visits (a workspace cannot hold more in
#: practice; a hostile one gets cut off here instead of holding the server).
MAX_TREE_ENTRIES = 5_000_000


class HostFsError(OSError):
    """An entry was not what the host expected (a link, another type or owner): refused."""


def open_dir(name: str | Path, dir_fd: int | None = None) -> int:
    """An fd for a real directory: never through a link in the last component."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


@contextlib.contextmanager
def dir_fd(path: str | Path) -> Iterator[int]:
    fd = open_dir(path)
    try:
        yield fd
    finally:
        os.close(fd)


def make_private_dir(parent_fd: int, name: str, mode: int, owner: tuple[int, int] | None = None) -> int:
    """Create a fresh directory (never an existing one) and return its fd; `owner` gets it by fchown."""
    os.mkdir(name, mode, dir_fd=parent_fd)
    fd = open_dir(name, dir_fd=parent_fd)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)  # mkdir's mode passes through the umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_new_file(
    parent_fd: int, name: str, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None
) -> None:
    """Create `name` (it must not exist yet) and write `data`; ownership and mode set on the fd."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def mount_id(fd: int) -> int:
    """The mount an fd lies on (from /proc/self/fdinfo): tells bind mounts of one file system apart."""
    with open(f"/proc/self/fdinfo/{fd}") as handle:
        for line in handle:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise HostFsError(errno.EINVAL, "no mnt_id in fdinfo")


def claim_socket(from_fd: int, name: str, to_fd: int, uid: int) -> None:
    """Move a socket the sandbox made out of its reach, then check it is one and is the sandbox's.

    The rename moves the directory entry itself (a link stays a link), so after it nothing the
    sandbox does can change what the name in `to_fd` refers to; a link, a FIFO or anything not
    owned by `uid` is removed again and refused, never connected to.
    """
    os.rename(name, name, src_dir_fd=from_fd, dst_dir_fd=to_fd)
    info = os.stat(name, dir_fd=to_fd, follow_symlinks=False)
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != uid:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=to_fd)
        raise HostFsError(errno.EPERM, f"{name} is not a socket of the sandbox user")


def remove_tree(parent_fd: int, name: str) -> list[str]:
    """Delete `name` under `parent_fd` and everything below it; returns what was left, and why.

    No recursion: a subfolder is first moved up to the top folder (a rename within the same
    mount), so a tree of any depth needs two open fds. Nothing is followed: links are unlinked,
    and a folder on another mount (a bind or loop mount not yet unmounted) is left untouched.
    """
    try:
        top = open_dir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            os.unlink(name, dir_fd=parent_fd)
            return []
        raise
    left: list[str] = []
    try:
        top_mount = mount_id(top)
        pending = _Budget(MAX_TREE_ENTRIES)
        _empty_dir(top, top_mount, left, pending, _Names())
    finally:
        os.close(top)
    if not left:
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except OSError as exc:
            left.append(f"{name}: {exc.strerror}")
    return left


@dataclass
class _Budget:
    remaining: int

    def spend(self) -> None:
        self.remaining -= 1
        if self.remaining < 0:
            raise HostFsError(errno.E2BIG, f"more than {MAX_TREE_ENTRIES} entries")


@dataclass
class _Names:
    """Fresh names for folders moved up to the top (checked free before use)."""

    counter: int = 0

    def fresh(self, top: int) -> str:
        while True:
            self.counter += 1
            name = f".coderunner-rm-{self.counter}"
            try:
                os.stat(name, dir_fd=top, follow_symlinks=False)
            except FileNotFoundError:
                return name


def _empty_dir(top: int, top_mount: int, left: list[str], budget: _Budget, names: _Names) -> None:
    """Empty `top`: unlink non-folders, hoist subfolders of subfolders into `top`, rmdir the emptied."""
    stuck: set[str] = set()
    while True:
        progressed = False
        for entry in entries(top):
            if entry in stuck:
                continue
            budget.spend()
            progressed = True
            if not _is_dir(top, entry):
                _unlink(top, entry)
                continue
            problem = _empty_child(top, entry, top_mount, budget, names)
            if problem is None:
                try:
                    os.rmdir(entry, dir_fd=top)
                    continue
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    problem = exc.strerror or "cannot remove"
            stuck.add(entry)
            left.append(f"{entry}: {problem}")
        if not progressed:
            return


def _empty_child(top: int, entry: str, top_mount: int, budget: _Budget, names: _Names) -> str | None:
    """Unlink what `entry` holds and move its folders up into `top`; why it cannot be, or None."""
    try:
        child = open_dir(entry, dir_fd=top)
    except OSError:
        _unlink(top, entry)  # turned into something else meanwhile
        return None
    try:
        if mount_id(child) != top_mount:
            return "another mount (left in place)"
        for inner in entries(child):
            budget.spend()
            if _is_dir(child, inner):
                try:
                    os.rename(inner, names.fresh(top), src_dir_fd=child, dst_dir_fd=top)
                except OSError as exc:  # a mount point (EBUSY), ...
                    return f"{inner}: {exc.strerror}"
            else:
                _unlink(child, inner)
    finally:
        os.close(child)
    return None


def entries(fd: int) -> list[str]:
    """The names in the folder `fd` (none followed, none opened)."""
    with os.scandir(fd) as listing:
        return [entry.name for entry in listing]


def unowned_socket(fd: int, name: str, uid: int) -> bool:
    """Is `name` in folder `fd` a socket that `uid` does not own (yet)? Links are not followed."""
    try:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISSOCK(info.st_mode) and info.st_uid != uid


def present(fd: int, name: str) -> bool:
    """Is there an entry `name` in the folder `fd` (whatever it is; a link is not followed)?"""
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _is_dir(fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _unlink(fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=fd)


@dataclass
class _Level:
    fd: int
    names: list[str]


def walk(fd: int, max_depth: int = 256, max_entries: int = 1_000_000) -> Iterator[tuple[int, str, os.stat_result]]:
    """(folder fd, name, lstat) for every entry under the folder `fd`, depth first, links not followed.

    One fd per level, at most `max_depth` levels, `max_entries` entries; folders on another mount
    are not entered. Raises HostFsError("incomplete") at the end when a bound cut the walk short.
    """
    top_mount = mount_id(fd)
    stack = [_Level(os.dup(fd), entries(fd))]
    seen, complete = 0, True
    try:
        while stack:
            level = stack[-1]
            if not level.names:
                os.close(stack.pop().fd)
                continue
            name = level.names.pop()
            seen += 1
            if seen > max_entries:
                complete = False
                break
            try:
                info = os.stat(name, dir_fd=level.fd, follow_symlinks=False)
            except OSError:
                continue
            yield level.fd, name, info
            if not stat.S_ISDIR(info.st_mode):
                continue
            if len(stack) >= max_depth:
                complete = False
                continue
            try:
                child = open_dir(name, dir_fd=level.fd)
            except OSError:
                continue
            if mount_id(child) != top_mount:
                os.close(child)
                continue
            try:
                stack.append(_Level(child, entries(child)))
            except OSError:
                os.close(child)
    finally:
        for level in stack:
            os.close(level.fd)
    if not complete:
        raise HostFsError(errno.E2BIG, "incomplete")


def tree_size(fd: int, max_entries: int = 100_000) -> tuple[int, bool]:
    """(bytes of regular files under the folder `fd`, complete?) without following links or mounts."""
    total = 0
    try:
        for _parent, _name, info in walk(fd, max_entries=max_entries):
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    except HostFsError:
        return total, False
    return total, True


def chown_tree(fd: int, owner: tuple[int, int]) -> bool:
    """Give the folder `fd` and every entry under it to `owner`, links themselves never followed.

    For a persistent workspace reopened under another uid. True when the whole tree was reached.
    """
    os.fchown(fd, *owner)
    try:
        for parent, name, _info in walk(fd):
            with contextlib.suppress(FileNotFoundError):
                os.chown(name, *owner, dir_fd=parent, follow_symlinks=False)
    except HostFsError:
        return False
    return True


def sync_tree(fd: int) -> None:
    """fsync every regular file and folder under the host-only folder `fd`, then the folder itself:
    what it holds is on disk once this returns (raises OSError otherwise). Links are not followed
    and other mounts not entered (hostfs.walk); the entries are opened by the folder's fds."""
    for parent, name, info in walk(fd):
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            continue  # a link's own entry is made durable by its folder's fsync
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        entry = os.open(name, flags | (os.O_DIRECTORY if stat.S_ISDIR(info.st_mode) else 0), dir_fd=parent)
        try:
            os.fsync(entry)
        finally:
            os.close(entry)
    os.fsync(fd)


def syncfs(fd: int) -> None:
    """Write out everything cached for the file system `fd` lies on (syncfs(2)); raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"syncfs: {os.strerror(code)}")


#: renameat2's flag: fail with EEXIST instead of replacing what the new name holds.
RENAME_NOREPLACE = 1


def rename_noreplace(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """Rename `src` to `dst` (each relative to a dir fd) only if `dst` does not exist (EEXIST).

    One step, so a dir can be built under a temporary name and appear whole under its real one.
    Where renameat2 is missing (old libc or file system) plain rename stands in: it replaces an
    empty dir at most, never a file or a non-empty dir, so it replaces nothing that holds a lock.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "renameat2", None)
    if call is not None:
        if call(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, f"could not rename {src} to {dst}: {os.strerror(code)}")
    os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


#: A dir under construction is `.new-<name>`; it gets <name> (publish_dir) only once whole and locked.
NEW_PREFIX = ".new-"
#: The flock a live owner holds in such a dir for as long as it lives.
LOCK_NAME = "lock"
#: The lock file's name until it is flocked (a sweep never opens it).
NEW_LOCK_NAME = "lock.new"
#: A `.new-` dir without its lock this long after its last change is abandoned: making one takes
#: milliseconds between the steps that leave it without a lock, not an hour.
ABANDONED_AFTER_S = 3600.0


def make_locked_dir(base_fd: int, name: str, mode: int) -> tuple[int, int]:
    """A fresh `.new-<name>` under `base_fd` whose LOCK_NAME this process holds: (dir fd, lock fd).

    The lock file is flocked under another name and only then renamed to LOCK_NAME, so a sweep
    (servers sharing a dir sweep each other's) never finds the lock there unheld while its owner
    lives. The caller fills the dir, then gives it its name with publish_dir.
    """
    top_fd = make_private_dir(base_fd, NEW_PREFIX + name, mode)
    lock_fd = -1
    try:
        lock_fd = os.open(NEW_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=top_fd)  # fmt: skip
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(NEW_LOCK_NAME, LOCK_NAME, src_dir_fd=top_fd, dst_dir_fd=top_fd)
    except BaseException:
        os.close(top_fd)
        with contextlib.suppress(OSError):
            remove_tree(base_fd, NEW_PREFIX + name)
        if lock_fd >= 0:
            os.close(lock_fd)
        raise
    return top_fd, lock_fd


def publish_dir(base_fd: int, name: str) -> None:
    """Give a whole, locked `.new-<name>` its name, in one step and never over another's (EEXIST)."""
    rename_noreplace(base_fd, NEW_PREFIX + name, base_fd, name)
