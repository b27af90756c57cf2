"""A session's workspace on the host, with a size cap where the machine allows one.

As root, the workspace is a sparse ext4 image loop-mounted on the workspace dir (nosuid,
nodev): filling it gives ENOSPC inside the sandbox and costs the host at most its size.
A throwaway workspace (a one-shot run's, gone with the run) is a size-capped tmpfs instead:
one mount syscall rather than mkfs and a loop device (about 12 ms to make and 6 ms to remove).
Without root there is no portable way to cap a directory, so the cap is reported as not
enforced (the sandbox's /tmp is size-capped either way).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from coderunner.errors import CodeRunnerError
from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs import staging
from coderunner.hostfs.blank_images import copy_blank
from coderunner.hostfs.loop_mount import LoopMountUnsupported, loop_mount
from coderunner.hostfs.private_dirs import ensure_private_dir

log = logging.getLogger(__name__)

#: Bound on waiting for a persistent image's file system to be let go by every mount namespace.
LOOP_RELEASE_S = 10.0
#: Bound on each mkfs/mount/umount call.
COMMAND_TIMEOUT_S = 30
#: mount(2) flags of a throwaway workspace's tmpfs.
MS_NOSUID, MS_NODEV = 2, 4
#: umount2(2) flags.
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
#: Inodes per MiB of a tmpfs workspace: mkfs.ext4's default ratio (one per 16 KiB), so that
#: a flood of empty files is bounded as on an image.
TMPFS_INODES_PER_MB = 64
_libc = ctypes.CDLL(None, use_errno=True)


class WorkspaceError(CodeRunnerError):
    """A persistent workspace that cannot be used as asked; the message says why."""


def _run(argv: list[str]) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.CalledProcessError as exc:
        raise WorkspaceError(f"{argv[0]} failed: {exc.stderr.decode(errors='replace').strip()}") from None
    except subprocess.TimeoutExpired:
        raise WorkspaceError(f"{argv[0]} did not finish in {COMMAND_TIMEOUT_S}s") from None


def _mount_image(image: Path, path: Path) -> None:
    """Loop-mount `image` on `path` (nosuid, nodev): by syscalls (loop_mount.py), else by the `mount` program."""
    try:
        loop_mount(image, path)
    except LoopMountUnsupported as exc:
        log.debug("loop mount by syscalls unsupported here (%s): the mount program instead", exc)
        _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(path)])
    except OSError as exc:
        raise WorkspaceError(f"mount failed: {exc}") from None


def _unmount(path: Path, lazily: bool = True) -> None:
    """Unmount `path` by umount2 (never following a link; no `umount` program started); still busy, detach it
    lazily if `lazily` (its file system goes once nothing uses it). Raises WorkspaceError saying why not."""
    point = os.fsencode(path)
    if _libc.umount2(point, ctypes.c_int(UMOUNT_NOFOLLOW)) == 0:
        return
    code = ctypes.get_errno()
    if lazily and code == errno.EBUSY and _libc.umount2(point, ctypes.c_int(MNT_DETACH | UMOUNT_NOFOLLOW)) == 0:
        return
    code = ctypes.get_errno() or code
    raise WorkspaceError(f"umount of {path} failed: {os.strerror(code)}")


def quota_problem() -> str | None:
    """Why workspaces cannot be size-capped here, or None."""
    if os.getuid() != 0:
        return "needs root (a loop-mounted image); only /tmp is size-capped"
    for tool in ("mkfs.ext4", "mount"):  # mount: where loop devices cannot be set up by syscalls (loop_mount.py)
        if shutil.which(tool) is None:
            return f"{tool} is missing: sudo apt-get install e2fsprogs mount"
    if not Path("/dev/loop-control").exists():
        return "no loop devices (/dev/loop-control) on this machine"
    return None


@dataclass
class Workspace:
    path: Path
    size_mb: int | None = None
    image: Path | None = None
    #: Kept when the session closes (a named session); only unmounted.
    persistent: bool = False
    lock_fd: int | None = None
    #: A persistent workspace that existed before: its files were written by earlier sandboxes.
    reopened: bool = False

    #: A size-capped tmpfs is mounted on `path` (a throwaway workspace).
    tmpfs: bool = False

    @property
    def enforced_by(self) -> str | None:
        if self.tmpfs:
            return "tmpfs"
        return "loop-mounted ext4 image" if self.image is not None else None

    @classmethod
    def create(
        cls, path: Path, size_mb: int | None, use_quota: bool, persistent: bool = False, throwaway: bool = False
    ) -> Workspace:
        """A fresh workspace, or for a persistent one the existing folder (or image) with its files.

        `throwaway`: a capped workspace is a tmpfs rather than an image (RAM-backed: the caller
        sizes it; its pages are charged to the memory cgroup of the sandbox that writes them).
        """
        if throwaway and not persistent and size_mb is not None and use_quota and quota_problem() is None:
            path.mkdir(mode=0o755)
            try:
                _mount_tmpfs(path, size_mb)
            except OSError:
                path.rmdir()
                raise
            return cls(path, size_mb, tmpfs=True)
        lock_fd = _lock_named(path) if persistent else None
        try:
            image = path.with_name(path.name + ".img")
            if persistent and path.is_dir():
                if image.exists() and not os.path.ismount(path):
                    _mount_image(image, path)
                return cls(path, size_mb, image if image.exists() else None, persistent, lock_fd, reopened=True)
            path.mkdir(mode=0o755)
            if size_mb is None or not use_quota or quota_problem() is not None:
                return cls(path, size_mb, None, persistent, lock_fd)
            try:
                copy_blank(path.parent, size_mb, image)  # what mkfs.ext4 would make, made once (blank_images.py)
                _mount_image(image, path)
            except (OSError, WorkspaceError):
                with contextlib.suppress(OSError):
                    image.unlink()
                raise
            with contextlib.suppress(OSError):
                (path / "lost+found").rmdir()
            os.chmod(path, 0o755)
            return cls(path, size_mb, image, persistent, lock_fd)
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise

    def remove(self) -> None:
        """Delete a temporary workspace; a persistent one is only unmounted, its files kept."""
        if self.tmpfs and staging.detach(self.path):
            # The files went with the mount (nothing holds it once the sandbox is gone).
            with contextlib.suppress(FileNotFoundError):
                self.path.rmdir()
            if not os.path.lexists(self.path):
                return
        if self.persistent:
            if os.path.ismount(self.path):
                with contextlib.suppress(WorkspaceError):
                    _unmount(self.path, lazily=False)
            if self.image is not None and not _loop_released(self.image, LOOP_RELEASE_S):
                # Another mount namespace (a sandbox of the session still being torn down) holds the file
                # system: it writes the image when it lets go. Keep the lock, so that no one mounts the
                # image twice meanwhile; the next server's lock is free once this process ends.
                log.warning("workspace image %s is still in use after its unmount; its lock is kept", self.image)
                return
            self.sync()
        else:
            remove_workspace(self.path)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def sync(self) -> bool:
        """A persistent workspace's files on disk: its image (written back by the unmount, still in the host's
        page cache) and the folder holding it by fsync; a plain folder by syncfs of its file system (its
        tree is the sandbox's: nothing in it is opened). False, logged, when that failed."""
        try:
            if self.image is not None:
                with hostfs.dir_fd(self.image.parent) as parent:
                    fd = os.open(self.image.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                 dir_fd=parent)  # fmt: skip
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.fsync(parent)
            else:
                with hostfs.dir_fd(self.path) as fd:
                    hostfs.syncfs(fd)
        except OSError as exc:
            log.warning("workspace %s may not be on disk yet: %s", self.path, exc)
            return False
        return True


def _loop_released(image: Path, timeout_s: float) -> bool:
    """Wait (bounded) until no loop device is backed by `image`: its file system was let go everywhere
    (umount only removes the host's mount of it; a sandbox's mount namespace may hold it a moment longer),
    so the image is final. Host-only: reads /sys/block, never the image's folder."""
    target = str(image)
    deadline = time.monotonic() + timeout_s
    while True:
        backed = False
        for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
            with contextlib.suppress(OSError):
                backed = backed or backing.read_text().strip().removesuffix(" (deleted)") == target
        if not backed:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _mount_tmpfs(path: Path, size_mb: int) -> None:
    """Mount a tmpfs of `size_mb` MiB (and as many inodes as an image of that size) on `path`."""
    options = f"size={size_mb}m,nr_inodes={max(size_mb * TMPFS_INODES_PER_MB, 1024)},mode=0755"
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), options.encode()):
        code = ctypes.get_errno() or errno.EIO
        raise OSError(code, f"could not mount a tmpfs workspace on {path}: {os.strerror(code)}")


