"""A snapshot's record (meta.json) and a client's listing: read back through fds, bounded, checked
field by field; a folder whose record cannot be used is a DamagedSnapshot, never an error."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import asdict, dataclass
from typing import Any

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.tree_copy import FILE_FLAGS
from coderunner.snapshots.layout import DAMAGED_SIZE_ENTRIES, KINDS, MAX_META_BYTES, META_NAME, SNAPSHOT_ID


@dataclass
class SnapshotMeta:
    """A snapshot's record, as meta.json holds it (no host paths, no secrets: only what a caller may see)."""

    snapshot_id: str
    client: str
    #: The caller's label (may be empty).
    name: str
    #: Unix time it was made.
    created: float
    #: "snapshot" (manage_snapshots save / fork) or "persistent" (a keep_state session's own).
    kind: str
    #: The first characters of the session it was taken from (for manage_sessions status).
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

    @classmethod
    def from_json(cls, data: object) -> SnapshotMeta | None:
        """The record meta.json holds, or None when any field is missing or of the wrong type."""
        if not isinstance(data, dict):
            return None
        text = ("snapshot_id", "client", "name", "kind", "source_session", "backend")
        if not all(isinstance(data.get(key), str) for key in text):
            return None
        if not all(_is_int(data.get(key)) and data[key] >= 0 for key in ("workspace_bytes", "state_bytes")):
            return None
        created = data.get("created")
        if not (_is_int(created) or isinstance(created, float)):
            return None
        if not all(isinstance(data.get(key), dict) for key in ("options", "state_report")):
            return None
        if data["kind"] not in KINDS or not SNAPSHOT_ID.fullmatch(data["snapshot_id"]):
            return None
        return cls(
            snapshot_id=data["snapshot_id"],
            client=data["client"],
            name=data["name"],
            created=float(created),  # type: ignore[arg-type]  # checked a number above
            kind=data["kind"],
            source_session=data["source_session"],
            backend=data["backend"],
            options=data["options"],
            workspace_bytes=data["workspace_bytes"],
            state_bytes=data["state_bytes"],
            state_report=data["state_report"],
        )


@dataclass(frozen=True)
class DamagedSnapshot:
    """A snapshot folder whose meta.json cannot be used: listed, counted and deletable all the same.

    Its owner is the client folder it lies in (host-only); its age is its folder's mtime (the host's)."""

    snapshot_id: str
    client: str
    #: Why it cannot be used, in a few words.
    why: str
    modified: float
    #: Bytes of its files (a bounded walk: at least this much).
    size_bytes: int

    @property
    def kind(self) -> str:
        return "persistent" if self.snapshot_id.startswith("keep-") else "snapshot"


@dataclass
class Listing:
    """One client's snapshot folders: the usable ones and the damaged ones, newest first."""

    snapshots: list[SnapshotMeta]
    damaged: list[DamagedSnapshot]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_entry(cfd: int, snapshot_id: str, client: str) -> SnapshotMeta | DamagedSnapshot | None:
    """The snapshot's record; a DamagedSnapshot when its meta.json cannot be used; None when there
    is no such entry (gone meanwhile)."""
    try:
        top = hostfs.open_dir(snapshot_id, dir_fd=cfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _damaged(None, snapshot_id, client, f"not a folder ({exc.strerror})", cfd)
    try:
        why, meta = _read_meta(top, snapshot_id, client)
        return meta if meta is not None else _damaged(top, snapshot_id, client, why, cfd)
    finally:
        os.close(top)


def _read_meta(top: int, snapshot_id: str, client: str) -> tuple[str, SnapshotMeta | None]:
    """(why not, None) or ("", the record) from meta.json in the snapshot folder `top`: read at most
    MAX_META_BYTES + 1 bytes, then checked field by field."""
    try:
        fd = os.open(META_NAME, FILE_FLAGS, dir_fd=top)
    except FileNotFoundError:
        return "its record is missing", None
    except OSError as exc:
        return f"its record cannot be opened ({exc.strerror})", None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "its record is not a file", None
        if info.st_size > MAX_META_BYTES:
            return f"its record is oversized ({info.st_size} bytes)", None
        data = os.read(fd, MAX_META_BYTES + 1)
    except OSError as exc:
        return f"its record cannot be read ({exc.strerror})", None
    finally:
        os.close(fd)
    if len(data) > MAX_META_BYTES:
        return "its record is oversized", None
    try:
        meta = SnapshotMeta.from_json(json.loads(data))
    except (ValueError, RecursionError):
        return "its record is not valid JSON", None
    if meta is None or meta.snapshot_id != snapshot_id or meta.client != client:
        return "its record is invalid", None
    return "", meta


def _damaged(top: int | None, snapshot_id: str, client: str, why: str, cfd: int) -> DamagedSnapshot:
    """A damaged entry's account: its folder's mtime and a bounded count of its bytes (by fd)."""
    modified, size = 0.0, 0
    with contextlib.suppress(OSError):
        modified = os.stat(snapshot_id, dir_fd=cfd, follow_symlinks=False).st_mtime
    if top is not None:
        with contextlib.suppress(OSError):
            size, _complete = hostfs.tree_size(top, max_entries=DAMAGED_SIZE_ENTRIES)
    return DamagedSnapshot(snapshot_id, client, why, modified, size)
