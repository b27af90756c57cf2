"""The mount namespace a root server's bwrap starts in: the host's, without the mounts of the sessions it holds.

Why: bwrap copies the mount table of the namespace it starts in, and reads all of it back (/proc/self/mountinfo)
for every bind it makes, about 26 a sandbox. A root server adds two host mounts for each session it holds (the
workspace's loop mount and the staged outbox), so each start cost more the more sessions were held: bwrap and the
init took 16-21 CPU-ms beside none and 55-80 beside 300 (bench/held_starts.py).

So a root server makes, once, a copy of its mount namespace (`StartNamespace.open`, in a helper process that exits
once the server holds an fd of it):

- every mount in it is private, so no mount the host makes later (a session's workspace) appears in it;
- the mounts under the runtime and workspace dirs, and every loop mount, that were there when it was made are
  detached, so it pins no other server's workspace either;
- one dir, the runtime dir's `.live-<id>` (this server process's, a host mount marked shared, locked while the
  process lives), stays a slave of the host's: what the host mounts there appears in it;
- the kernel's own filesystems (PSEUDO_FILESYSTEMS: /sys and the cgroups under it, /dev/pts, mqueue, ...) are
  detached too: no sandbox is given any of them, neither nsenter nor bwrap reads them, and each line fewer is one
  fewer for bwrap to read back at every bind (here 23 lines became 9, and bwrap's CPU a start 4.9 ms became 4.2).

A start clones the host mounts its sandbox is built from (its workspace, its staged points) under
`.live-<id>/<key>-<token>` (`stage`: from the host's own mount points, never a path the sandbox can write), runs
bwrap in the copy (`prelude`: nsenter, before bwrap drops root), and detaches them (`release`) once bwrap has built
the sandbox, whose own copies stay. bwrap then reads the same table however many sessions the server holds (at
300 held, 18 CPU-ms against 54). In a burst, the starts in flight read each other's clones: so only a few builds
are in flight at once (build_slots.py), and a start releases its clones as soon as its sandbox is built.

What it changes inside a sandbox: nothing it was given. A sandbox no longer sees its own staged points a second
time under its read-only host dir (they were copies of what it sees at their own paths).

Root only: without root no mount is made per session, and nsenter could not join.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import secrets
import select
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from coderunner.hostfs import staging
from coderunner.hostfs.sandbox_mounts import LOCK_SUFFIX, START_CLONES_PREFIX, release_start_clones
from coderunner.sandbox.base import SandboxSpec
from coderunner.vocabulary.host_identity import HostIdentity

log = logging.getLogger(__name__)

#: Bound on the helper making the namespace.
MAKE_TIMEOUT_S = 10.0
#: Bound on closing waiting for the releases of starts that just ended, and how often it looks.
CLOSE_WAIT_S = 2.0
CLOSE_POLL_S = 0.01
#: mount(2) flags.
MS_BIND, MS_SHARED = 0x1000, 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)

#: Filesystem types the start namespace drops (the module docstring): the kernel's own, none of them a folder a
#: user could hand a sandbox. Not autofs (a home dir may be automounted), nor selinuxfs on its own, nor tmpfs.
PSEUDO_FILESYSTEMS = (
    "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "binfmt_misc", "debugfs", "tracefs", "securityfs", "pstore",
    "bpf", "configfs", "fusectl", "hugetlbfs", "efivarfs",
)  # fmt: skip
#: Bound on the mounts stacked at one point that the helper detaches.
MAX_STACKED = 8

#: The helper: run as `python -I -S -c HELPER LIVE PSEUDO MAX_STACKED ROOT...` by the server, as root. It moves into
#: a new mount namespace, makes its LIVE a slave of the host's and every other mount private, detaches what is under
#: a ROOT and every loop mount, then each mount of a type in PSEUDO (comma-separated) for as long as one is on top at
#: its point, says "ok", and waits for its stdin's end (the server holds an fd of the namespace by then). Stdlib
#: only; it reads nothing but its own mountinfo.
HELPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, MS_PRIVATE, MS_SLAVE, MNT_DETACH, UMOUNT_NOFOLLOW = 0x20000, 1 << 18, 1 << 19, 2, 8
live, pseudo, max_stacked, roots = sys.argv[1], set(sys.argv[2].split(",")), int(sys.argv[3]), sys.argv[4:]

def fail(what):
    sys.stdout.write("failed %s: %s\n" % (what, os.strerror(ctypes.get_errno())))
    sys.exit(1)

def unescape(text):
    return text.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")

def mounts():  # (point, source, type) of each mount, in the table's order (a stack's top last)
    with open("/proc/self/mountinfo") as handle:
        rows = [line.split() for line in handle]
    return [(unescape(fields[4]), fields[fields.index("-") + 2], fields[fields.index("-") + 1]) for fields in rows]

def under(point, top):
    return point == top or point.startswith(top.rstrip("/") + "/")

if libc.unshare(CLONE_NEWNS) != 0:
    fail("unshare")
if libc.mount(None, live.encode(), None, MS_SLAVE, None) != 0:
    fail("mount --make-slave " + live)
listed = mounts()
for point, _source, _type in listed:
    if point != live:
        libc.mount(None, point.encode(), None, MS_PRIVATE, None)
gone = [point for point, source, _type in listed if not under(point, live)
        and (any(under(point, root) for root in roots) or source.startswith("/dev/loop"))]
for point in sorted(set(gone), key=len, reverse=True):
    libc.umount2(point.encode(), MNT_DETACH | UMOUNT_NOFOLLOW)
# Outermost first: /sys takes the cgroups under it along.
for point in sorted({point for point, _source, kind in mounts() if kind in pseudo}, key=len):
    for _ in range(max_stacked):
        stack = [kind for at, _source, kind in mounts() if at == point]
        if not stack or stack[-1] not in pseudo or libc.umount2(point.encode(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
            break
sys.stdout.write("ok\n")
sys.stdout.flush()
while os.read(0, 4096):
    pass
"""


