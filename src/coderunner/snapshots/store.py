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
                memory/         a gVisor memory checkpoint instead of state/ (written by runsc, read
                                only by runsc restoring it), and memory.json beside it: what the
                                restored kernel is reached with (its key: never shown to anyone)
            .draft-<random>/    a snapshot being made; a dead server's drafts go at the next start

A persistent session with keep_state saves its kernel state as the snapshot `keep-<name>` (no
workspace copy: the named workspace keeps its own files), replaced at each close.

Every snapshot folder stays countable and deletable by its owner even when its meta.json cannot be
read (missing, oversized, garbled): it is listed as damaged, counted against snapshot_keep (aged by
its folder's mtime), deletable, and removed at the next start. Its owner is the client folder it
lies in, which only the host ever names or writes; nothing in meta.json decides whose it is.

The workspace and the state folder the guest wrote are the sandbox's: the host reads them only
through directory fds, links never followed, every file opened O_NOFOLLOW and checked to be a
regular file after opening, and every byte counted against the size cap. The store's own folders
are the host's, made through fds too. Copies use copy_file_range (a reflink where the file system
shares extents across the two paths, an in-kernel copy elsewhere), with plain read/write as the
fallback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coderunner.errors import CodeRunnerError
from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.tree_copy import (
    FILE_FLAGS,
    MAX_ENTRIES,
    NEW_FILE_FLAGS,
    ByteCap,
    CopyReport,
    TreeCopy,
    bounded_names,
    copy_bytes,
    fast_mount_id,
)
from coderunner.hostfs.workspaces import NAME as CLIENT_NAME

#: A snapshot id: "s-" and 12 url-safe characters, or "keep-<workspace name>" (a persistent session's).
SNAPSHOT_ID = re.compile(r"(s-[A-Za-z0-9_-]{12}|keep-[A-Za-z0-9][A-Za-z0-9_.-]{0,63})")
META_NAME = "meta.json"
STATE_DIR = "state"
WORKSPACE_DIR = "workspace"
MEMORY_DIR = "memory"
MEMORY_CONNECTION = "memory.json"
#: The names a guest's state folder may hold (manifest.json, v-0001.pkl, ...): anything else is tampering.
STATE_FILE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DRAFT_PREFIX = ".draft-"
KINDS = ("snapshot", "persistent")
#: meta.json is the host's own, small: a bigger one is broken (and never written: commit refuses it).
MAX_META_BYTES = 1 << 20
#: Entries a damaged snapshot's size walk visits (its size is then "at least").
DAMAGED_SIZE_ENTRIES = 100_000
MIB = 1 << 20
#: Bits the store's own copy always grants its owner, so a non-root server can read back a file
#: the sandbox had made 0000 (root reads it anyway, and then keeps the mode exactly).
_STORE_FILE_BITS = 0 if os.geteuid() == 0 else 0o600
_STORE_DIR_BITS = 0 if os.geteuid() == 0 else 0o700


class SnapshotError(CodeRunnerError):
    """A snapshot request that cannot be served; the message says why and what to do."""


class SnapshotTooLarge(SnapshotError):
    """The snapshot would pass its size cap (snapshot_limit_mb); nothing was kept."""


class SnapshotNotFound(SnapshotError):
    """No snapshot of that id for this client (another client's id gets the same answer)."""


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
            created=float(created),  # type: ignore[arg-type]
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


def _too_large(so_far: int, limit: int) -> SnapshotTooLarge:
    cap = f"{limit // MIB}" if limit % MIB == 0 else f"{limit / MIB:.1f}"
    return SnapshotTooLarge(
        f"the snapshot is past its size cap: {so_far / MIB:.1f} MiB so far, the cap is {cap} MiB; "
        "delete files or variables you do not need, or ask the user to raise snapshot_limit_mb"
    )


def _tampered(why: str) -> SnapshotError:
    return SnapshotError(
        f"the saved state was tampered with inside the sandbox ({why}); nothing was kept. "
        "Run the snapshot again; if it repeats, restart the session (kernel_reset)"
    )


