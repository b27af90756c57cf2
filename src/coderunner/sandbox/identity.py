"""Who a sandbox is on the host.

Unprivileged, a sandbox maps to the server's own user. When the server runs as root it must
not map to root: sysctls, per-user kernel limits (inotify, keyrings) and every root-owned file
it could reach would then treat sandboxed code as host root. So a root server starts each
sandbox as a host uid of its own, drawn from a reserved range no account uses (`UidPool`): the
per-user kernel limits (inotify instances, message queues, pipe buffers, RLIMIT_NPROC) are then
per sandbox, and one sandbox owns nothing another could open. `sandbox_user` in the settings
instead names one fixed unprivileged user for all of them (then those limits are shared).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import os
import pwd
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.vocabulary.host_identity import HostIdentity, IdentityError

#: Reserved host uids (and gids) for per-sandbox users: above systemd-nspawn's container range
#: (up to 0x6FFEFFFF) and below 2^31. The first half is drawn at random per sandbox; the second
#: is derived from a persistent workspace's key, so its files keep one owner across sessions.
UID_BASE = 1_900_000_000
UID_SPAN = 1 << 24
#: Where every server process of this host claims the uids it draws (root only: per-sandbox uids
#: exist only for a root server). One folder per host, whatever runtime_dir each server uses.
UID_CLAIMS_DIR = Path("/run/coderunner/uids")
#: Random draws of a free uid before giving up (the range is nearly empty: one or two draws in practice).
MAX_DRAWS = 1000


@dataclass
class UidPool:
    """Hands out a host uid per sandbox (root server only); no two live sandboxes share one, except
    a gVisor memory snapshot's copies (see `adopt`)."""

    base: int = UID_BASE
    span: int = UID_SPAN
    #: A host-only folder of lock files, one per drawn uid held by any server process on this host
    #: (a cluster node runs one process per session; two servers may share a machine): a uid is
    #: drawn only if its lock is free, and its lock is held while the sandbox lives. None: this
    #: process's own count only.
    claims_dir: Path | None = None
    #: uid -> how many live sandboxes hold it (more than one only through `adopt`).
    _used: collections.Counter[int] = field(default_factory=collections.Counter)
    #: uid -> the fd of its claim (held flock).
    _claims: dict[int, int] = field(default_factory=dict)

    @property
    def template(self) -> HostIdentity:
        """A uid of the range that owns nothing: what any sandbox user can reach, this one can."""
        return HostIdentity("a per-sandbox uid", self.base, self.base)

    def allocate(self, stable_key: str | None = None) -> HostIdentity:
        if stable_key is not None:
            digest = int.from_bytes(hashlib.sha256(stable_key.encode()).digest()[:8], "big")
            uid = self.base + self.span + digest % self.span
        else:
            for _ in range(MAX_DRAWS):
                uid = self.base + 1 + secrets.randbelow(self.span - 1)
                if uid not in self._used and self._claim(uid):
                    break
            else:
                raise IdentityError(f"no free sandbox uid after {MAX_DRAWS} draws: too many sandboxes on this host")
        self._used[uid] += 1
        return HostIdentity(f"uid {uid}", uid, uid)

    def _claim(self, uid: int) -> bool:
        """Take uid's host-wide lock (without blocking); False if another process holds it."""
        if self.claims_dir is None:
            return True
        ensure_private_dir(self.claims_dir)
        dir_fd = os.open(self.claims_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        if os.fstat(fd).st_nlink == 0:  # its holder let go and removed it between our open and lock
            os.close(fd)
            return False
        self._claims[uid] = fd
        return True

    def _unclaim(self, uid: int) -> None:
        fd = self._claims.pop(uid, None)
        if fd is None:
            return
        if self.claims_dir is not None:
            with contextlib.suppress(OSError):  # removed while locked: a later opener sees nlink 0
                dir_fd = os.open(self.claims_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.unlink(str(uid), dir_fd=dir_fd)
                finally:
                    os.close(dir_fd)
        os.close(fd)

    def adopt(self, uid: int, gid: int) -> HostIdentity:
        """The uid a checkpointed sandbox ran as, for its restored copy: the processes in a gVisor
        checkpoint keep their credentials, so the copy's files must be theirs. Shared with the
        original while both live, which gVisor makes harmless: no host process runs as that uid
        (the Sentry and its file proxy do), and each sandbox's file proxy serves only its own mounts."""
        if not self.base < uid < self.base + 2 * self.span or uid != gid:
            raise ValueError(f"uid {uid} is not one of this pool's")
        self._used[uid] += 1
        return HostIdentity(f"uid {uid}", uid, gid)

    def claim_of(self, uid: int) -> int | None:
        """The fd of this process's claim on `uid` (None: it holds none): a successor is handed it (handover.py)."""
        return self._claims.get(uid)

    def hold_claim(self, uid: int, claim_fd: int | None) -> HostIdentity:
        """The uid of a sandbox handed over by a dead predecessor, with its claim's fd (that process's flock, held
        since without a break), as if drawn here; released as any other."""
        if not self.base < uid < self.base + 2 * self.span:
            raise ValueError(f"uid {uid} is not one of this pool's")
        if claim_fd is not None:
            if uid in self._claims:
                os.close(claim_fd)  # this process holds its own claim already
            else:
                self._claims[uid] = claim_fd
        self._used[uid] += 1
        return HostIdentity(f"uid {uid}", uid, uid)

    def release(self, identity: HostIdentity | None) -> None:
        if identity is not None and self._used[identity.uid] > 0:
            self._used[identity.uid] -= 1
            if not self._used[identity.uid]:
                del self._used[identity.uid]
                self._unclaim(identity.uid)


def per_sandbox_uids(name: str | None) -> bool:
    """A root server gives every sandbox its own uid unless `sandbox_user` names a fixed one."""
    return os.getuid() == 0 and not name


def sandbox_identity(name: str | None) -> HostIdentity | None:
    """None when the server is not root; a per-sandbox uid's template by default; else the named user."""
    if os.getuid() != 0:
        return None
    if per_sandbox_uids(name):
        return UidPool().template
    assert name
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise IdentityError(f"sandbox user {name!r} does not exist: sudo useradd --system {name}") from None
    if entry.pw_uid == 0:
        raise IdentityError(f"sandbox_user {name!r} is root; pick an unprivileged user")
    return HostIdentity(name, entry.pw_uid, entry.pw_gid)


def shared_dir_mode(identity: HostIdentity | None) -> int:
    """Parents of session dirs: private, but passable (not listable) for the sandbox user."""
    return 0o711 if identity is not None else 0o700