#: Persistent workspaces live in NAMED_DIR/<client>/<name> (with <name>.img and <name>.lock beside).
NAMED_DIR = "named"
#: What a workspace name (and a client folder, see owners.py) may be: one plain path component.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class NamedWorkspace:
    name: str
    in_use: bool
    size_mb: int | None
    used_mb: float | None
    modified: float


def named_workspace_dir(base: Path, client: str, name: str, dir_mode: int) -> Path:
    """Where `client`'s persistent workspace `name` lives: a name belongs to the client that made it."""
    if not NAME.fullmatch(name) or not NAME.fullmatch(client):
        raise WorkspaceError(f"{name!r} is not a workspace name")
    folder = _client_dir(base, client, dir_mode)
    return folder / name


def _client_dir(base: Path, client: str, dir_mode: int) -> Path:
    ensure_private_dir(base / NAMED_DIR, dir_mode)
    ensure_private_dir(base / NAMED_DIR / client, dir_mode)
    return base / NAMED_DIR / client


def list_named(base: Path, client: str) -> list[NamedWorkspace]:
    """`client`'s persistent workspaces (only the host writes these folders' entries)."""
    folder = base / NAMED_DIR / client
    found = []
    try:
        names = sorted(entry for entry in os.listdir(folder) if not entry.endswith((".img", ".lock")))
    except FileNotFoundError:
        return []
    for name in names:
        path = folder / name
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode):
            continue
        image = path.with_name(name + ".img")
        size_mb = used_mb = None
        with contextlib.suppress(FileNotFoundError):
            image_info = os.lstat(image)
            size_mb = image_info.st_size // 2**20
            used_mb = round(image_info.st_blocks * 512 / 2**20, 1)
        found.append(NamedWorkspace(name, _in_use(path), size_mb, used_mb, info.st_mtime))
    return found


