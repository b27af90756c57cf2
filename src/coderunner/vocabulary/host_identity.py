"""Who a sandbox is on the host when the server is root: a host user, its uid and gid.

The sandbox backends run as it (sandbox/identity.py draws one per sandbox), and the host side makes
folders and checks mounts for it (hostfs/), so it lives under both.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


class IdentityError(RuntimeError):
    pass


@dataclass(frozen=True)
class HostIdentity:
    """The host user sandboxes run as when the server is root."""

    name: str
    uid: int
    gid: int

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
