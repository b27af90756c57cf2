"""The gvisor backend's dirs on the host and the host cgroups runsc makes: one instance dir per
server process (locked for its life, so another server's sweep tells live from dead), and the
cgroups of its containers (left behind by runsc at times, removed by the host).

    RUNTIME/.runsc/<instance>/lock         flock held for the life of the server process
    RUNTIME/.runsc/<instance>/root/        runsc --root of that server process
    RUNTIME/.runsc/<instance>/<container>/ the bundle: config.json, upper/, work/, rootfs/
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from coderunner.hostfs import dirfd as hostfs
from coderunner.sandbox.cgroups import SessionCgroup
from coderunner.sandbox.container import NAME_PREFIX

LOCK_NAME = hostfs.LOCK_NAME
#: A server process's dir while it is made: it gets its name only once its lock is held.
NEW_INSTANCE = hostfs.NEW_PREFIX
#: A dir being made with no lock yet is taken for dead only after this long.
ABANDONED_AFTER_S = hostfs.ABANDONED_AFTER_S
ROOT_NAME = "root"
CGROUP_CONTROLLERS_V1 = ("memory", "pids", "cpu", "cpuacct", "cpuset", "blkio", "devices", "freezer", "systemd")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class Instance:
    """This server process's own dirs under the backend dir, locked for its life."""

    name: str
    top: Path
    lock_fd: int

    @property
    def root(self) -> Path:
        return self.top / ROOT_NAME


def new_instance(backend_dir: Path) -> Instance:
    """This process's dir, which appears under its name already locked (hostfs.make_locked_dir):
    another server's sweep never sees it unlocked."""
    name = secrets.token_hex(6)
    with hostfs.dir_fd(backend_dir) as parent:
        top_fd, fd = hostfs.make_locked_dir(parent, name, 0o700)
        os.close(top_fd)
        hostfs.publish_dir(parent, name)
    return Instance(name, backend_dir / name, fd)


def other_instances(backend_dir: Path, own: str) -> list[tuple[Path, bool]]:
    """Other server processes' instance dirs, and whether that server still lives (holds the lock)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(backend_dir):
            if entry.name == own or not entry.is_dir(follow_symlinks=False):
                continue
            lock = Path(entry.path) / LOCK_NAME
            if entry.name.startswith(NEW_INSTANCE) and not lock.exists():
                # Being made, before its lock: alive unless its maker died long ago.
                age = time.time() - entry.stat(follow_symlinks=False).st_mtime
                found.append((Path(entry.path), age < ABANDONED_AFTER_S))
                continue
            found.append((Path(entry.path), _held(lock)))
    return found


def _held(lock: Path) -> bool:
    """Is the flock on `lock` held by a live process? (A missing lock: a half-made dir, not held.)"""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def session_of(container: str, tag: str) -> str | None:
    """The session key in a container id made by container_name(tag, session)."""
    prefix = f"{NAME_PREFIX}-{tag}-"
    if not container.startswith(prefix):
        return None
    session, _, _ = container[len(prefix) :].rpartition("-")
    return session or None


def container_cgroup(container: str) -> SessionCgroup:
    """The host cgroup runsc makes for a container (cgroupsPath /<container>)."""
    unified = CGROUP_ROOT / "cgroup.controllers"
    if unified.exists():
        return SessionCgroup(2, {"unified": CGROUP_ROOT / container, "memory": CGROUP_ROOT / container})
    dirs = {name: CGROUP_ROOT / name / container for name in CGROUP_CONTROLLERS_V1}
    return SessionCgroup(1, {name: path for name, path in dirs.items() if path.parent.is_dir()})


def remove_cgroup_soon(cgroup: SessionCgroup) -> None:
    """Remove a deleted container's cgroup (runsc usually has): at once if it is empty, else from a
    background thread once its last tasks (ptrace stubs die slowly) are gone, so that no caller, a
    server's shutdown least of all, waits for them."""
    left = False
    for path in cgroup.dirs.values():
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            left = True
    if left:
        threading.Thread(target=cgroup.remove, name="gvisor-cgroup", daemon=True).start()


def stale_cgroups(prefix: str) -> list[SessionCgroup]:
    """The host cgroups of containers whose names start with `prefix` (one sandbox's, of any server)."""
    unified = CGROUP_ROOT / "cgroup.controllers"
    where = CGROUP_ROOT if unified.exists() else CGROUP_ROOT / "pids"
    try:
        names = [entry.name for entry in os.scandir(where) if entry.name.startswith(prefix) and entry.is_dir()]
    except OSError:
        return []
    return [container_cgroup(name) for name in names]
