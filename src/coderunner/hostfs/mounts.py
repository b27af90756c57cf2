"""Which host folders a sandbox may see: the checks of the host side every one must pass.

A mount is what the user chose to share: nothing is mounted unless configured, and never $HOME,
/ or a parent of either, nor the server's own state (other sessions' workspaces and sockets). What a
mount looks like (MountSpec, Mount) is vocabulary/mounts.py's; its text form and the sandbox paths
none may take, policy/mounts.py's.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from coderunner.hostfs import staging
from coderunner.policy.mounts import MountError, check_sandbox_path
from coderunner.vocabulary.host_identity import HostIdentity
from coderunner.vocabulary.mounts import Mount, MountSpec


def _within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def resolve_mount(
    spec: MountSpec,
    *,
    protected: list[Path],
    identity: HostIdentity | None,
) -> Mount:
    """Check one configured mount and turn it into a Mount; raises MountError with the reason."""
    try:
        host = spec.host.expanduser().resolve(strict=True)
    except (FileNotFoundError, RuntimeError):
        raise MountError(f"mount source {spec.host} does not exist: create it first") from None
    if not host.is_dir():
        raise MountError(f"mount source {host} is not a folder")
    home = Path.home().resolve()
    if _within(home, host):
        raise MountError(f"refusing to mount {host}: it is {'$HOME' if host == home else 'a parent of $HOME or /'}")
    for path in protected:
        path = path.resolve()
        if _within(path, host) or _within(host, path):
            raise MountError(f"refusing to mount {host}: it overlaps CodeRunner's own state ({path})")
    sandbox = check_sandbox_path(spec.sandbox)
    if identity is not None:
        _check_identity_access(host, spec.mode == "rw", identity)
    return Mount(host=host, sandbox=sandbox, writable=spec.mode == "rw")


def _check_identity_access(host: Path, writable: bool, identity: HostIdentity) -> None:
    """A root server's sandboxes run as `identity`; the folder is staged for them (staging.py), so its
    parents need not be passable. Without an id-mapped mount the folder itself must let them in."""
    info = os.stat(host)
    if info.st_uid == identity.uid:
        return
    if writable and info.st_uid == 0:
        raise MountError(
            f"{host} belongs to root: a writable mount would let sandboxed code create root-owned files "
            "there; mount it ro, or mount a folder owned by an ordinary user"
        )
    if staging.idmap_supported(host, (info.st_uid, info.st_gid), (identity.uid, identity.gid)):
        return
    mode = info.st_mode
    readable = mode & stat.S_IROTH and mode & stat.S_IXOTH
    if not readable:
        raise MountError(
            f"the sandbox user {identity.name!r} cannot read {host} (mode {stat.S_IMODE(mode):o}) and this "
            f"kernel or file system cannot id-map it: chmod o+rx {host}"
        )
    if writable and not (mode & stat.S_IWOTH or (info.st_gid == identity.gid and mode & stat.S_IWGRP)):
        raise MountError(
            f"the sandbox user {identity.name!r} cannot write to {host} and this kernel or file system cannot "
            f"id-map it: sudo chown {identity.name} {host} (or mount it ro)"
        )
