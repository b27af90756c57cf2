"""The host side of one sandbox: its folders, who may write each, and how they go away.

    RUNTIME/<key>/        host-only (the server's; passable, not listable, for sandbox users)
        lock              flock held while a live server owns these dirs
        made-ahead        there while no sandbox has these dirs yet: the server made them ahead of
                          a create (sessions/leases.py); the create that takes them removes it
        host/             host-only, bound READ-ONLY at the same path: etc files, connection
                          files, one-shot inputs. The host writes here, never where the sandbox can.
        run/              the sandbox's own (its uid), bound read-write at the same path: the
                          kernel binds its ipc sockets here, and nothing of the host's lives here
        sock/             host-only: each kernel socket is moved here (rename, then type and owner
                          checked) before the host connects, so no name the sandbox can swap is
                          ever connected to
    WORKSPACES/<key>      the workspace (see workspace.py)

The sandbox cannot write RUNTIME/<key> itself, so `host/` and `sock/` can never be swapped for
links; what it can write (run/, the workspace) the host only reaches through directory fds.

Several servers (one per MCP client) share RUNTIME, and each sweeps dead servers' dirs when it
starts, so a dir appears only whole and locked: it is built as RUNTIME/.new-<key> with its lock
held (the lock file is flocked under a name the sweep never opens, then renamed to `lock`), and
then renamed to <key> in one step. The sweep removes a dir only when it can prove it dead: it
takes its lock (held until the removal is done; the lock file goes last). A dir without a lock
file (a creator or remover caught between two steps) is left alone until it is ABANDONED_AFTER_S
old. The workspace is made after <key> is locked and removed before its lock goes, so it is never
without a locked owner either. A node agent's successor reopens the dirs it was handed with their lock
(`reopen_sandbox_dirs`, sessions/adoption.py): the lock never went free meanwhile.

One idea: a sandbox's host-side folders, from made whole and locked to removed, and the sweep of dead ones.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.sandbox_mounts import release_mounts, sweep_dead_start_clones
from coderunner.hostfs.workspaces import Workspace, remove_workspace
from coderunner.vocabulary.host_identity import HostIdentity
from coderunner.vocabulary.sandbox_layout import etc_files

log = logging.getLogger(__name__)

#: A session dir's lock, and its name while under construction (hostfs.make_locked_dir).
LOCK_NAME = hostfs.LOCK_NAME
NEW_PREFIX = hostfs.NEW_PREFIX
HOST_DIR = "host"
RUN_DIR = "run"
SOCK_DIR = "sock"
#: Names of session dirs under RUNTIME: 8 hex digits.
KEY_CHARS = 8
KEY = re.compile(f"[0-9a-f]{{{KEY_CHARS}}}")
NEW_KEY = re.compile(re.escape(NEW_PREFIX) + KEY.pattern)
#: A dir without a lock file this long after its last change is abandoned (making or removing one
#: takes milliseconds between the steps that leave it without a lock).
ABANDONED_AFTER_S = hostfs.ABANDONED_AFTER_S
#: In RUNTIME/<key> while the dirs were made ahead and no sandbox has them yet.
MADE_AHEAD = "made-ahead"
#: Rounds of ending a dead sandbox's processes and removing its workspace, in one sweep.
DEAD_SANDBOX_TRIES = 3


class SessionDirsError(OSError):
    """The dirs could not be made; the message says why."""


@dataclass
class SandboxDirs:
    """One sandbox's folders on the host, with fds held on the ones the host works in."""

    key: str
    top: Path
    user: HostIdentity | None
    workspace: Workspace
    lock_fd: int
    host_fd: int
    run_fd: int
    sock_fd: int
    _closed: bool = field(default=False)

    @property
    def host_dir(self) -> Path:
        return self.top / HOST_DIR

    @property
    def run_dir(self) -> Path:
        return self.top / RUN_DIR

    @property
    def sock_dir(self) -> Path:
        return self.top / SOCK_DIR

    @property
    def owner(self) -> tuple[int, int] | None:
        """Host (uid, gid) of the sandbox when it is not the server's own user."""
        return (self.user.uid, self.user.gid) if self.user is not None else None

    @property
    def sandbox_uid(self) -> int:
        return self.user.uid if self.user is not None else os.getuid()

    def write_host_file(self, name: str, data: bytes, *, readable_by_sandbox: bool = True) -> Path:
        """A fresh file in host/ (replacing an older one of the host's): the sandbox may read, never write it."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.host_fd)
        owner = self.owner if readable_by_sandbox else None
        hostfs.write_new_file(self.host_fd, name, data, mode=0o400 if readable_by_sandbox else 0o600, owner=owner)
        return self.host_dir / name

    def remove_host_file(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.host_fd)

    def claim_sockets(self, names: list[str]) -> bool:
        """Move the kernel's sockets from run/ to sock/ once all exist; False while some are missing.

        Raises HostFsError when one is not a socket owned by the sandbox user (it was swapped).
        """
        pending = [name for name in names if not hostfs.present(self.sock_fd, name)]
        if not all(hostfs.present(self.run_fd, name) for name in pending):
            return False
        if any(hostfs.unowned_socket(self.run_fd, name, self.sandbox_uid) for name in pending):
            # Bound but not yet handed to the sandbox user (gVisor's file proxy binds as root, then
            # chowns): claiming now would take it mid-way and refuse it. Wait, bounded by the caller.
            return False
        for name in pending:
            hostfs.claim_socket(self.run_fd, name, self.sock_fd, self.sandbox_uid)
        return True

    def forget_sockets(self, prefix: str) -> None:
        """Remove the claimed sockets of one kernel (host-only dir: plain unlinks)."""
        for name in hostfs.entries(self.sock_fd):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self.sock_fd)

    def taken(self) -> None:
        """Dirs made ahead are a sandbox's from now on: their MADE_AHEAD mark goes (RUNTIME/<key> is host-only)."""
        with hostfs.dir_fd(self.top) as top, contextlib.suppress(FileNotFoundError):
            os.unlink(MADE_AHEAD, dir_fd=top)

    def close(self) -> list[str]:
        """Remove everything (the workspace too unless persistent); what could not be removed, and why."""
        if self._closed:
            return []
        self._closed = True
        self.workspace.remove()
        for fd in (self.host_fd, self.run_fd, self.sock_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        left = remove_session_top(self.top)
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)
        return left


