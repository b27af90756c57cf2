"""Mounts as the user writes them ("HOST:SANDBOX[:ro|rw]") and the sandbox paths none may take.

Pure: no host folder is looked at here (hostfs/mounts.py checks the host side and grants a Mount).
The settings parse their `mounts` with it, and create_session its callers' mount strings.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from coderunner.errors import CodeRunnerError
from coderunner.vocabulary.mounts import Mount, MountSpec

#: Sandbox paths a mount may not cover: the system the sandbox is built from.
RESERVED_SANDBOX_PATHS = (
    "/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev", "/sys",
    "/tmp", "/opt/coderunner", "/workspace", "/run", "/var",
)  # fmt: skip


class MountError(CodeRunnerError, ValueError):
    """A mount that is refused; the message says why and what to do."""


def parse_mount(text: str) -> MountSpec:
    """The flag form "HOST:SANDBOX[:ro|rw]" as a MountSpec; MountError says what is wrong with it."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise MountError(f"mount {text!r} must look like HOST:SANDBOX or HOST:SANDBOX:ro|rw")
    mode = parts[2] if len(parts) == 3 else "ro"
    if mode not in ("ro", "rw"):
        raise MountError(f"mount {text!r}: the mode must be ro or rw, not {mode!r}")
    return MountSpec(host=Path(parts[0]), sandbox=parts[1], mode=mode)  # type: ignore[arg-type]  # checked ro|rw above


def check_sandbox_path(path: str) -> str:
    normal = posixpath.normpath(path)
    if ".." in path.split("/") or "\x00" in path:
        raise MountError(f"sandbox path {path!r} may not contain '..'")
    for reserved in RESERVED_SANDBOX_PATHS:
        if normal == reserved or (reserved != "/" and normal.startswith(reserved + "/")):
            raise MountError(f"sandbox path {normal} is reserved for the sandbox itself; use e.g. /data or /mnt/NAME")
    return normal


def check_distinct(mounts: list[Mount]) -> None:
    seen: set[str] = set()
    for mount in mounts:
        if mount.sandbox in seen:
            raise MountError(f"two mounts at {mount.sandbox}")
        seen.add(mount.sandbox)