def _write_failed(exc: OSError) -> SnapshotError:
    why = exc.strerror or type(exc).__name__
    return SnapshotError(
        f"the snapshot could not be copied ({why}); if a disk is full, delete files you do not need "
        "or ask the user to free space on the server"
    )


def _too_large_to_restore(so_far: int, limit: int) -> SnapshotError:
    return SnapshotError(
        f"the snapshot's files do not fit this session's disk cap: {so_far / MIB:.1f} MiB so far, "
        f"the cap is {limit / MIB:.0f} MiB; ask the user to raise the disk cap, or restore a smaller snapshot"
    )


class Draft:
    """A snapshot being made in the store (a host-only `.draft-*` folder): fill it, then commit or discard."""

    def __init__(self, store: SnapshotStore, client: str, client_fd: int, name: str, fd: int) -> None:
        self.store = store
        self.client = client
        self.name = name
        self._client_fd = client_fd
        self._fd = fd
        self._cap = ByteCap(store.limit_bytes, _too_large)
        self._done = False

    @property
    def bytes_taken(self) -> int:
        """Bytes counted against the cap so far (state and workspace)."""
        return self._cap.used

    def take_state(self, workspace_fd: int, rel_dir: str, *, remove: bool = True) -> int:
        """Copy the state folder the guest wrote (`rel_dir`, e.g. ".coderunner/snapshot", below the
        workspace open as `workspace_fd`) into this draft's state/: regular files directly in it only,
        opened O_NOFOLLOW, counted against the cap; then (`remove`) remove it from the workspace (by fd).
        Returns the bytes taken. Raises SnapshotTooLarge, SnapshotError (missing, not a folder)."""
        self._check_open()
        parts = [part for part in rel_dir.split("/") if part]
        if not parts or any(part in (".", "..") for part in parts):
            raise ValueError(f"state folder {rel_dir!r}: a relative path below the workspace")
        parent = os.dup(workspace_fd)
        try:
            for part in parts[:-1]:
                try:
                    inner = hostfs.open_dir(part, dir_fd=parent)
                except FileNotFoundError:
                    raise _no_state() from None
                except OSError as exc:
                    raise _tampered(f"{part} is not a folder") from exc
                os.close(parent)
                parent = inner
            try:
                return self._take_state_dir(parent, parts[-1])
            finally:
                if remove:
                    with contextlib.suppress(OSError):
                        hostfs.remove_tree(parent, parts[-1])
        finally:
            os.close(parent)

    def _take_state_dir(self, parent: int, name: str) -> int:
        try:
            src = hostfs.open_dir(name, dir_fd=parent)
        except FileNotFoundError:
            raise _no_state() from None
        except OSError as exc:
            raise _tampered("the state folder is not a folder") from exc
        try:
            if fast_mount_id(src) != fast_mount_id(parent):
                raise _tampered("the state folder is another mount")
            names = bounded_names(src, MAX_ENTRIES)
            if len(names) > MAX_ENTRIES:
                raise _tampered("too many files")
            try:
                dst = hostfs.make_private_dir(self._fd, STATE_DIR, 0o700)
            except OSError as exc:
                raise _write_failed(exc) from exc
            try:
                taken = 0
                for entry in sorted(names):
                    if not STATE_FILE.fullmatch(entry):
                        raise _tampered(f"unexpected name {entry[:80]!r}")
                    taken += self._take_state_file(src, dst, entry)
                return taken
            finally:
                os.close(dst)
        finally:
            os.close(src)

    def _take_state_file(self, src: int, dst: int, name: str) -> int:
        try:
            fd = os.open(name, FILE_FLAGS, dir_fd=src)
        except OSError as exc:
            raise _tampered(f"{name} is not a regular file") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise _tampered(f"{name} is not a regular file")
            if info.st_size > self._cap.left:
                raise _too_large(self._cap.used + info.st_size, self._cap.limit)
            try:
                out = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=dst)
            except OSError as exc:
                raise _write_failed(exc) from exc
            try:
                count = copy_bytes(fd, out, self._cap.left)
            except OSError as exc:
                raise _write_failed(exc) from exc
            finally:
                os.close(out)
            if count > self._cap.left:
                raise _too_large(self._cap.used + count, self._cap.limit)
            self._cap.used += count
            return count
        finally:
            os.close(fd)

    def copy_workspace(self, workspace_fd: int, exclude: str | None = None) -> CopyReport:
        """Copy the workspace's files into workspace/ (see the module docstring), skipping the
        relative path `exclude`; bounded by what the cap leaves after the state. Raises SnapshotTooLarge."""
        self._check_open()
        if exclude is not None:
            exclude = "/".join(part for part in exclude.split("/") if part) or None
        try:
            dst = hostfs.make_private_dir(self._fd, WORKSPACE_DIR, 0o700)
        except OSError as exc:
            raise _write_failed(exc) from exc
        try:
            copy = TreeCopy(
                self._cap, write_failed=_write_failed, owner=None, file_bits=_STORE_FILE_BITS,
                dir_bits=_STORE_DIR_BITS, exclude=exclude,
            )  # fmt: skip
            return copy.run(workspace_fd, dst)
        finally:
            os.close(dst)

    def memory_dir(self) -> Path:
        """An empty host-only folder for a memory checkpoint (runsc writes the image there by path:
        nothing below the store is the sandbox's)."""
        self._check_open()
        try:
            os.close(hostfs.make_private_dir(self._fd, MEMORY_DIR, 0o700))
        except OSError as exc:
            raise _write_failed(exc) from exc
        return self.store.root / self.client / self.name / MEMORY_DIR

    def charge_memory(self, connection: dict[str, Any]) -> int:
        """Count the checkpoint's bytes against the cap (raises SnapshotTooLarge past it) and keep
        `connection` (Kernel.saved_connection: the key included) beside it, 0600. Returns the bytes."""
        self._check_open()
        fd = hostfs.open_dir(MEMORY_DIR, dir_fd=self._fd)
        try:
            total = 0
            for entry in hostfs.entries(fd):
                info = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                total += info.st_size if stat.S_ISREG(info.st_mode) else 0
        finally:
            os.close(fd)
        if total > self._cap.left:
            raise _too_large(self._cap.used + total, self._cap.limit)
        self._cap.used += total
        try:
            hostfs.write_new_file(self._fd, MEMORY_CONNECTION, json.dumps(connection).encode(), 0o600)
        except OSError as exc:
            raise _write_failed(exc) from exc
        return total

    def commit(self, meta: SnapshotMeta) -> SnapshotMeta:
        """Write meta.json and rename the draft to meta.snapshot_id (replacing an older snapshot of
        that id: a persistent session's state); the store then prunes the client's old snapshots."""
        self._check_open()
        if not SNAPSHOT_ID.fullmatch(meta.snapshot_id) or meta.kind not in KINDS or meta.client != self.client:
            raise ValueError(f"snapshot meta {meta.snapshot_id!r} ({meta.kind}, {meta.client}) does not fit this draft")
        data = json.dumps(meta.as_json(), sort_keys=True).encode()
        if len(data) > MAX_META_BYTES:  # the callers bound what goes in; this never stores more
            raise SnapshotError(f"the snapshot's record is {len(data)} bytes, over {MAX_META_BYTES}; nothing was kept")
        with self.store._lock:
            try:
                hostfs.write_new_file(self._fd, META_NAME, data, 0o600)
                aside = None
                if hostfs.present(self._client_fd, meta.snapshot_id):
                    aside = _draft_name()
                    os.rename(meta.snapshot_id, aside, src_dir_fd=self._client_fd, dst_dir_fd=self._client_fd)
                os.rename(self.name, meta.snapshot_id, src_dir_fd=self._client_fd, dst_dir_fd=self._client_fd)
            except OSError as exc:
                raise _write_failed(exc) from exc
            self._done = True
            os.close(self._fd)
            if aside is not None:
                with contextlib.suppress(OSError):
                    hostfs.remove_tree(self._client_fd, aside)
            os.close(self._client_fd)
            self._fd = self._client_fd = -1
        self.store.prune(self.client)
        return meta

    def discard(self) -> None:
        """Remove the draft (after a failure); never raises."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            os.close(self._fd)
        with contextlib.suppress(Exception):
            hostfs.remove_tree(self._client_fd, self.name)
        with contextlib.suppress(Exception):
            os.close(self._client_fd)
        self._fd = self._client_fd = -1

    def _check_open(self) -> None:
        if self._done:
            raise RuntimeError("this snapshot draft was already committed or discarded")

    def __del__(self) -> None:
        self.discard()


def _draft_name() -> str:
    return DRAFT_PREFIX + secrets.token_hex(8)


def _no_state() -> SnapshotError:
    return SnapshotError("the kernel saved no state to take (it may have been reset meanwhile); run the snapshot again")


class SnapshotStore:
    """The store (see the module docstring): one per server, with its caps."""

    def __init__(self, root: Path, *, limit_bytes: int, keep: int, retention_s: float) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.keep = keep
        self.retention_s = retention_s
        #: Commits, deletes and prunes of this server go one at a time (renames of the same ids).
        self._lock = threading.RLock()

    def open(self) -> None:
        """Make the root (0700), remove drafts a dead server left, and prune expired and damaged snapshots."""
        self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with hostfs.dir_fd(self.root.parent) as parent:
            try:
                fd = hostfs.make_private_dir(parent, self.root.name, 0o700)
            except FileExistsError:
                fd = hostfs.open_dir(self.root.name, dir_fd=parent)
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid():
                raise SnapshotError(
                    f"the snapshot folder {self.root} belongs to another user; remove it or set snapshots_dir"
                )
            if stat.S_IMODE(info.st_mode) != 0o700:
                os.fchmod(fd, 0o700)
            clients = [name for name in hostfs.entries(fd) if CLIENT_NAME.fullmatch(name)]
            for client in clients:
                with contextlib.suppress(OSError):
                    cfd = hostfs.open_dir(client, dir_fd=fd)
                    try:
                        for name in hostfs.entries(cfd):
                            if name.startswith(DRAFT_PREFIX):
                                with contextlib.suppress(OSError):
                                    hostfs.remove_tree(cfd, name)
                    finally:
                        os.close(cfd)
        finally:
            os.close(fd)
        for client in clients:
            with contextlib.suppress(OSError):
                self.prune(client, drop_damaged=True)

    @staticmethod
    def new_id() -> str:
        """A fresh snapshot id ("s-" and 12 url-safe characters)."""
        return "s-" + secrets.token_urlsafe(9)

    def draft(self, client: str) -> Draft:
        """A new draft in `client`'s folder (made on first use)."""
        if not CLIENT_NAME.fullmatch(client):
            raise SnapshotError(f"client name {client[:80]!r} cannot hold snapshots")
        try:
            cfd = self._client_fd(client, create=True)
        except OSError as exc:
            raise _write_failed(exc) from exc
        assert cfd is not None
        name = _draft_name()
        try:
            fd = hostfs.make_private_dir(cfd, name, 0o700)
        except OSError as exc:
            os.close(cfd)
            raise _write_failed(exc) from exc
        return Draft(self, client, cfd, name, fd)

    def list(self, client: str) -> list[SnapshotMeta]:
        """`client`'s usable snapshots, newest first (see `listing` for the damaged ones too)."""
        return self.listing(client).snapshots

    def listing(self, client: str) -> Listing:
        """Every snapshot folder of `client`: the usable ones and the damaged ones, newest first."""
        found = Listing([], [])
        with self._client(client) as cfd:
            if cfd is None:
                return found
            for name in hostfs.entries(cfd):
                if SNAPSHOT_ID.fullmatch(name):
                    read = _read_entry(cfd, name, client)
                    if isinstance(read, SnapshotMeta):
                        found.snapshots.append(read)
                    elif read is not None:
                        found.damaged.append(read)
        found.snapshots.sort(key=lambda meta: (meta.created, meta.snapshot_id), reverse=True)
        found.damaged.sort(key=lambda entry: (entry.modified, entry.snapshot_id), reverse=True)
        return found

    def get(self, client: str, snapshot_id: str) -> SnapshotMeta:
        """`client`'s snapshot `snapshot_id`; raises SnapshotNotFound (a malformed id, a damaged one too)."""
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID.fullmatch(snapshot_id):
            raise _not_found(snapshot_id)
        with self._client(client) as cfd:
            read = None if cfd is None else _read_entry(cfd, snapshot_id, client)
        if isinstance(read, DamagedSnapshot):
            raise SnapshotNotFound(
                f"snapshot {snapshot_id} is damaged ({read.why}) and cannot be restored; delete_snapshot removes it"
            )
        if read is None:
            raise _not_found(snapshot_id)
        return read

    def memory_image(self, client: str, snapshot_id: str) -> tuple[Path, dict[str, Any]]:
        """A memory snapshot's checkpoint folder (for runsc restore) and its saved connection."""
        self.get(client, snapshot_id)
        with self._client(client) as cfd:
            if cfd is None:
                raise _not_found(snapshot_id)
            top = hostfs.open_dir(snapshot_id, dir_fd=cfd)
            try:
                os.close(hostfs.open_dir(MEMORY_DIR, dir_fd=top))
                fd = os.open(MEMORY_CONNECTION, FILE_FLAGS, dir_fd=top)
                with open(fd, "rb") as handle:
                    connection = json.loads(handle.read(MAX_META_BYTES))
            except (OSError, ValueError) as exc:
                raise SnapshotError(f"snapshot {snapshot_id} holds no usable memory checkpoint ({exc})") from None
            finally:
                os.close(top)
        if not isinstance(connection, dict):
            raise SnapshotError(f"snapshot {snapshot_id} holds no usable memory checkpoint")
        return self.root / client / snapshot_id / MEMORY_DIR, connection

    def delete(self, client: str, snapshot_id: str) -> None:
        """Delete `client`'s snapshot for good, damaged or not; raises SnapshotNotFound.

        Whose it is comes from the client folder it lies in (host-only), never from its meta.json."""
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID.fullmatch(snapshot_id):
            raise _not_found(snapshot_id)
        with self._lock, self._client(client) as cfd:
            if cfd is None or not hostfs.present(cfd, snapshot_id):
                raise _not_found(snapshot_id)
            self._remove(cfd, snapshot_id)

    def prune(self, client: str, *, drop_damaged: bool = False) -> list[str]:
        """Delete `client`'s snapshots older than retention_s, and beyond the `keep` newest
        (kind "snapshot" only; damaged ones counted by their folder's mtime); the ids removed.
        `drop_damaged` (at start): every damaged one goes, whatever its kind.

        A persistent session's own state is neither counted nor aged: it lives as long as its named
        workspace (delete_workspace removes both), and is replaced at each close."""
        with self._lock:
            now = time.time()
            listing = self.listing(client)
            removed = [entry.snapshot_id for entry in listing.damaged if drop_damaged]
            ages = [(meta.created, meta.snapshot_id) for meta in listing.snapshots if meta.kind == "snapshot"]
            ages += [(entry.modified, entry.snapshot_id) for entry in listing.damaged
                     if entry.kind == "snapshot" and not drop_damaged]  # fmt: skip
            kept = 0
            for created, snapshot_id in sorted(ages, reverse=True):
                expired = now - created > self.retention_s
                if not expired:
                    kept += 1
                    expired = kept > self.keep
                if expired:
                    removed.append(snapshot_id)
            if removed:
                with self._client(client) as cfd:
                    assert cfd is not None
                    for snapshot_id in removed:
                        self._remove(cfd, snapshot_id)
            return removed

    def restore_workspace(self, client: str, snapshot_id: str, workspace_fd: int,
                          owner: tuple[int, int] | None, *, limit_bytes: int | None = None) -> CopyReport:  # fmt: skip
        """Copy the snapshot's workspace/ into the fresh workspace open as `workspace_fd` (no
        sandbox runs on it yet), every entry given to `owner` (the new sandbox's host uid) when set.

        `limit_bytes` (optional): the new session's disk cap; past it a SnapshotError says so. Folders
        the host already made in the workspace are filled, not refused."""
        self.get(client, snapshot_id)
        with self._snapshot_part(client, snapshot_id, WORKSPACE_DIR) as src:
            if src is None:  # a persistent session's state: its workspace kept its own files
                return CopyReport()
            cap = ByteCap(1 << 62, _too_large) if limit_bytes is None else ByteCap(limit_bytes, _too_large_to_restore)
            copy = TreeCopy(cap, write_failed=_write_failed, owner=owner, file_bits=0, dir_bits=0)
            return copy.run(src, workspace_fd)

    def stage_state(self, client: str, snapshot_id: str, dest_fd: int, name: str,
                    owner: tuple[int, int] | None) -> int:  # fmt: skip
        """Copy the snapshot's state/ as folder `name` into the host-only folder `dest_fd` (the new
        sandbox's host/ dir, bound read-only): files 0400 and the folder 0500, owned by `owner`
        when set, so the sandbox may read them and nobody there may change them. Returns the bytes."""
        self.get(client, snapshot_id)
        with self._snapshot_part(client, snapshot_id, STATE_DIR) as src:
            if src is None:
                raise SnapshotError(f"snapshot {snapshot_id} holds no kernel state; restore another one")
            hostfs.remove_tree(dest_fd, name)
            dst = hostfs.make_private_dir(dest_fd, name, 0o700)
            total = 0
            try:
                for entry in sorted(hostfs.entries(src)):
                    fd = os.open(entry, FILE_FLAGS, dir_fd=src)
                    try:
                        if not stat.S_ISREG(os.fstat(fd).st_mode) or not STATE_FILE.fullmatch(entry):
                            continue  # the store only ever holds regular files here
                        out = os.open(entry, NEW_FILE_FLAGS, 0o600, dir_fd=dst)
                        try:
                            total += copy_bytes(fd, out, 1 << 62)
                            if owner is not None:
                                os.fchown(out, *owner)
                            os.fchmod(out, 0o400)
                        finally:
                            os.close(out)
                    finally:
                        os.close(fd)
                if owner is not None:
                    os.fchown(dst, *owner)
                os.fchmod(dst, 0o500)
            finally:
                os.close(dst)
            return total

    # The store's own folders (host-only).

    def _client_fd(self, client: str, *, create: bool) -> int | None:
        """An fd for `client`'s folder; None when it does not exist (and create is False)."""
        if not create and not self.root.is_dir():
            return None
        with hostfs.dir_fd(self.root) as root:
            try:
                return hostfs.open_dir(client, dir_fd=root)
            except FileNotFoundError:
                if not create:
                    return None
            try:
                return hostfs.make_private_dir(root, client, 0o700)
            except FileExistsError:  # another thread made it meanwhile
                return hostfs.open_dir(client, dir_fd=root)

    @contextlib.contextmanager
    def _client(self, client: str) -> Any:
        fd = self._client_fd(client, create=False) if CLIENT_NAME.fullmatch(client) else None
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @contextlib.contextmanager
    def _snapshot_part(self, client: str, snapshot_id: str, part: str) -> Any:
        with self._client(client) as cfd:
            if cfd is None:
                raise _not_found(snapshot_id)
            try:
                top = hostfs.open_dir(snapshot_id, dir_fd=cfd)
            except OSError:
                raise _not_found(snapshot_id) from None
            try:
                try:
                    fd = hostfs.open_dir(part, dir_fd=top)
                except FileNotFoundError:
                    fd = None
                try:
                    yield fd
                finally:
                    if fd is not None:
                        os.close(fd)
            finally:
                os.close(top)

    def _remove(self, cfd: int, snapshot_id: str) -> None:
        """Take the snapshot out of the listing at once (a rename to a draft name), then delete it."""
        aside = _draft_name()
        try:
            os.rename(snapshot_id, aside, src_dir_fd=cfd, dst_dir_fd=cfd)
        except FileNotFoundError:
            return
        hostfs.remove_tree(cfd, aside)


def _not_found(snapshot_id: object) -> SnapshotNotFound:
    shown = snapshot_id[:80] if isinstance(snapshot_id, str) else snapshot_id
    return SnapshotNotFound(f"no snapshot {shown!r} for this client; list_snapshots shows the ones you can use")


def _read_entry(cfd: int, snapshot_id: str, client: str) -> SnapshotMeta | DamagedSnapshot | None:
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
