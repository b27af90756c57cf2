"""Nothing acknowledged is lost (issue 38, point 7): a snapshot is on disk when its commit returns, a
file the tools wrote is on disk when the write returns, and a persistent workspace when it is put away.

A crash cannot be staged here, so each test records what was fsynced (by inode) and checks that every
file and folder the acknowledgement covers is among it, the folder that names them included."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.sandbox_files import SandboxFiles
from coderunner.hostfs.workspaces import Workspace
from coderunner.sandbox import Mount
from coderunner.snapshots.store import SnapshotMeta, SnapshotStore

Inode = tuple[int, int]


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Inode]]:
    """The (device, inode) of every fd fsynced, in order."""
    seen: list[Inode] = []
    real = os.fsync

    def recording(fd: int) -> None:
        info = os.fstat(fd)
        seen.append((info.st_dev, info.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    yield seen


def inode(path: Path) -> Inode:
    info = os.lstat(path)
    return info.st_dev, info.st_ino


def test_a_committed_snapshot_is_fsynced_file_by_file_folder_by_folder_and_named_durably(
    tmp_path: Path, synced: list[Inode]
) -> None:
    store = SnapshotStore(tmp_path / "snapshots", limit_bytes=1 << 26, keep=5, retention_s=3600.0)
    store.open()
    workspace = tmp_path / "ws"
    (workspace / "data" / "deep").mkdir(parents=True)
    (workspace / "data" / "deep" / "blob.bin").write_bytes(b"x" * 5000)
    (workspace / "notes.txt").write_text("keep me")
    state = workspace / ".coderunner" / "snapshot"
    state.mkdir(parents=True)
    (state / "manifest.json").write_text("{}")
    draft = store.draft("alice")
    with hostfs.dir_fd(workspace) as fd:
        draft.take_state(fd, ".coderunner/snapshot")
        draft.copy_workspace(fd, exclude=".coderunner/snapshot")
    meta = SnapshotMeta(snapshot_id=store.new_id(), client="alice", name="n", created=time.time(), kind="snapshot",
                        source_session="abcd1234", backend="bwrap", options={}, workspace_bytes=0, state_bytes=0,
                        state_report={})  # fmt: skip
    synced.clear()
    draft.commit(meta)
    top = store.root / "alice" / meta.snapshot_id
    expected = [top, *(Path(root) / name for root, dirs, files in os.walk(top) for name in [*dirs, *files])]
    assert len(expected) > 6
    missing = [str(path.relative_to(tmp_path)) for path in expected if inode(path) not in synced]
    assert missing == [], "acknowledged but not on disk"
    assert synced[-1] == inode(store.root / "alice"), "the client folder goes last, after the rename"


def test_a_file_the_tools_write_is_fsynced_with_its_folders(tmp_path: Path, synced: list[Inode]) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    files = SandboxFiles([Mount(root, "/workspace", writable=True)])
    files.write("/workspace/new/inner/out.txt", b"done")
    for path in (root / "new" / "inner" / "out.txt", root / "new" / "inner", root / "new", root):
        assert inode(path) in synced, path


def test_a_persistent_plain_workspace_is_synced_when_put_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Inode] = []
    real = hostfs.syncfs

    def recording(fd: int) -> None:
        info = os.fstat(fd)
        calls.append((info.st_dev, info.st_ino))
        real(fd)

    monkeypatch.setattr(hostfs, "syncfs", recording)
    path = tmp_path / "named" / "project"
    path.parent.mkdir()
    workspace = Workspace.create(path, None, False, persistent=True)
    (path / "kept.txt").write_text("kept")
    workspace.remove()
    assert calls == [inode(path)] and (path / "kept.txt").read_text() == "kept"


@pytest.mark.skipif(os.geteuid() != 0, reason="loop-mounted images need root")
def test_a_persistent_image_is_fsynced_after_its_unmount(tmp_path: Path, synced: list[Inode]) -> None:
    path = tmp_path / "named" / "project"
    path.parent.mkdir()
    workspace = Workspace.create(path, 64, True, persistent=True)
    assert workspace.image is not None
    (path / "kept.txt").write_text("kept")
    synced.clear()
    workspace.remove()
    assert inode(workspace.image) in synced and inode(path.parent) in synced