def _in_use(path: Path) -> bool:
    try:
        os.close(_lock_named(path))
    except WorkspaceError:
        return True
    return False


def delete_named(base: Path, client: str, name: str) -> None:
    """Delete `client`'s persistent workspace `name` for good; refuses one in use."""
    if not NAME.fullmatch(name) or not NAME.fullmatch(client):
        raise WorkspaceError(f"{name!r} is not a workspace name: manage_workspaces (action 'list') shows yours")
    path = base / NAMED_DIR / client / name
    if not os.path.lexists(path):
        raise WorkspaceError(
            f"there is no persistent workspace {name!r}: manage_workspaces (action 'list') shows yours"
        )
    fd = _lock_named(path)
    try:
        remove_workspace(path)
        if os.path.lexists(path):
            raise WorkspaceError(f"the workspace {name!r} could not be removed completely; try again")
        with contextlib.suppress(FileNotFoundError):
            path.with_name(name + ".lock").unlink()
    finally:
        os.close(fd)


def _lock_named(path: Path) -> int:
    """One server at a time per named workspace: two loop mounts of one image would corrupt it."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise WorkspaceError(f"the named workspace {path.name} is in use by another session or server") from None
    return fd


def remove_workspace(path: Path) -> None:
    """Unmount (if mounted), delete the dir and its image; also used for a dead server's leftovers."""
    if os.path.ismount(path):
        with contextlib.suppress(WorkspaceError):
            _unmount(path)
    if os.path.ismount(path):
        log.warning("could not unmount workspace %s; leaving it", path)
        return
    # The workspace is the sandbox's: removed by fds, links never followed, no recursion.
    with contextlib.suppress(FileNotFoundError), hostfs.dir_fd(path.parent) as parent:
        left = hostfs.remove_tree(parent, path.name)
        if left:
            log.warning("could not remove all of workspace %s: %s", path, "; ".join(left[:5]))
    with contextlib.suppress(FileNotFoundError):
        path.with_name(path.name + ".img").unlink()