class StartNamespaceUnavailable(OSError):
    """The start namespace could not be made; sandboxes start in the host's, as before."""


@dataclass
class Staged:
    """One start's clones under `.live-<id>/<key>-<token>`: where each source it was given now is."""

    top: Path | None
    moved: dict[Path, Path]
    #: Counted among its namespace's starts until released.
    counted: bool = True

    def spec(self, spec: SandboxSpec) -> SandboxSpec:
        """`spec` with its workspace and mounts read from their clones."""
        mounts = tuple(replace(mount, host=self.moved.get(mount.host, mount.host)) for mount in spec.mounts)
        return replace(spec, workspace=self.moved.get(spec.workspace, spec.workspace), mounts=mounts)


class StartNamespace:
    """A root server's start namespace (module docstring): an fd of it, and its `.live-<id>` dir and lock."""

    def __init__(self, fd: int, live: Path, lock: int, nsenter: str) -> None:
        self.fd = fd
        self.live = live
        #: Held while this process lives: a later server's start-up sweep (hostfs/sandbox_mounts.py) removes
        #: `live` only once it is free.
        self.lock = lock
        self.nsenter = nsenter
        #: Starts between stage and release; close waits for none.
        self._starts = 0
        self._closed = False
        self._in_use = threading.Lock()

    @classmethod
    def open(cls, runtime_base: Path, roots: list[Path]) -> StartNamespace:
        """Make it (see the module docstring); raises StartNamespaceUnavailable saying why not."""
        nsenter = shutil.which("nsenter")
        if os.getuid() != 0 or nsenter is None:
            raise StartNamespaceUnavailable("needs root and nsenter (util-linux)")
        runtime_base = runtime_base.resolve()
        live = runtime_base / f"{START_CLONES_PREFIX}{secrets.token_hex(6)}"
        try:
            lock = _shared_mount_point(live)
        except OSError as exc:
            raise StartNamespaceUnavailable(f"could not make {live} a shared mount: {exc}") from None
        try:
            return cls._enter(live, lock, runtime_base, roots, nsenter)
        except BaseException:
            release_start_clones(live, _lock_path(live))
            os.close(lock)
            raise

    @classmethod
    def _enter(cls, live: Path, lock: int, runtime_base: Path, roots: list[Path], nsenter: str) -> StartNamespace:
        tops = [runtime_base, *(root.resolve() for root in roots)]
        pseudo = ",".join(PSEUDO_FILESYSTEMS)
        argv = [sys.executable, "-I", "-S", "-c", HELPER, str(live), pseudo, str(MAX_STACKED), *map(str, tops)]
        helper = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/", close_fds=True,
        )  # fmt: skip
        assert helper.stdin is not None and helper.stdout is not None
        try:
            said = _read_line(helper, MAKE_TIMEOUT_S)
            if said != "ok":
                raise StartNamespaceUnavailable(f"the namespace helper said {said!r}")
            fd = os.open(f"/proc/{helper.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            helper.stdin.close()
            try:
                helper.wait(MAKE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
            helper.stdout.close()
        return cls(fd, live, lock, nsenter)

    def prelude(self, user: HostIdentity | None) -> list[str]:
        """What runs bwrap in this namespace: nsenter, by this process's own fd of it (no fd of it is
        inherited, so none reaches the sandbox). It must run while the start still has root; with a `user`, it
        then becomes that user itself (no supplementary groups, then the gid, then the uid: what
        HostIdentity.setpriv_prefix does, without a second exec)."""
        drop = ["-G", str(user.gid), "-S", str(user.uid)] if user is not None else []
        return [self.nsenter, f"--mount=/proc/{os.getpid()}/fd/{self.fd}", *drop, "--"]

    def stage(self, key: str, sources: list[Path]) -> Staged:
        """A clone of each of `sources` (host-only paths: mount points, or dirs, of the host's) under a fresh
        `<key>-<token>` of `live` (`key`: the sandbox dirs', to say whose it is), which this namespace receives.
        Blocking (a worker thread's)."""
        with self._in_use:
            if self._closed:
                raise StartNamespaceUnavailable("the start namespace was closed")
            self._starts += 1
        top = self.live / f"{key}-{secrets.token_hex(6)}"
        staged = Staged(top, {})
        try:
            os.mkdir(top, 0o700)
            os.chmod(top, 0o711)  # passable, whatever the umask: bwrap reads the clones as the sandbox's user
        except BaseException:
            self._done(staged)
            raise
        try:
            for index, source in enumerate(dict.fromkeys(sources)):
                point = top / str(index)
                os.mkdir(point, 0o700)
                fd = staging.open_folder(source)
                try:
                    staging.stage(fd, point, read_only=False)  # its own flags kept: rdonly, an id mapping
                finally:
                    os.close(fd)
                staged.moved[source] = point
        except BaseException:
            self.release(staged)
            raise
        return staged

    def _done(self, staged: Staged) -> None:
        with self._in_use:
            if staged.counted:
                staged.counted = False
                self._starts -= 1

    def release(self, staged: Staged) -> None:
        """Detach one start's clones (bwrap has built its sandbox, or will not). Blocking; idempotent."""
        top, staged.top = staged.top, None
        if top is not None and not staging.release_all(top):
            log.warning("could not detach every mount under %s", top)
        self._done(staged)

    def close(self) -> bool:
        """Detach `live` and let go of the namespace once no start uses it (True; the releases of starts just
        ended are waited for, CLOSE_WAIT_S at most), else leave both as they are (False: this process's end
        frees its lock, and the next server's sweep removes them). Blocking."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while True:
            with self._in_use:
                if not self._starts:
                    self._closed = True
                    break
            if time.monotonic() > deadline:
                return False
            time.sleep(CLOSE_POLL_S)
        release_start_clones(self.live, _lock_path(self.live))
        os.close(self.fd)
        os.close(self.lock)
        return True


def _lock_path(live: Path) -> Path:
    return live.with_name(live.name + LOCK_SUFFIX)


def _shared_mount_point(live: Path) -> int:
    """`live`, this process's, made (passable, not listable) and bound on itself, marked shared; the fd of its
    lock, held. The lock comes first: a dir without one is a dead server's to every sweep."""
    lock = os.open(_lock_path(live), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.mkdir(live, 0o700)
        os.chmod(live, 0o711)  # passable, whatever the umask
        _mount(live, live, MS_BIND)
        _mount(None, live, MS_SHARED)
    except BaseException:
        release_start_clones(live, _lock_path(live))
        os.close(lock)
        raise
    return lock


def _mount(source: Path | None, target: Path, flags: int) -> None:
    if _libc.mount(os.fsencode(source) if source else None, os.fsencode(target), None, flags, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _read_line(helper: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The helper's first line, or what it said before it ended; bounded."""
    assert helper.stdout is not None
    fd = helper.stdout.fileno()
    data = b""
    while b"\n" not in data:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return "nothing in time"
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        if len(data) > 4096:
            break
    return data.decode("utf-8", "replace").strip()
