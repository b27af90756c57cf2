"""Snapshots on the host: each client's saved sessions (workspace files plus kernel state), in a
store only the server can reach (its layout: snapshots/layout.py).

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
shares extents across the two paths, an in-kernel copy elsewhere), sendfile across file systems (a
loop-mounted workspace and the store), with plain read/write as the last resort.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.tree_copy import FILE_FLAGS, NEW_FILE_FLAGS, ByteCap, CopyReport, TreeCopy, copy_bytes
from coderunner.hostfs.workspaces import NAME as CLIENT_NAME
from coderunner.snapshots.draft import Draft
from coderunner.snapshots.layout import (
    DRAFT_PREFIX,
    MAX_META_BYTES,
    MEMORY_CONNECTION,
    MEMORY_DIR,
    SNAPSHOT_ID,
    STATE_DIR,
    STATE_FILE,
    WORKSPACE_DIR,
    SnapshotError,
    SnapshotNotFound,
    SnapshotTooLarge,
    draft_name,
    not_found,
    too_large,
    too_large_to_restore,
    write_failed,
)
from coderunner.snapshots.records import DamagedSnapshot, Listing, SnapshotMeta, read_entry

#: A staged link's mode: the store's own file, read-only for all (its folders keep everyone else out).
STAGED_LINK_BITS = 0o444

#: What callers take from here (the models and errors live beside it, in layout.py and records.py).
__all__ = [
    "MAX_META_BYTES",
    "SNAPSHOT_ID",
    "CopyReport",
    "DamagedSnapshot",
    "Draft",
    "Listing",
    "SnapshotError",
    "SnapshotMeta",
    "SnapshotNotFound",
    "SnapshotStore",
    "SnapshotTooLarge",
]


class SnapshotStore:
    """The store (see the module docstring): one per server, with its caps."""

    def __init__(self, root: Path, *, limit_bytes: int, keep: int, retention_s: float) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.keep = keep
        self.retention_s = retention_s
        #: Commits, deletes and prunes of this server go one at a time (renames of the same ids).
        self.lock = threading.RLock()

    def open(self) -> None:
        """Make the root (0700), remove drafts a dead server left, and prune expired and damaged snapshots."""
        self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with hostfs.dir_fd(self.root.parent) as parent:
            try:
                fd = hostfs.make_private_dir(parent, self.root.name, 0o700)
                os.fsync(parent)  # the store's folder outlives a crash as its snapshots do
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
            raise write_failed(exc) from exc
        assert cfd is not None
        name = draft_name()
        try:
            fd = hostfs.make_private_dir(cfd, name, 0o700)
        except OSError as exc:
            os.close(cfd)
            raise write_failed(exc) from exc
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
                    read = read_entry(cfd, name, client)
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
            raise not_found(snapshot_id)
        with self._client(client) as cfd:
            read = None if cfd is None else read_entry(cfd, snapshot_id, client)
        if isinstance(read, DamagedSnapshot):
            raise SnapshotNotFound(
                f"snapshot {snapshot_id} is damaged ({read.why}) and cannot be restored; manage_snapshots "
                "(action 'delete') removes it"
            )
        if read is None:
            raise not_found(snapshot_id)
        return read

    def memory_image(self, client: str, snapshot_id: str) -> tuple[Path, dict[str, Any]]:
        """A memory snapshot's checkpoint folder (for runsc restore) and its saved connection."""
        self.get(client, snapshot_id)
        with self._client(client) as cfd:
            if cfd is None:
                raise not_found(snapshot_id)
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
            raise not_found(snapshot_id)
        with self.lock, self._client(client) as cfd:
            if cfd is None or not hostfs.present(cfd, snapshot_id):
                raise not_found(snapshot_id)
            self._remove(cfd, snapshot_id)

    def prune(self, client: str, *, drop_damaged: bool = False) -> builtins.list[str]:
        """Delete `client`'s snapshots older than retention_s, and beyond the `keep` newest
        (kind "snapshot" only; damaged ones counted by their folder's mtime); the ids removed.
        `drop_damaged` (at start): every damaged one goes, whatever its kind.

        A persistent session's own state is neither counted nor aged: it lives as long as its named
        workspace (manage_workspaces delete removes both), and is replaced at each close."""
        with self.lock:
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
            cap = ByteCap(1 << 62, too_large) if limit_bytes is None else ByteCap(limit_bytes, too_large_to_restore)
            copy = TreeCopy(cap, write_failed=write_failed, owner=owner, file_bits=0, dir_bits=0)
            return copy.run(src, workspace_fd)

    def stage_state(self, client: str, snapshot_id: str, dest_fd: int, name: str,
                    owner: tuple[int, int] | None) -> int:  # fmt: skip
        """Stage the snapshot's state/ as folder `name` in the host-only folder `dest_fd` (the new
        sandbox's host/ dir, bound read-only), the folder 0500 and owned by `owner` when set, so the
        sandbox may read the files and nobody there may change them. Returns the bytes.

        Each file is a hard link to the store's own (made 0444 first: server-owned, read-only for
        all; the store's folders stay 0700, so only the staged folder's owner reaches it) where the
        two folders share a file system: a 500 MiB state is staged without a byte copied or written
        back to disk. Elsewhere it is copied, 0400 and owned by `owner`."""
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
                        info = os.fstat(fd)
                        if not stat.S_ISREG(info.st_mode) or not STATE_FILE.fullmatch(entry):
                            continue  # the store only ever holds regular files here
                        if _link_read_only(fd, src, entry, dst):
                            total += info.st_size
                        else:
                            total += _copy_read_only(fd, dst, entry, owner)
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
                made = hostfs.make_private_dir(root, client, 0o700)
            except FileExistsError:  # another thread made it meanwhile
                return hostfs.open_dir(client, dir_fd=root)
            try:
                os.fsync(root)  # a snapshot committed in it is durable only if the folder is too
            except OSError:
                os.close(made)
                raise
            return made

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
                raise not_found(snapshot_id)
            try:
                top = hostfs.open_dir(snapshot_id, dir_fd=cfd)
            except OSError:
                raise not_found(snapshot_id) from None
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
        aside = draft_name()
        try:
            os.rename(snapshot_id, aside, src_dir_fd=cfd, dst_dir_fd=cfd)
        except FileNotFoundError:
            return
        hostfs.remove_tree(cfd, aside)


def _link_read_only(fd: int, src: int, name: str, dst: int) -> bool:
    """Link the store's file `name` (open as `fd` in the store's folder `src`) into `dst`, made
    read-only for all first; False where a link cannot be made (another file system: copy instead)."""
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != STAGED_LINK_BITS:
            os.fchmod(fd, STAGED_LINK_BITS)
        os.link(name, name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
    except OSError:
        return False
    return True


def _copy_read_only(fd: int, dst: int, name: str, owner: tuple[int, int] | None) -> int:
    """A copy of the store's file `fd` as `name` in `dst`: 0400, owned by `owner` when set; its bytes."""
    out = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=dst)
    try:
        count = copy_bytes(fd, out, 1 << 62)
        if owner is not None:
            os.fchown(out, *owner)
        os.fchmod(out, 0o400)
    finally:
        os.close(out)
    return count
