"""The host side of one sandbox: its folders, who may write each, and how they go away.

    RUNTIME/<key>/        host-only (the server's; passable, not listable, for sandbox users)
        lock              flock held while a live server owns these dirs
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
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import hostfs
from .sandbox import HostIdentity, etc_files
from .sandbox_mounts import release_mounts
from .workspace import Workspace, remove_workspace

log = logging.getLogger(__name__)

LOCK_NAME = "lock"
HOST_DIR = "host"
RUN_DIR = "run"
SOCK_DIR = "sock"
#: Names of session dirs under RUNTIME: 8 hex digits.
KEY_CHARS = 8


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
) -> SandboxDirs:
    """Create a sandbox's dirs (see the module docstring); raises SessionDirsError."""
    key = secrets.token_hex(KEY_CHARS // 2)
    owner = (user.uid, user.gid) if user is not None else None
    fds: list[int] = []
    try:
        with hostfs.dir_fd(runtime_base) as base_fd:
            top_fd = hostfs.make_private_dir(base_fd, key, dir_mode)
        fds.append(top_fd)
        lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=top_fd)  # fmt: skip
        fds.append(lock_fd)
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # host/ is passable for the sandbox user (its files are its own, read-only to it).
        host_fd = hostfs.make_private_dir(top_fd, HOST_DIR, 0o711 if owner else 0o700)
        fds.append(host_fd)
        etc_fd = hostfs.make_private_dir(host_fd, "etc", 0o755)
        try:
            for name, text in etc_files(network).items():
                hostfs.write_new_file(etc_fd, name, text.encode(), mode=0o644)
        finally:
            os.close(etc_fd)
        run_fd = hostfs.make_private_dir(top_fd, RUN_DIR, 0o700, owner)
        fds.append(run_fd)
        sock_fd = hostfs.make_private_dir(top_fd, SOCK_DIR, 0o700)
        fds.append(sock_fd)
        os.close(top_fd)
        fds.remove(top_fd)
    except OSError as exc:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            remove_session_top(runtime_base / key)
        raise SessionDirsError(exc.errno or errno.EIO, f"could not create the session's runtime dirs: {exc}") from None
    top = runtime_base / key
    try:
        workspace = make_workspace(key, owner)
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        remove_session_top(top)
        raise
    return SandboxDirs(key, top, user, workspace, lock_fd, host_fd, run_fd, sock_fd)


def remove_session_top(top: Path) -> list[str]:
    """Remove RUNTIME/<key> and all below it, without following links or leaving its mount."""
    with hostfs.dir_fd(top.parent) as parent:
        left = hostfs.remove_tree(parent, top.name)
    if left:
        log.warning("could not remove all of %s: %s", top, "; ".join(left[:5]))
    return left


def remove_stale_dirs(runtime_base: Path, workspaces_base: Path, remove_stale: Callable[[str], None]) -> int:
    """Remove session dirs whose lock no live server holds (their server was SIGKILLed)."""
    removed = 0
    with hostfs.dir_fd(runtime_base) as base_fd:
        for name in hostfs.entries(base_fd):
            if len(name) != KEY_CHARS or not all(c in "0123456789abcdef" for c in name):
                continue
            try:
                info = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                    continue
                top_fd = hostfs.open_dir(name, dir_fd=base_fd)
            except OSError:
                continue
            try:
                lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top_fd)
            except OSError:
                lock_fd = -1  # half-made: no lock was ever taken
            finally:
                os.close(top_fd)
            try:
                if lock_fd >= 0:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live server owns it
            finally:
                if lock_fd >= 0:
                    os.close(lock_fd)
            remove_stale(name)
            if not release_mounts(runtime_base / name):
                continue  # never delete beneath a staged mount of a user's folder
            remove_workspace(workspaces_base / name)  # named (persistent) workspaces live elsewhere
            hostfs.remove_tree(base_fd, name)
            removed += 1
    return removed


def connection_names(info: dict[str, object], channels: tuple[str, ...]) -> list[str]:
    """The socket file names an ipc kernel binds for `channels` (ipykernel: IP-PORT)."""
    prefix = os.path.basename(str(info["ip"]))
    return [f"{prefix}-{info[channel]}" for channel in channels]


def dump_connection(info: dict[str, object]) -> bytes:
    return json.dumps(info, indent=1).encode()
