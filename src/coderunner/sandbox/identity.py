"""Who a sandbox is on the host.

Unprivileged, a sandbox maps to the server's own user. When the server runs as root it must
not map to root: sysctls, per-user kernel limits (inotify, keyrings) and every root-owned file
it could reach would then treat sandboxed code as host root. So a root server starts its
sandboxes as a dedicated unprivileged user (`coderunner-sandbox`, made by install.sh, else
`nobody`), and gives that user exactly the session dirs it needs.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

DEFAULT_USERS = ("coderunner-sandbox", "nobody")


class IdentityError(RuntimeError):
    pass


@dataclass(frozen=True)
class HostIdentity:
    """The host user sandboxes run as when the server is root."""

    name: str
    uid: int
    gid: int

    def give(self, path: Path) -> None:
        """Hand a host path (session dir, connection file, spill file) to the sandbox user."""
        os.chown(path, self.uid, self.gid, follow_symlinks=False)

    def setpriv_prefix(self) -> list[str]:
        """Drop to this user (and no supplementary groups) before exec'ing bwrap."""
        return ["/usr/bin/setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"]

    def check_reachable(self, path: Path) -> None:
        """Every ancestor must let others through (o+x): bwrap runs as this user and binds by path."""
        for directory in [path, *path.parents]:
            mode = os.stat(directory).st_mode
            if not mode & stat.S_IXOTH and os.stat(directory).st_uid != self.uid:
                raise IdentityError(
                    f"sandboxes run as user {self.name!r}, which cannot reach {path} ({directory} is "
                    f"mode {stat.S_IMODE(mode):o}): make it passable (chmod o+x) or use the defaults for "
                    "root (/var/lib/coderunner, then `coderunner setup`)"
                )


def sandbox_identity(name: str | None) -> HostIdentity | None:
    """None when the server is not root; otherwise the named user, or the first default that exists."""
    if os.getuid() != 0:
        return None
    for candidate in [name] if name else DEFAULT_USERS:
        try:
            entry = pwd.getpwnam(candidate)
        except KeyError:
            continue
        if entry.pw_uid == 0:
            raise IdentityError(f"sandbox_user {candidate!r} is root; pick an unprivileged user")
        return HostIdentity(candidate, entry.pw_uid, entry.pw_gid)
    raise IdentityError(f"sandbox user {name!r} does not exist: sudo useradd --system {name}")


def shared_dir_mode(identity: HostIdentity | None) -> int:
    """Parents of session dirs: private, but passable (not listable) for the sandbox user."""
    return 0o711 if identity is not None else 0o700


def ensure_private_dir(path: Path, mode: int = 0o700) -> None:
    """Create `path` or accept it only if it is a real directory we own (/tmp is shared)."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise IdentityError(f"{path} is not a directory owned by this user; remove it or set another path")
    if stat.S_IMODE(info.st_mode) != mode:
        os.chmod(path, mode)
