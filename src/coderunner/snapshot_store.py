"""Snapshots on the host: each client's saved sessions (workspace files plus kernel state), in a
store only the server can reach.

    SNAPSHOTS/                  host-only (0700, the server's user); never bound into a sandbox
        <client>/               one client's snapshots: a client lists, restores and deletes only these
            <snapshot_id>/      one whole snapshot (renamed into place once complete)
                meta.json       SnapshotMeta, written by the host last
                state/          the kernel state the guest saved (manifest.json, v-NNNN.pkl): bytes
                                that are only ever read inside a sandbox, never unpickled here
                workspace/      the workspace's files: regular files, folders and symlinks (kept as
                                links, never followed); fifos, sockets and devices are left out
            .draft-<random>/    a snapshot being made; a dead server's drafts go at the next start

A persistent session with keep_state saves its kernel state as the snapshot `keep-<name>` (no
workspace copy: the named workspace keeps its own files), replaced at each close.

The workspace and the state folder the guest wrote are the sandbox's: the host reads them only
through directory fds, links never followed, every file opened O_NOFOLLOW and checked to be a
regular file after opening, and every byte counted against the size cap. The store's own folders
are the host's, made through fds too. Copies use copy_file_range (a reflink where the file system
shares extents across the two paths, an in-kernel copy elsewhere), with plain read/write as the
fallback.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CodeRunnerError

#: A snapshot id: "s-" and 12 url-safe characters, or "keep-<workspace name>" (a persistent session's).
SNAPSHOT_ID = re.compile(r"(s-[A-Za-z0-9_-]{12}|keep-[A-Za-z0-9][A-Za-z0-9_.-]{0,63})")
#: Folders below the workspace (or state folder) a copy enters at most, and entries it takes at most.
MAX_DEPTH = 64
MAX_ENTRIES = 200_000
META_NAME = "meta.json"
STATE_DIR = "state"
WORKSPACE_DIR = "workspace"


class SnapshotError(CodeRunnerError):
    """A snapshot request that cannot be served; the message says why and what to do."""


class SnapshotTooLarge(SnapshotError):
    """The snapshot would pass its size cap (snapshot_limit_mb); nothing was kept."""


class SnapshotNotFound(SnapshotError):
    """No snapshot of that id for this client (another client's id gets the same answer)."""


@dataclass
class CopyReport:
    """What one copy took, and what it left out (with why) so a reply can say it."""

    files: int = 0
    folders: int = 0
    links: int = 0
    bytes: int = 0
    #: "path: why" for each entry left out (fifo, socket, device, too deep, unreadable).
    skipped: list[str] = field(default_factory=list)


@dataclass
class SnapshotMeta:
    """A snapshot's record, as meta.json holds it (no host paths, no secrets: only what a caller may see)."""

    snapshot_id: str
    client: str
    #: The caller's label (may be empty).
    name: str
    #: Unix time it was made.
    created: float
    #: "snapshot" (snapshot_session / fork_session) or "persistent" (a keep_state session's own).
    kind: str
    #: The first characters of the session it was taken from (for session_status).
    source_session: str
    #: The backend that made it (restoring on another backend is allowed: the state is portable).
    backend: str
    #: The session options a restore starts from: network, allow, memory_mb, cpus, timeout_s, name.
    options: dict[str, Any]
    workspace_bytes: int
    state_bytes: int
    #: The guest's account of the state: saved, modules, skipped (see coderunner_guest/snapshot.py).
    state_report: dict[str, Any]

    @property
    def size_bytes(self) -> int:
        return self.workspace_bytes + self.state_bytes

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class Draft:
    """A snapshot being made in the store (a host-only `.draft-*` folder): fill it, then commit or discard."""

    def take_state(self, workspace_fd: int, rel_dir: str) -> int:
        """Move the state folder the guest wrote (`rel_dir`, e.g. ".coderunner/snapshot", below the
        workspace open as `workspace_fd`) into this draft's state/: regular files directly in it only,
        opened O_NOFOLLOW, counted against the cap; then remove it from the workspace (by fd).
        Returns the bytes taken. Raises SnapshotTooLarge, SnapshotError (missing, not a folder)."""
        raise NotImplementedError

    def copy_workspace(self, workspace_fd: int, exclude: str | None = None) -> CopyReport:
        """Copy the workspace's files into workspace/ (see the module docstring), skipping the
        relative path `exclude`; bounded by what the cap leaves after the state. Raises SnapshotTooLarge."""
        raise NotImplementedError

    def commit(self, meta: SnapshotMeta) -> SnapshotMeta:
        """Write meta.json and rename the draft to meta.snapshot_id (replacing an older snapshot of
        that id: a persistent session's state); the store then prunes the client's old snapshots."""
        raise NotImplementedError

    def discard(self) -> None:
        """Remove the draft (after a failure); never raises."""
        raise NotImplementedError


class SnapshotStore:
    """The store (see the module docstring): one per server, with its caps."""

    def __init__(self, root: Path, *, limit_bytes: int, keep: int, retention_s: float) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.keep = keep
        self.retention_s = retention_s

    def open(self) -> None:
        """Make the root (0700), remove drafts a dead server left, and prune expired snapshots."""
        raise NotImplementedError

    @staticmethod
    def new_id() -> str:
        """A fresh snapshot id ("s-" and 12 url-safe characters)."""
        raise NotImplementedError

    def draft(self, client: str) -> Draft:
        """A new draft in `client`'s folder (made on first use)."""
        raise NotImplementedError

    def list(self, client: str) -> list[SnapshotMeta]:
        """`client`'s snapshots, newest first (unreadable entries are left out)."""
        raise NotImplementedError

    def get(self, client: str, snapshot_id: str) -> SnapshotMeta:
        """`client`'s snapshot `snapshot_id`; raises SnapshotNotFound (a malformed id too)."""
        raise NotImplementedError

    def delete(self, client: str, snapshot_id: str) -> None:
        """Delete `client`'s snapshot for good; raises SnapshotNotFound."""
        raise NotImplementedError

    def prune(self, client: str) -> list[str]:
        """Delete `client`'s snapshots older than retention_s, and beyond the `keep` newest
        (kind "snapshot" only: a persistent session's own state is not counted); the ids removed."""
        raise NotImplementedError

    def restore_workspace(self, client: str, snapshot_id: str, workspace_fd: int,
                          owner: tuple[int, int] | None) -> CopyReport:  # fmt: skip
        """Copy the snapshot's workspace/ into the fresh workspace open as `workspace_fd` (no
        sandbox runs on it yet), every entry given to `owner` (the new sandbox's host uid) when set."""
        raise NotImplementedError

    def stage_state(self, client: str, snapshot_id: str, dest_fd: int, name: str,
                    owner: tuple[int, int] | None) -> int:  # fmt: skip
        """Copy the snapshot's state/ as folder `name` into the host-only folder `dest_fd` (the new
        sandbox's host/ dir, bound read-only): files 0400 and the folder 0500, owned by `owner`
        when set, so the sandbox may read them and nobody there may change them. Returns the bytes."""
        raise NotImplementedError
