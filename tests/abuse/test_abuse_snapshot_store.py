"""The snapshot store against a workspace the sandbox planted, host level (no server needed).

Each case aims at a canary this test made outside the workspace: a file and a folder of marker
bytes. The store must never hold a byte of it (unless the test itself hardlinked it in), a restore
must never write, chown or chmod through a planted name, and nothing outside the store and the
workspace may change. Fifos and a file swapped for a link mid-copy must neither hang nor leak.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.tree_copy import MAX_DEPTH
from coderunner.snapshots.store import CopyReport, Draft, SnapshotError, SnapshotMeta, SnapshotStore, SnapshotTooLarge

MARKER = b"CANARY-snapshot-store-7b31e"
CANARY_BYTES = MARKER * 512
MIB = 1 << 20
STATE_REL = ".coderunner/snapshot"
OWNER = (34567, 34568)


@dataclass
class Arena:
    root: Path
    canary: Path
    workspace: Path
    store: SnapshotStore
    #: Where restores go (checked by each test, left out of the arena's "nothing else changed").
    restored: Path

    @property
    def canary_file(self) -> Path:
        return self.canary / "secret"

    @property
    def canary_dir(self) -> Path:
        return self.canary / "dir"


def fingerprint(top: Path, leave_out: tuple[Path, ...] = ()) -> dict[str, tuple[object, ...]]:
    """Every entry under `top` (links not followed): type, mode, owner, size, mtime and content."""
    seen: dict[str, tuple[object, ...]] = {}
    for folder, dirs, files in os.walk(top, followlinks=False):
        dirs[:] = [d for d in dirs if Path(folder, d) not in leave_out]
        for name in [*dirs, *files]:
            path = Path(folder, name)
            if path in leave_out:
                continue
            info = os.lstat(path)
            content: object = None
            if stat.S_ISREG(info.st_mode):
                content = path.read_bytes()
            elif stat.S_ISLNK(info.st_mode):
                content = os.readlink(path)
            seen[str(path.relative_to(top))] = (
                info.st_mode,
                info.st_uid,
                info.st_gid,
                info.st_size,
                info.st_mtime_ns,
                content,
            )
    return seen


def holds_canary_bytes(top: Path) -> list[str]:
    """The regular files under `top` that hold the canary's marker (links are not followed)."""
    found = []
    for folder, _dirs, files in os.walk(top, followlinks=False):
        for name in files:
            path = Path(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode) and MARKER in path.read_bytes():
                found.append(str(path))
    return found


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    canary = tmp_path / "canary"
    (canary / "dir").mkdir(parents=True)
    (canary / "secret").write_bytes(CANARY_BYTES)
    os.chmod(canary / "secret", 0o640)
    (canary / "dir" / "inner").write_bytes(CANARY_BYTES)
    (canary / "dir" / "manifest.json").write_bytes(CANARY_BYTES)
    (canary / "dir" / "snapshot").mkdir()
    (canary / "dir" / "snapshot" / "manifest.json").write_bytes(CANARY_BYTES)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("the user's own file")
    store = SnapshotStore(tmp_path / "srv" / "snapshots", limit_bytes=64 * MIB, keep=50, retention_s=3600)
    store.open()
    restored = tmp_path / "restored"
    restored.mkdir()
    arena = Arena(tmp_path, canary, workspace, store, restored)
    outside = (workspace, store.root, restored)
    before = fingerprint(tmp_path, leave_out=outside)
    yield arena
    assert fingerprint(tmp_path, leave_out=outside) == before, "something outside the store and workspaces changed"
    assert (canary / "secret").read_bytes() == CANARY_BYTES


def plant_state(workspace: Path) -> None:
    state = workspace / ".coderunner" / "snapshot"
    state.mkdir(parents=True, exist_ok=True)
    (state / "manifest.json").write_text("{}")


def meta_for(snapshot_id: str, report: CopyReport, state_bytes: int) -> SnapshotMeta:
    return SnapshotMeta(
        snapshot_id=snapshot_id,
        client="mallory",
        name="",
        created=time.time(),
        kind="snapshot",
        source_session="abcd1234",
        backend="bwrap",
        options={},
        workspace_bytes=report.bytes,
        state_bytes=state_bytes,
        state_report={},
    )


