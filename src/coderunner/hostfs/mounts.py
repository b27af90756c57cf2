"""Which host folders a sandbox may see, and the checks every one must pass.

A mount is what the user chose to share: nothing is mounted unless configured, and never $HOME,
/ or a parent of either, nor the server's own state (other sessions' workspaces and sockets).
"""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, field_validator

from coderunner.errors import CodeRunnerError
from coderunner.hostfs import staging
from coderunner.sandbox import HostIdentity, Mount

#: Sandbox paths a mount may not cover: the system the sandbox is built from.
RESERVED_SANDBOX_PATHS = (
    "/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev", "/sys",
    "/tmp", "/opt/coderunner", "/workspace", "/run", "/var",
)  # fmt: skip


class MountError(CodeRunnerError, ValueError):
    """A mount that is refused; the message says why and what to do."""


class MountSpec(BaseModel):
    """One mount as configured: `{host = "~/data", sandbox = "/data", mode = "ro"}` or "~/data:/data:ro"."""

    host: Path
    sandbox: str
    mode: Literal["ro", "rw"] = "ro"

    @classmethod
    def parse(cls, text: str) -> MountSpec:
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            raise MountError(f"mount {text!r} must look like HOST:SANDBOX or HOST:SANDBOX:ro|rw")
        mode = parts[2] if len(parts) == 3 else "ro"
        if mode not in ("ro", "rw"):
            raise MountError(f"mount {text!r}: the mode must be ro or rw, not {mode!r}")
        return cls(host=Path(parts[0]), sandbox=parts[1], mode=mode)  # type: ignore[arg-type]  # checked ro|rw above

    @field_validator("sandbox")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"sandbox path {value!r} must be absolute, e.g. /data")
        return value


def _within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_sandbox_path(path: str) -> str:
    normal = posixpath.normpath(path)
    if ".." in path.split("/") or "\x00" in path:
        raise MountError(f"sandbox path {path!r} may not contain '..'")
    for reserved in RESERVED_SANDBOX_PATHS:
        if normal == reserved or (reserved != "/" and normal.startswith(reserved + "/")):
            raise MountError(f"sandbox path {normal} is reserved for the sandbox itself; use e.g. /data or /mnt/NAME")
    return normal


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


def check_distinct(mounts: list[Mount]) -> None:
    seen: set[str] = set()
    for mount in mounts:
        if mount.sandbox in seen:
            raise MountError(f"two mounts at {mount.sandbox}")
        seen.add(mount.sandbox)
