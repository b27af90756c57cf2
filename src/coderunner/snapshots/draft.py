"""A snapshot being made: a host-only `.draft-*` folder in its client's folder, filled with the
kernel state the guest wrote and the workspace's files (each byte counted against the cap), then
committed under its id or discarded. What it takes from the sandbox it reads only through fds."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any, Protocol

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
from coderunner.snapshots.layout import (
    KINDS,
    MAX_META_BYTES,
    MEMORY_CONNECTION,
    MEMORY_DIR,
    META_NAME,
    SNAPSHOT_ID,
    STATE_DIR,
    STATE_FILE,
    STORE_DIR_BITS,
    STORE_FILE_BITS,
    WORKSPACE_DIR,
    SnapshotError,
    draft_name,
    no_state,
    tampered,
    too_large,
    write_failed,
)
from coderunner.snapshots.records import SnapshotMeta


class DraftHome(Protocol):
    """The store a draft is made in (SnapshotStore is one): where, the cap on a snapshot's bytes, the lock
    its renames take, and the pruning of a client's old snapshots once one is committed."""

    @property
    def root(self) -> Path: ...

    @property
    def limit_bytes(self) -> int: ...

    @property
    def lock(self) -> contextlib.AbstractContextManager[object]: ...

    def prune(self, client: str) -> object: ...


class Draft:
    """A snapshot being made in the store (a host-only `.draft-*` folder): fill it, then commit or discard."""

    def __init__(self, store: DraftHome, client: str, client_fd: int, name: str, fd: int) -> None:
        self.store = store
        self.client = client
        self.name = name
        self._client_fd = client_fd
        self._fd = fd
        self._cap = ByteCap(store.limit_bytes, too_large)
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
                    raise no_state() from None
                except OSError as exc:
                    raise tampered(f"{part} is not a folder") from exc
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
            raise no_state() from None
        except OSError as exc:
            raise tampered("the state folder is not a folder") from exc
        try:
            if fast_mount_id(src) != fast_mount_id(parent):
                raise tampered("the state folder is another mount")
            names = bounded_names(src, MAX_ENTRIES)
            if len(names) > MAX_ENTRIES:
                raise tampered("too many files")
            try:
                dst = hostfs.make_private_dir(self._fd, STATE_DIR, 0o700)
            except OSError as exc:
                raise write_failed(exc) from exc
            try:
                taken = 0
                for entry in sorted(names):
                    if not STATE_FILE.fullmatch(entry):
                        raise tampered(f"unexpected name {entry[:80]!r}")
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
            raise tampered(f"{name} is not a regular file") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise tampered(f"{name} is not a regular file")
            if info.st_size > self._cap.left:
                raise too_large(self._cap.used + info.st_size, self._cap.limit)
            try:
                out = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=dst)
            except OSError as exc:
                raise write_failed(exc) from exc
            try:
                count = copy_bytes(fd, out, self._cap.left)
            except OSError as exc:
                raise write_failed(exc) from exc
            finally:
                os.close(out)
            if count > self._cap.left:
                raise too_large(self._cap.used + count, self._cap.limit)
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
            raise write_failed(exc) from exc
        try:
            copy = TreeCopy(
                self._cap, write_failed=write_failed, owner=None, file_bits=STORE_FILE_BITS,
                dir_bits=STORE_DIR_BITS, exclude=exclude,
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
            raise write_failed(exc) from exc
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
            raise too_large(self._cap.used + total, self._cap.limit)
        self._cap.used += total
        try:
            hostfs.write_new_file(self._fd, MEMORY_CONNECTION, json.dumps(connection).encode(), 0o600)
        except OSError as exc:
            raise write_failed(exc) from exc
        return total

    def commit(self, meta: SnapshotMeta) -> SnapshotMeta:
        """Write meta.json and rename the draft to meta.snapshot_id (replacing an older snapshot of
        that id: a persistent session's state), durably (fsync of every file and folder in it, and
        of the client folder after the rename); the store then prunes the client's old snapshots."""
        self._check_open()
        if not SNAPSHOT_ID.fullmatch(meta.snapshot_id) or meta.kind not in KINDS or meta.client != self.client:
            raise ValueError(f"snapshot meta {meta.snapshot_id!r} ({meta.kind}, {meta.client}) does not fit this draft")
        data = json.dumps(meta.as_json(), sort_keys=True).encode()
        if len(data) > MAX_META_BYTES:  # the callers bound what goes in; this never stores more
            raise SnapshotError(f"the snapshot's record is {len(data)} bytes, over {MAX_META_BYTES}; nothing was kept")
        with self.store.lock:
            try:
                hostfs.write_new_file(self._fd, META_NAME, data, 0o600)
                # Durable before it is named: every file and folder of the draft on disk, then the
                # renames, then the client folder that holds them (the caller is told "saved" after).
                hostfs.sync_tree(self._fd)
                aside = None
                if hostfs.present(self._client_fd, meta.snapshot_id):
                    aside = draft_name()
                    os.rename(meta.snapshot_id, aside, src_dir_fd=self._client_fd, dst_dir_fd=self._client_fd)
                os.rename(self.name, meta.snapshot_id, src_dir_fd=self._client_fd, dst_dir_fd=self._client_fd)
                os.fsync(self._client_fd)
            except OSError as exc:
                raise write_failed(exc) from exc
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
