"""Staging mounts: a root server shows a host folder to a sandbox through a host-private mount point.

A sandbox backend binds folders by path, as the sandbox's host user. Two things break that on a
root server: a folder under a 0700 parent (every `mktemp -d`, all of /root) cannot be passed by
that user, and a folder inside a sandbox-writable tree (the export outbox in a workspace) could
have a path component swapped for a link between our check and the bind. So root opens the
folder itself (O_PATH, no link followed), clones it as a detached mount (open_tree), optionally
id-maps it (mount_setattr MOUNT_ATTR_IDMAP: the folder owner's files appear as the sandbox's own
and what the sandbox writes lands as the owner), and attaches it at a point in a host-only dir
(move_mount). The backend binds that point; nothing of the host's permissions is loosened.

Staged points are detached (MNT_DETACH, UMOUNT_NOFOLLOW) at close and by a later server's cleanup
of a dead server's dirs, before anything there is deleted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Syscall numbers shared by x86_64 and the generic table (arm64, riscv64).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x100000
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
#: Bound on the helper process whose user namespace describes an id mapping.
USERNS_HELPER_TIMEOUT_S = 10
#: Mounts stacked on one staged point that detach() removes at most.
MAX_STACKED = 16


class StagingError(OSError):
    """A folder could not be staged; the message says why."""


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise StagingError(code, f"{what}: {os.strerror(code)}")
    return result


def _open_tree(fd: int) -> int:
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH
    return _check(_libc.syscall(SYS_OPEN_TREE, ctypes.c_int(fd), b"", ctypes.c_uint(flags)), "open_tree")


def _set_attrs(tree_fd: int, attr_set: int, userns_fd: int = 0) -> None:
    attr = _MountAttr(attr_set=attr_set, attr_clr=0, propagation=0, userns_fd=userns_fd)
    _check(
        _libc.syscall(SYS_MOUNT_SETATTR, ctypes.c_int(tree_fd), b"", ctypes.c_uint(AT_EMPTY_PATH),
                      ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
        "mount_setattr",
    )  # fmt: skip


def _move_mount(tree_fd: int, target: Path) -> None:
    _check(
        _libc.syscall(SYS_MOVE_MOUNT, ctypes.c_int(tree_fd), b"", ctypes.c_int(-100), os.fsencode(target),
                      ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)),
        "move_mount",
    )  # fmt: skip


def detach(point: Path) -> bool:
    """Detach whatever is mounted on `point` (lazily; never following a link). True if nothing is left.

    os.path.ismount cannot see a bind mount from the same file system, so this asks umount2
    itself until it answers EINVAL (not a mount point).
    """
    for _ in range(MAX_STACKED):
        if _libc.umount2(os.fsencode(point), ctypes.c_int(MNT_DETACH | UMOUNT_NOFOLLOW)) == 0:
            continue
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOENT):
            return True
        log.warning("could not detach staged mount %s: %s", point, os.strerror(code))
        return False
    return False


def available() -> bool:
    """Staging needs root (CAP_SYS_ADMIN in the host's mount namespace)."""
    return os.getuid() == 0


@dataclass(frozen=True)
class IdMap:
    """Show files of host uid/gid `owner` as `sandbox` through the mount (and store the reverse)."""

    owner: tuple[int, int]
    sandbox: tuple[int, int]


#: User namespace fds kept for reuse, oldest dropped first.
MAX_CACHED_USERNS = 32
_userns_cache: dict[IdMap, int] = {}
_userns_lock = threading.Lock()


def _userns_fd(idmap: IdMap) -> int:
    """A user namespace fd whose maps say owner -> sandbox (a dup of one kept per mapping)."""
    with _userns_lock:
        if idmap not in _userns_cache:
            if len(_userns_cache) >= MAX_CACHED_USERNS:  # per-session uids make many mappings
                os.close(_userns_cache.pop(next(iter(_userns_cache))))
            _userns_cache[idmap] = _make_userns_fd(idmap)
        return os.dup(_userns_cache[idmap])


def _make_userns_fd(idmap: IdMap) -> int:
    """Made with a short-lived helper process: unshare(1) starts it, root writes its maps."""
    helper = subprocess.Popen(
        ["/usr/bin/unshare", "--user", "--", "/bin/sh", "-c", "echo ready; read _"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    try:
        assert helper.stdout is not None and helper.stdin is not None
        ready = _read_line(helper.stdout.fileno(), USERNS_HELPER_TIMEOUT_S)
        if ready != b"ready":
            raise StagingError(errno.EIO, "the user-namespace helper did not start")
        for name, (inside, outside) in (("uid_map", (idmap.owner[0], idmap.sandbox[0])),
                                        ("gid_map", (idmap.owner[1], idmap.sandbox[1]))):  # fmt: skip
            with open(f"/proc/{helper.pid}/{name}", "w") as handle:
                handle.write(f"{inside} {outside} 1\n")
        return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        with contextlib.suppress(OSError):
            helper.stdin.close()  # type: ignore[union-attr]  # made with stdin=PIPE
        try:
            helper.wait(timeout=USERNS_HELPER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait(timeout=5)


def _read_line(fd: int, timeout_s: float) -> bytes:
    """poll, not select: a server holding many sessions has fds past select's 1,024."""
    import select

    waiting = select.poll()
    waiting.register(fd, select.POLLIN)
    return os.read(fd, 64).strip() if waiting.poll(timeout_s * 1000) else b""


def stage(source_fd: int, point: Path, *, read_only: bool, idmap: IdMap | None = None) -> bool:
    """Attach the folder open as `source_fd` (O_PATH is enough) at `point`, an empty host-only dir.

    Returns whether the id mapping took (False: staged without one, because this kernel or file
    system cannot id-map). Raises StagingError when even a plain clone fails.
    """
    if not stat.S_ISDIR(os.fstat(source_fd).st_mode):
        raise StagingError(errno.ENOTDIR, "not a folder")
    tree = _open_tree(source_fd)
    try:
        attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (MOUNT_ATTR_RDONLY if read_only else 0)
        mapped = False
        if idmap is not None and idmap.owner != idmap.sandbox:
            userns = -1
            try:
                userns = _userns_fd(idmap)
                _set_attrs(tree, attrs | MOUNT_ATTR_IDMAP, userns)
                mapped = True
            except (StagingError, OSError) as exc:
                log.info("id-mapped mount not possible here (%s); staging without a mapping", exc)
            finally:
                if userns >= 0:
                    os.close(userns)
        if not mapped:
            _set_attrs(tree, attrs)
        _move_mount(tree, point)
        return mapped
    finally:
        os.close(tree)


def idmap_supported(path: Path, owner: tuple[int, int], sandbox: tuple[int, int]) -> bool:
    """Can `path` be id-mapped here? Tried on a detached clone that vanishes when its fd closes."""
    if not available():
        return False
    try:
        fd = open_folder(path)
    except OSError:
        return False
    try:
        tree = _open_tree(fd)
    except StagingError:
        os.close(fd)
        return False
    userns = -1
    try:
        userns = _userns_fd(IdMap(owner, sandbox))
        _set_attrs(tree, MOUNT_ATTR_IDMAP, userns)
        return True
    except (StagingError, OSError):
        return False
    finally:
        for handle in (userns, tree, fd):
            if handle >= 0:
                os.close(handle)


def open_folder(path: Path) -> int:
    """An O_PATH fd of a configured host folder, the last component not followed."""
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def release_all(parent: Path) -> bool:
    """Detach every staged point in `parent` (a host-only dir) and remove the points; True if all went."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    clean = True
    for name in names:
        point = parent / name
        if not detach(point):
            clean = False
            continue
        with contextlib.suppress(OSError):
            os.rmdir(point)
    if clean:
        with contextlib.suppress(OSError):
            os.rmdir(parent)
    return clean