def open_sandbox_dirs(
    runtime_base: Path,
    *,
    network: str,
    dir_mode: int,
    user: HostIdentity | None,
    make_workspace: Callable[[str, tuple[int, int] | None], Workspace],
    ahead: bool = False,
) -> SandboxDirs:
    """Create a sandbox's dirs (see the module docstring), marked MADE_AHEAD if `ahead` (before they have
    their name: nothing sees them unmarked); raises SessionDirsError."""
    owner = (user.uid, user.gid) if user is not None else None
    fds: list[int] = []
    try:
        with hostfs.dir_fd(runtime_base) as base_fd:
            _keep_passable(base_fd, runtime_base, dir_mode)
            key = secrets.token_hex(KEY_CHARS // 2)
            top_fd, lock_fd = hostfs.make_locked_dir(base_fd, key, dir_mode)
            fds += [lock_fd, top_fd]
            try:
                fds += _fill_session_dir(top_fd, network, owner)
                if ahead:
                    hostfs.write_new_file(top_fd, MADE_AHEAD, b"", mode=0o600)
                hostfs.publish_dir(base_fd, key)
            except BaseException:
                with contextlib.suppress(OSError):
                    hostfs.remove_tree(base_fd, NEW_PREFIX + key)
                raise
        os.close(top_fd)
        fds.remove(top_fd)
    except OSError as exc:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise SessionDirsError(exc.errno or errno.EIO, f"could not create the session's runtime dirs: {exc}") from None
    lock_fd, host_fd, run_fd, sock_fd = fds
    top = runtime_base / key
    try:
        workspace = make_workspace(key, owner)
    except BaseException:
        for fd in (host_fd, run_fd, sock_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        remove_session_top(top)
        os.close(lock_fd)
        raise
    return SandboxDirs(key, top, user, workspace, lock_fd, host_fd, run_fd, sock_fd)


def reopen_sandbox_dirs(
    runtime_base: Path, key: str, user: HostIdentity | None, workspace: Workspace, lock_fd: int
) -> SandboxDirs:
    """The dirs RUNTIME/`key` a dead predecessor made, whose lock `lock_fd` this process now holds (handed over):
    reopened without following links, and refused unless their lock is that very file. Raises SessionDirsError."""
    if KEY.fullmatch(key) is None:
        raise SessionDirsError(errno.EINVAL, f"{key!r} is not a session dir's name")
    fds: list[int] = []
    try:
        with hostfs.dir_fd(runtime_base) as base_fd:
            top_fd = hostfs.open_dir(key, base_fd)
            try:
                lock = os.stat(LOCK_NAME, dir_fd=top_fd, follow_symlinks=False)
                held = os.fstat(lock_fd)
                if (lock.st_dev, lock.st_ino) != (held.st_dev, held.st_ino):
                    raise SessionDirsError(errno.ESTALE, f"the session dir {key} is not the one whose lock came")
                fds += [hostfs.open_dir(name, top_fd) for name in (HOST_DIR, RUN_DIR, SOCK_DIR)]
            finally:
                os.close(top_fd)
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, SessionDirsError):
            raise
        raise SessionDirsError(exc.errno or errno.EIO, f"could not reopen the session dir {key}: {exc}") from None
    host_fd, run_fd, sock_fd = fds
    return SandboxDirs(key, runtime_base / key, user, workspace, lock_fd, host_fd, run_fd, sock_fd)


def _keep_passable(base_fd: int, runtime_base: Path, dir_mode: int) -> None:
    """The sandbox user passes through RUNTIME to its own dirs (bwrap binds them by path, as that user):
    when something took the search bits away since this server's start (another server, of another
    version or setting, asking for its own mode), they are given back now, by fd, before a sandbox
    needs them: a start otherwise fails at its first bind (\"Can't find source path ...: Permission denied\")."""
    needed = dir_mode & 0o011
    current = stat.S_IMODE(os.fstat(base_fd).st_mode)
    if needed and current & needed != needed:
        log.warning("%s had lost the search permission its sandboxes pass through (mode %o); given back",
                    runtime_base, current)  # fmt: skip
        os.fchmod(base_fd, current | needed)


def _fill_session_dir(top_fd: int, network: str, owner: tuple[int, int] | None) -> list[int]:
    """host/ (with etc/), run/ and sock/ in a session dir under construction: their fds."""
    fds: list[int] = []
    try:
        # host/ is passable for the sandbox user (its files are its own, read-only to it).
        fds.append(hostfs.make_private_dir(top_fd, HOST_DIR, 0o711 if owner else 0o700))
        etc_fd = hostfs.make_private_dir(fds[0], "etc", 0o755)
        try:
            for name, text in etc_files(network).items():
                hostfs.write_new_file(etc_fd, name, text.encode(), mode=0o644)
        finally:
            os.close(etc_fd)
        fds.append(hostfs.make_private_dir(top_fd, RUN_DIR, 0o700, owner))
        fds.append(hostfs.make_private_dir(top_fd, SOCK_DIR, 0o700))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def remove_session_top(top: Path) -> list[str]:
    """Remove RUNTIME/<key> and all below it, without following links or leaving its mount.

    Its lock file goes last, so the dir is never without a lock while anything else is in it."""
    with hostfs.dir_fd(top.parent) as parent:
        left = _remove_locked_dir(parent, top.name)
    if left:
        log.warning("could not remove all of %s: %s", top, "; ".join(left[:5]))
    return left


def _remove_locked_dir(base_fd: int, name: str) -> list[str]:
    """Empty `name` but for its lock, then unlink the lock and remove the dir; what was left, and why."""
    try:
        top_fd = hostfs.open_dir(name, dir_fd=base_fd)
    except FileNotFoundError:
        return []
    left: list[str] = []
    try:
        for entry in hostfs.entries(top_fd):
            if entry != LOCK_NAME:
                left += hostfs.remove_tree(top_fd, entry)
        if not left:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(LOCK_NAME, dir_fd=top_fd)
    finally:
        os.close(top_fd)
    if not left:
        try:
            os.rmdir(name, dir_fd=base_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            left.append(f"{name}: {exc.strerror}")
    return left


def remove_stale_dirs(
    runtime_base: Path,
    workspaces_base: Path,
    remove_stale: Callable[[str], None],
    abandoned_after_s: float = ABANDONED_AFTER_S,
) -> int:
    """Remove the session dirs that are provably dead (see the module docstring): those whose lock
    this call can take (their server is gone), and those without a lock `abandoned_after_s` old.
    How many went (sweep_stale_dirs says what stayed too)."""
    return sweep_stale_dirs(runtime_base, workspaces_base, remove_stale, abandoned_after_s).removed


@dataclass(frozen=True)
class StaleSweep:
    """What one sweep did: dead dirs removed, and dead dirs it took but could not remove yet."""

    removed: int
    left: int


def sweep_stale_dirs(
    runtime_base: Path,
    workspaces_base: Path,
    remove_stale: Callable[[str], None],
    abandoned_after_s: float = ABANDONED_AFTER_S,
) -> StaleSweep:
    """remove_stale_dirs, saying also how many dead dirs it left (a sandbox still dying held one)."""
    removed = claimed = 0
    sweep_dead_start_clones(runtime_base)  # first: a clone of a dead start pins its workspace
    with hostfs.dir_fd(runtime_base) as base_fd:
        for name in hostfs.entries(base_fd):
            fresh = NEW_KEY.fullmatch(name) is not None
            if not fresh and KEY.fullmatch(name) is None:
                continue
            lock_fd = claim_dead(base_fd, name, abandoned_after_s)
            if lock_fd is None:
                continue
            claimed += 1
            try:
                if fresh:  # never started a sandbox nor made a workspace (both come after the rename)
                    removed += not _remove_locked_dir(base_fd, name)
                    continue
                if _remove_dead_sandbox(runtime_base, workspaces_base, name, remove_stale):
                    removed += not _remove_locked_dir(base_fd, name)
            finally:
                if lock_fd >= 0:
                    os.close(lock_fd)
    return StaleSweep(removed, claimed - removed)


def _remove_dead_sandbox(
    runtime_base: Path, workspaces_base: Path, name: str, remove_stale: Callable[[str], None]
) -> bool:
    """A dead sandbox's processes, staged mounts and workspace; True once all are gone.

    Its processes may still be dying (a loaded machine, a slow ptrace teardown) and hold its
    workspace mounted: each try ends them again before unmounting. What is still left keeps its
    session dir (its lock free), so the next server's start tries again instead of losing track.
    """
    workspace = workspaces_base / name  # named (persistent) workspaces live elsewhere
    for _ in range(DEAD_SANDBOX_TRIES):
        remove_stale(name)
        if not release_mounts(runtime_base / name):
            return False  # never delete beneath a staged mount of a user's folder
        remove_workspace(workspace)
        if not any(os.path.lexists(path) for path in (workspace, workspace.with_name(name + ".img"))):
            return True
    log.warning("workspace %s of a dead server's session is still there; the next start tries again", workspace)
    return False


def claim_dead(base_fd: int, name: str, abandoned_after_s: float = ABANDONED_AFTER_S) -> int | None:
    """The session dir `name` is dead: its lock, now held by this process (-1 if it has none but is
    abandoned). None while it may be alive: its lock is held, or it has none and is recent."""
    try:
        info = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return None
        top_fd = hostfs.open_dir(name, dir_fd=base_fd)
    except OSError:
        return None
    try:
        lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top_fd)
    except OSError:
        lock_fd = -1
    finally:
        os.close(top_fd)
    if lock_fd < 0:
        age = time.time() - max(info.st_mtime, info.st_ctime)
        return -1 if age > abandoned_after_s else None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock_fd)
        return None  # a live server (or another server's sweep) holds it
    if os.fstat(lock_fd).st_nlink == 0:
        os.close(lock_fd)
        return None  # its owner removed it meanwhile and let go: nothing is left to claim
    return lock_fd


def connection_names(info: dict[str, object], channels: tuple[str, ...]) -> list[str]:
    """The socket file names an ipc kernel binds for `channels` (ipykernel: IP-PORT)."""
    prefix = os.path.basename(str(info["ip"]))
    return [f"{prefix}-{info[channel]}" for channel in channels]


def dump_connection(info: dict[str, object]) -> bytes:
    return json.dumps(info, indent=1).encode()