def snapshot_and_restore(arena: Arena) -> tuple[CopyReport, Path]:
    """A whole snapshot of the workspace, then a restore into a fresh folder owned by OWNER."""
    draft = arena.store.draft("mallory")
    try:
        with hostfs.dir_fd(arena.workspace) as fd:
            state_bytes = draft.take_state(fd, STATE_REL)
            report = draft.copy_workspace(fd, exclude=STATE_REL)
        meta = draft.commit(meta_for(arena.store.new_id(), report, state_bytes))
    except BaseException:
        draft.discard()
        raise
    fresh = arena.restored / meta.snapshot_id
    fresh.mkdir()
    with hostfs.dir_fd(fresh) as fd:
        arena.store.restore_workspace("mallory", meta.snapshot_id, fd, OWNER)
        arena.store.stage_state("mallory", meta.snapshot_id, fd, ".staged", OWNER)
    return report, fresh


def in_thread(work: Callable[[], object], timeout: float = 120) -> object:
    """Run `work` in a thread: a hang (a FIFO opened blocking) fails the test instead of holding it."""
    result: list[object] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the copy hung"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def test_links_out_of_the_workspace_stay_links_and_a_restore_never_goes_through_them(arena: Arena) -> None:
    ws = arena.workspace
    os.symlink(arena.canary_file, ws / "out-file")
    os.symlink(arena.canary_dir, ws / "out-dir")
    os.symlink("../canary/secret", ws / "rel-out")
    (ws / "sub").mkdir()
    os.symlink(arena.canary_dir, ws / "sub" / "deeper")
    plant_state(ws)
    report, fresh = snapshot_and_restore(arena)
    assert report.links == 4 and report.files == 1
    assert holds_canary_bytes(arena.store.root) == [] and holds_canary_bytes(fresh) == []
    assert os.readlink(fresh / "out-dir") == str(arena.canary_dir)
    for name in ["out-file", "out-dir", "rel-out", "sub/deeper"]:
        info = os.lstat(fresh / name)
        assert stat.S_ISLNK(info.st_mode) and (info.st_uid, info.st_gid) == OWNER
    # The canary's owner and mode are checked by the arena: the restore's chown never followed a link.


def test_a_hardlinked_canary_is_copied_as_a_file_of_its_own(arena: Arena) -> None:
    os.link(arena.canary_file, arena.workspace / "hard")
    plant_state(arena.workspace)
    report, fresh = snapshot_and_restore(arena)
    assert report.files == 2
    restored = fresh / "hard"
    assert restored.read_bytes() == CANARY_BYTES, "the test itself linked it in: its bytes are the file's"
    assert os.stat(restored).st_ino != os.stat(arena.canary_file).st_ino
    assert (os.stat(restored).st_uid, os.stat(restored).st_gid) == OWNER
    restored.write_bytes(b"the restored session writes here")
    os.chmod(restored, 0o777)
    # The arena checks the canary (and its mode and owner) is unchanged.


