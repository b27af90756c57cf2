"""A server's own folder by path (the runtime dir, the workspaces' parents): made, or taken only if it is ours.

The sandbox backends make their per-server folders with it, and hostfs the named workspaces' parents.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from coderunner.vocabulary.host_identity import IdentityError

#: Search (x) bits of a folder for its group and others: passable, not listable.
PASSABLE_BITS = 0o011


def ensure_private_dir(path: Path, mode: int = 0o700) -> None:
    """Create `path` or accept it only if it is a real directory we own (/tmp is shared), and give it
    `mode` by its fd whatever the umask. Servers share these folders (the runtime dir above all), so
    search bits already there are kept: another server's sandbox users may be passing through (a
    server asking for 0700 would lock them out mid-start), and passing is all they allow."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)  # its mode is set below, by fd: mkdir's passes through the umask
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise IdentityError(
            f"{path} is not a directory owned by this user ({exc.strerror}); remove it or set another path"
        ) from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise IdentityError(f"{path} is not a directory owned by this user; remove it or set another path")
        wanted = mode | (stat.S_IMODE(info.st_mode) & PASSABLE_BITS)
        if stat.S_IMODE(info.st_mode) != wanted:
            os.fchmod(fd, wanted)
    finally:
        os.close(fd)