def test_fifos_sockets_and_devices_are_named_and_left_out_without_hanging(arena: Arena) -> None:
    ws = arena.workspace
    os.mkfifo(ws / "pipe")
    (ws / "sub").mkdir()
    os.mkfifo(ws / "sub" / "pipe2")
    os.mknod(ws / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    listener = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(ws)  # a short path for bind()
    try:
        listener.bind("sock")
    finally:
        os.chdir(cwd)
    plant_state(ws)
    try:
        report, _fresh = in_thread(lambda: snapshot_and_restore(arena))  # type: ignore[misc]
    finally:
        listener.close()
    assert sorted(report.skipped) == [
        "null: a device, left out",
        "pipe: a fifo, left out",
        "sock: a socket, left out",
        "sub/pipe2: a fifo, left out",
    ]


def test_a_fifo_in_the_state_folder_is_refused_without_hanging(arena: Arena) -> None:
    plant_state(arena.workspace)
    os.mkfifo(arena.workspace / ".coderunner" / "snapshot" / "v-0001.pkl")
    draft = arena.store.draft("mallory")
    with hostfs.dir_fd(arena.workspace) as fd, pytest.raises(SnapshotError, match="tampered"):
        in_thread(lambda: draft.take_state(fd, STATE_REL))
    draft.discard()
    assert not (arena.workspace / ".coderunner" / "snapshot").exists()


@pytest.mark.parametrize("link_at", [".coderunner/snapshot", ".coderunner"])
def test_a_state_folder_that_is_a_link_is_refused_and_never_followed(arena: Arena, link_at: str) -> None:
    """`.coderunner/snapshot` -> canary/dir, or `.coderunner` -> canary/dir (which holds a snapshot/)."""
    (arena.workspace / ".coderunner").mkdir()
    if link_at == ".coderunner":
        os.rmdir(arena.workspace / ".coderunner")
    os.symlink(arena.canary_dir, arena.workspace / link_at)
    draft = arena.store.draft("mallory")
    with hostfs.dir_fd(arena.workspace) as fd, pytest.raises(SnapshotError, match="tampered"):
        draft.take_state(fd, STATE_REL)
    draft.discard()
    assert holds_canary_bytes(arena.store.root) == []
    if link_at == ".coderunner/snapshot":
        assert not os.path.lexists(arena.workspace / link_at), "the planted link is removed (only the link)"
    # canary/dir/snapshot (reachable through the planted .coderunner) is untouched: the arena checks.


def test_a_state_file_linked_to_the_canary_is_refused(arena: Arena) -> None:
    plant_state(arena.workspace)
    os.symlink(arena.canary_file, arena.workspace / ".coderunner" / "snapshot" / "v-0001.pkl")
    draft = arena.store.draft("mallory")
    with hostfs.dir_fd(arena.workspace) as fd, pytest.raises(SnapshotError, match="tampered"):
        draft.take_state(fd, STATE_REL)
    draft.discard()
    assert holds_canary_bytes(arena.store.root) == []
    assert not os.path.lexists(arena.workspace / ".coderunner" / "snapshot")
    assert os.listdir(arena.store.root / "mallory") == []


def test_entries_swapped_for_links_mid_copy_never_bring_the_canary_in(arena: Arena) -> None:
    """A racer flips `f` between a file and a link to the canary, and `d` between a folder and a link
    to the canary folder, while the host copies the workspace again and again."""
    ws = arena.workspace
    (ws / "d").mkdir()
    (ws / "d" / "x").write_text("benign")
    (ws / "f").write_text("benign")
    stop = threading.Event()
    flips = [0]

    def racer() -> None:
        fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
        try:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    os.symlink(arena.canary_file, "tmp-l", dir_fd=fd)
                    os.rename("tmp-l", "f", src_dir_fd=fd, dst_dir_fd=fd)
                    with open(os.open("tmp-r", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=fd), "w") as out:
                        out.write("benign")
                    os.rename("tmp-r", "f", src_dir_fd=fd, dst_dir_fd=fd)
                    os.rename("d", "d-aside", src_dir_fd=fd, dst_dir_fd=fd)
                    os.symlink(arena.canary_dir, "d", dir_fd=fd)
                    os.unlink("d", dir_fd=fd)
                    os.rename("d-aside", "d", src_dir_fd=fd, dst_dir_fd=fd)
                    flips[0] += 1
        finally:
            os.close(fd)

    thread = threading.Thread(target=racer, daemon=True)
    thread.start()
    links = files = rounds = 0
    deadline = time.monotonic() + 4
    try:
        while time.monotonic() < deadline or rounds < 20:
            draft: Draft = arena.store.draft("mallory")
            try:
                with hostfs.dir_fd(ws) as fd:
                    report = draft.copy_workspace(fd)
                links += report.links
                files += report.files
                assert holds_canary_bytes(arena.store.root) == []
            finally:
                draft.discard()
            rounds += 1
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    assert flips[0] > 0 and links > 0 and files > rounds, "the race was real: both shapes were seen"
    assert os.listdir(arena.store.root / "mallory") == []


def test_a_tree_deeper_than_the_bound_is_cut_and_named(arena: Arena) -> None:
    fd = os.open(arena.workspace, os.O_RDONLY)
    for _ in range(3 * MAX_DEPTH):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.symlink(arena.canary_dir, "link", dir_fd=child)
        os.close(fd)
        fd = child
    os.close(fd)
    plant_state(arena.workspace)
    report, fresh = snapshot_and_restore(arena)
    assert report.folders == MAX_DEPTH + 1  # the 64 levels of d, and .coderunner
    assert report.links == MAX_DEPTH
    assert len(report.skipped) == 1 and f"more than {MAX_DEPTH} levels deep" in report.skipped[0]
    assert holds_canary_bytes(arena.store.root) == []
    # Clean up the deep trees by fd (a path this long cannot be used whole).
    for top in (arena.workspace, fresh):
        with hostfs.dir_fd(top) as parent:
            assert hostfs.remove_tree(parent, "d") == []


def test_a_sparse_ten_gib_file_past_a_one_mib_cap_is_refused_fast(arena: Arena) -> None:
    small = SnapshotStore(arena.store.root, limit_bytes=MIB, keep=5, retention_s=3600)
    with open(arena.workspace / "sparse", "wb") as out:
        out.truncate(10 << 30)
    draft = small.draft("mallory")
    with hostfs.dir_fd(arena.workspace) as fd, pytest.raises(SnapshotTooLarge) as caught:
        in_thread(lambda: draft.copy_workspace(fd), timeout=60)
    draft.discard()
    assert "the cap is 1 MiB" in str(caught.value) and "snapshot_limit_mb" in str(caught.value)
    assert os.listdir(arena.store.root / "mallory") == []
