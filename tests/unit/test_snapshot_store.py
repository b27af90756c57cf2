"""The snapshot store with real files: what a snapshot keeps, what it leaves out and says, its cap,
its retention, and what a restore gives back (modes, links, owner)."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs import tree_copy
from coderunner.snapshots import store as snapshot_store
from coderunner.snapshots.store import (
    SNAPSHOT_ID,
    SnapshotError,
    SnapshotMeta,
    SnapshotNotFound,
    SnapshotStore,
    SnapshotTooLarge,
)

MIB = 1 << 20
STATE_REL = ".coderunner/snapshot"
OWNER = (23456, 23457)


def make_store(
    tmp_path: Path, limit_bytes: int = 64 * MIB, keep: int = 20, retention_s: float = 86400.0
) -> SnapshotStore:
    store = SnapshotStore(tmp_path / "state" / "snapshots", limit_bytes=limit_bytes, keep=keep, retention_s=retention_s)
    store.open()
    return store


def meta_for(
    snapshot_id: str, client: str = "alice", kind: str = "snapshot", created: float | None = None
) -> SnapshotMeta:
    return SnapshotMeta(
        snapshot_id=snapshot_id,
        client=client,
        name="label",
        created=time.time() if created is None else created,
        kind=kind,
        source_session="abcd1234",
        backend="bwrap",
        options={"network": "none"},
        workspace_bytes=0,
        state_bytes=0,
        state_report={"saved": ["x"]},
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A workspace as a kernel leaves it: files, folders, links, a hardlink, a fifo and a saved state."""
    root = tmp_path / "ws"
    (root / "data" / "deep").mkdir(parents=True)
    (root / "data" / "table.csv").write_text("a,b\n1,2\n")
    (root / "data" / "deep" / "blob.bin").write_bytes(os.urandom(300_000))
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", 0o755 | stat.S_ISUID)
    (root / "secret.txt").write_text("mine")
    os.chmod(root / "secret.txt", 0o600)
    os.chmod(root / "data" / "deep", 0o750)
    os.symlink("data/table.csv", root / "rel-link")
    os.symlink("/nonexistent/elsewhere", root / "abs-link")
    os.link(root / "secret.txt", root / "hard.txt")
    os.mkfifo(root / "pipe")
    state = root / ".coderunner" / "snapshot"
    state.mkdir(parents=True)
    (state / "manifest.json").write_text('{"saved": ["x"]}')
    (state / "v-0001.pkl").write_bytes(b"\x80\x05pickled")
    return root


@pytest.fixture
def ws_fd(workspace: Path) -> Iterator[int]:
    with hostfs.dir_fd(workspace) as fd:
        yield fd


def snapshot(store: SnapshotStore, ws_fd: int, snapshot_id: str | None = None, client: str = "alice") -> SnapshotMeta:
    draft = store.draft(client)
    try:
        state_bytes = draft.take_state(ws_fd, STATE_REL)
        report = draft.copy_workspace(ws_fd, exclude=STATE_REL)
        meta = meta_for(snapshot_id or store.new_id(), client)
        meta.state_bytes, meta.workspace_bytes = state_bytes, report.bytes
        return draft.commit(meta)
    except BaseException:
        draft.discard()
        raise


def client_dir(store: SnapshotStore, client: str = "alice") -> Path:
    return store.root / client


def test_snapshot_then_restore_keeps_files_links_modes_and_says_what_it_left_out(
    tmp_path: Path, workspace: Path, ws_fd: int
) -> None:
    store = make_store(tmp_path)
    draft = store.draft("alice")
    state_bytes = draft.take_state(ws_fd, STATE_REL)
    report = draft.copy_workspace(ws_fd, exclude=STATE_REL)
    assert state_bytes == len('{"saved": ["x"]}') + len(b"\x80\x05pickled")
    assert not (workspace / ".coderunner" / "snapshot").exists(), "the state folder is moved out of the workspace"
    assert report.links == 2 and report.files == 5  # table, blob, run.sh, secret, hard (a copy of its own)
    assert report.bytes == 8 + 300_000 + 18 + 4 + 4
    assert report.skipped == ["pipe: a fifo, left out"]
    meta = meta_for(store.new_id())
    meta.workspace_bytes, meta.state_bytes = report.bytes, state_bytes
    draft.commit(meta)
    assert store.get("alice", meta.snapshot_id) == meta
    assert [m.snapshot_id for m in store.list("alice")] == [meta.snapshot_id]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with hostfs.dir_fd(fresh) as fd:
        back = store.restore_workspace("alice", meta.snapshot_id, fd, OWNER)
    assert (back.files, back.links, back.bytes) == (5, 2, report.bytes)
    assert (fresh / "data" / "deep" / "blob.bin").read_bytes() == (
        workspace / "data" / "deep" / "blob.bin"
    ).read_bytes()
    assert os.readlink(fresh / "rel-link") == "data/table.csv"
    assert os.readlink(fresh / "abs-link") == "/nonexistent/elsewhere"
    assert (fresh / "rel-link").read_text() == "a,b\n1,2\n"
    assert stat.S_IMODE(os.stat(fresh / "run.sh").st_mode) == 0o755, "modes kept, setuid dropped"
    assert stat.S_IMODE(os.stat(fresh / "secret.txt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(fresh / "data" / "deep").st_mode) == 0o750
    assert os.stat(fresh / "hard.txt").st_ino != os.stat(fresh / "secret.txt").st_ino
    assert os.stat(fresh / "run.sh").st_mtime_ns == os.stat(workspace / "run.sh").st_mtime_ns
    assert not (fresh / "pipe").exists() and not (fresh / ".coderunner" / "snapshot").exists()
    for path in [fresh / "data", fresh / "data" / "deep", fresh / "run.sh", fresh / "rel-link", fresh / "abs-link"]:
        info = os.lstat(path)
        assert (info.st_uid, info.st_gid) == OWNER, path


def test_restore_without_owner_leaves_entries_to_the_server(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    meta = snapshot(store, ws_fd)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with hostfs.dir_fd(fresh) as fd:
        store.restore_workspace("alice", meta.snapshot_id, fd, None)
    assert os.lstat(fresh / "rel-link").st_uid == os.geteuid()
    assert os.stat(fresh / "data" / "table.csv").st_uid == os.geteuid()


def test_the_store_is_host_only(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    meta = snapshot(store, ws_fd)
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(client_dir(store)).st_mode) == 0o700
    top = client_dir(store) / meta.snapshot_id
    assert stat.S_IMODE(os.stat(top / "meta.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(top / "state").st_mode) == 0o700
    assert json.loads((top / "meta.json").read_text())["snapshot_id"] == meta.snapshot_id
    assert sorted(os.listdir(top / "state")) == ["manifest.json", "v-0001.pkl"]


def test_stage_state_gives_the_sandbox_read_only_links(tmp_path: Path, ws_fd: int) -> None:
    """On one file system the staged files are links to the store's own, read-only for all: no copy."""
    store = make_store(tmp_path)
    meta = snapshot(store, ws_fd)
    host = tmp_path / "host"
    host.mkdir()
    with hostfs.dir_fd(host) as fd:
        assert store.stage_state("alice", meta.snapshot_id, fd, "restore", OWNER) == meta.state_bytes
        # Staged again (a retried start): replaced, not refused.
        assert store.stage_state("alice", meta.snapshot_id, fd, "restore", None) == meta.state_bytes
        store.stage_state("alice", meta.snapshot_id, fd, "owned", OWNER)
    staged = host / "owned"
    assert stat.S_IMODE(os.stat(staged).st_mode) == 0o500
    assert (os.stat(staged).st_uid, os.stat(staged).st_gid) == OWNER
    stored = client_dir(store) / meta.snapshot_id / "state"
    for name in ("manifest.json", "v-0001.pkl"):
        info = os.stat(staged / name)
        assert stat.S_IMODE(info.st_mode) == 0o444 and info.st_uid == os.geteuid()
        assert info.st_ino == os.stat(stored / name).st_ino
    assert (staged / "v-0001.pkl").read_bytes() == b"\x80\x05pickled"
    assert stat.S_IMODE(os.stat(stored).st_mode) == 0o700, "the store's folders keep everyone else out"


def test_stage_state_copies_where_it_cannot_link(tmp_path: Path, ws_fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another file system (EXDEV): copies of the store's files, 0400 and the sandbox's."""
    store = make_store(tmp_path)
    meta = snapshot(store, ws_fd)
    host = tmp_path / "host"
    host.mkdir()

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "link", refuse)
    with hostfs.dir_fd(host) as fd:
        assert store.stage_state("alice", meta.snapshot_id, fd, "owned", OWNER) == meta.state_bytes
        assert store.stage_state("alice", meta.snapshot_id, fd, "restore", None) == meta.state_bytes
    staged = host / "owned"
    assert stat.S_IMODE(os.stat(staged).st_mode) == 0o500
    for name in ("manifest.json", "v-0001.pkl"):
        info = os.stat(staged / name)
        assert stat.S_IMODE(info.st_mode) == 0o400 and (info.st_uid, info.st_gid) == OWNER
        assert info.st_ino != os.stat(client_dir(store) / meta.snapshot_id / "state" / name).st_ino
    assert (staged / "v-0001.pkl").read_bytes() == b"\x80\x05pickled"
    assert os.stat(host / "restore" / "manifest.json").st_uid == os.geteuid()


def test_a_persistent_state_has_no_workspace_and_restores_nothing_there(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    draft = store.draft("alice")
    draft.take_state(ws_fd, STATE_REL)
    draft.commit(meta_for("keep-proj", kind="persistent"))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with hostfs.dir_fd(fresh) as fd:
        assert store.restore_workspace("alice", "keep-proj", fd, None) == snapshot_store.CopyReport()
    assert os.listdir(fresh) == []


def test_committing_an_existing_id_replaces_it_and_leaves_no_draft(tmp_path: Path, workspace: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    first = store.draft("alice")
    first.take_state(ws_fd, STATE_REL)
    first.commit(meta_for("keep-proj", kind="persistent"))
    state = workspace / ".coderunner" / "snapshot"
    state.mkdir()
    (state / "manifest.json").write_text("second")
    second = store.draft("alice")
    second.take_state(ws_fd, STATE_REL)
    second.commit(meta_for("keep-proj", kind="persistent"))
    assert os.listdir(client_dir(store)) == ["keep-proj"]
    assert (client_dir(store) / "keep-proj" / "state" / "manifest.json").read_text() == "second"
    second.discard()  # after a commit: nothing happens
    assert os.listdir(client_dir(store)) == ["keep-proj"]


def test_past_the_cap_the_error_says_the_size_and_what_to_do_and_the_draft_goes(tmp_path: Path) -> None:
    store = make_store(tmp_path, limit_bytes=1 * MIB)
    ws = tmp_path / "big"
    ws.mkdir()
    (ws / "a.bin").write_bytes(b"a" * 700_000)
    (ws / "b.bin").write_bytes(b"b" * 700_000)
    draft = store.draft("alice")
    with hostfs.dir_fd(ws) as fd, pytest.raises(SnapshotTooLarge) as caught:
        draft.copy_workspace(fd)
    text = str(caught.value)
    assert "1.3 MiB so far" in text and "the cap is 1 MiB" in text
    assert "delete files or variables you do not need, or ask the user to raise snapshot_limit_mb" in text
    draft.discard()
    draft.discard()
    assert os.listdir(client_dir(store)) == [] and store.list("alice") == []


def test_state_and_workspace_share_one_cap(tmp_path: Path, workspace: Path, ws_fd: int) -> None:
    (workspace / ".coderunner" / "snapshot" / "v-0002.pkl").write_bytes(b"s" * 600_000)
    (workspace / "w.bin").write_bytes(b"w" * 600_000)
    store = make_store(tmp_path, limit_bytes=1 * MIB)
    draft = store.draft("alice")
    assert draft.take_state(ws_fd, STATE_REL) > 600_000
    with pytest.raises(SnapshotTooLarge):
        draft.copy_workspace(ws_fd)
    draft.discard()


def test_a_file_beyond_the_cap_is_cut_one_byte_past_it() -> None:
    """A file that grows while copied stops at the cap: the copy never takes more than one byte past it."""
    with tempfile.TemporaryFile() as src, tempfile.TemporaryFile() as dst:
        src.write(b"x" * (3 * MIB))
        src.flush()
        src.seek(0)
        assert tree_copy.copy_bytes(src.fileno(), dst.fileno(), MIB) == MIB + 1
        src.seek(0)
        dst.seek(0)
        dst.truncate()
        assert tree_copy.copy_bytes(src.fileno(), dst.fileno(), 10 * MIB) == 3 * MIB


def copy_with(tmp_path: Path, data: bytes) -> bytes:
    """`data` through copy_bytes from one file to another; the copy's bytes."""
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        assert tree_copy.copy_bytes(src, dst, 10 * MIB) == len(data)
    finally:
        os.close(src)
        os.close(dst)
    return (tmp_path / "dst").read_bytes()


def test_a_copy_across_file_systems_goes_through_sendfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_file_range refuses two file systems (EXDEV: a loop-mounted workspace and the store);
    sendfile still copies in the kernel, and the bytes are the file's."""
    refused, sent = [], []
    real_sendfile = os.sendfile

    def refuse(*args: object) -> int:
        refused.append(args)
        raise OSError(errno.EXDEV, "cross-device")

    def sendfile(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        sent.append(count)
        return real_sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "copy_file_range", refuse)
    monkeypatch.setattr(os, "sendfile", sendfile)
    data = os.urandom(3 * MIB + 17)
    assert copy_with(tmp_path, data) == data
    assert len(refused) == 1 and sent, "refused once, then sendfile to the end"


def test_copy_falls_back_to_read_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def refuse(*args: object) -> int:
        calls.append(args)
        raise OSError(errno.EXDEV if len(calls) == 1 else errno.EINVAL, "refused")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    monkeypatch.setattr(os, "sendfile", refuse)
    data = os.urandom(3 * MIB + 17)
    assert copy_with(tmp_path, data) == data
    assert len(calls) == 2, "copy_file_range, then sendfile, each tried once"


def test_take_state_missing_is_a_plain_error(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    (tmp_path / "empty").mkdir()
    draft = store.draft("alice")
    with hostfs.dir_fd(tmp_path / "empty") as fd, pytest.raises(SnapshotError, match="saved no state"):
        draft.take_state(fd, STATE_REL)
    draft.discard()


@pytest.mark.parametrize(
    "plant",
    ["subfolder", "bad-name", "fifo", "link-file"],
)
def test_take_state_refuses_anything_but_plain_files_and_removes_the_folder(
    tmp_path: Path, workspace: Path, ws_fd: int, plant: str
) -> None:
    state = workspace / ".coderunner" / "snapshot"
    if plant == "subfolder":
        (state / "inner").mkdir()
    elif plant == "bad-name":
        (state / "a b.pkl").write_text("x")
    elif plant == "fifo":
        os.mkfifo(state / "v-0002.pkl")
    else:
        os.symlink(workspace / "secret.txt", state / "v-0002.pkl")
    store = make_store(tmp_path)
    draft = store.draft("alice")
    with pytest.raises(SnapshotError, match="tampered"):
        draft.take_state(ws_fd, STATE_REL)
    draft.discard()
    assert not os.path.lexists(state)
    assert (workspace / "secret.txt").read_text() == "mine"
    assert os.listdir(client_dir(store)) == []


def test_list_and_get_leave_out_broken_records(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    good = snapshot(store, ws_fd)
    folder = client_dir(store)
    for snapshot_id, content in [
        ("s-garbledjson", b"{not json"),
        ("s-wrongclient", json.dumps(meta_for("s-wrongclient", client="bob").as_json()).encode()),
        ("s-wrongidxxxx", json.dumps(meta_for("s-otheridxxxx").as_json()).encode()),
        ("s-missingkeys", b'{"snapshot_id": "s-missingkeys"}'),
        ("s-badtypesxxx", json.dumps({**meta_for("s-badtypesxxx").as_json(), "state_bytes": "9"}).encode()),
    ]:
        (folder / snapshot_id).mkdir()
        (folder / snapshot_id / "meta.json").write_bytes(content)
    (folder / "s-nometaxxxxx").mkdir()
    (folder / "s-linkedmetax").mkdir()
    os.symlink(folder / good.snapshot_id / "meta.json", folder / "s-linkedmetax" / "meta.json")
    assert [m.snapshot_id for m in store.list("alice")] == [good.snapshot_id]
    for snapshot_id in ["s-garbledjson", "s-wrongclient", "s-nometaxxxxx", "s-linkedmetax", "../alice", "", "x"]:
        with pytest.raises(SnapshotNotFound):
            store.get("alice", snapshot_id)


def test_another_clients_snapshot_is_not_found(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    meta = snapshot(store, ws_fd)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(SnapshotNotFound) as caught:
        store.get("bob", meta.snapshot_id)
    assert "manage_snapshots (action 'list')" in str(caught.value)
    with hostfs.dir_fd(fresh) as fd:
        with pytest.raises(SnapshotNotFound):
            store.restore_workspace("bob", meta.snapshot_id, fd, None)
        with pytest.raises(SnapshotNotFound):
            store.stage_state("bob", meta.snapshot_id, fd, "restore", None)
    with pytest.raises(SnapshotNotFound):
        store.delete("bob", meta.snapshot_id)
    assert store.list("bob") == [] and store.list("../alice") == []
    assert os.listdir(fresh) == []


def test_delete(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    meta = snapshot(store, ws_fd)
    store.delete("alice", meta.snapshot_id)
    assert store.list("alice") == [] and os.listdir(client_dir(store)) == []
    with pytest.raises(SnapshotNotFound):
        store.delete("alice", meta.snapshot_id)


def commit_empty(store: SnapshotStore, snapshot_id: str, kind: str = "snapshot", created: float | None = None) -> None:
    draft = store.draft("alice")
    draft.commit(meta_for(snapshot_id, kind=kind, created=created))


def test_prune_keeps_the_newest_and_drops_the_expired(tmp_path: Path) -> None:
    store = make_store(tmp_path, keep=2, retention_s=3600)
    now = time.time()
    commit_empty(store, "keep-proj", kind="persistent", created=now - 10)
    commit_empty(store, "keep-stale", kind="persistent", created=now - 7200)
    # A persistent session's own state is not aged: it lives as long as its named workspace.
    assert sorted(m.snapshot_id for m in store.list("alice")) == ["keep-proj", "keep-stale"]
    store.delete("alice", "keep-stale")
    ids = [f"s-{i:012d}" for i in range(4)]
    for age, snapshot_id in zip([50, 40, 30, 20], ids, strict=True):
        commit_empty(store, snapshot_id, created=now - age)
    # The two newest snapshots stay; a persistent state is not counted among them.
    assert [m.snapshot_id for m in store.list("alice")] == ["keep-proj", ids[3], ids[2]]
    store.retention_s = 25
    assert store.prune("alice") == [ids[2]]
    assert sorted(os.listdir(client_dir(store))) == sorted(["keep-proj", ids[3]])


def test_open_removes_drafts_a_dead_server_left_and_prunes(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path, retention_s=3600)
    draft = store.draft("alice")
    draft.take_state(ws_fd, STATE_REL)
    commit_empty(store, "s-oldoldoldold", created=time.time() - 7200)
    commit_empty(store, "s-newnewnewnew")
    os.chmod(store.root, 0o755)
    again = SnapshotStore(store.root, limit_bytes=MIB, keep=20, retention_s=3600)
    again.open()
    assert os.listdir(client_dir(store)) == ["s-newnewnewnew"]
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    draft.discard()  # its folder is gone already: still no error


def test_open_refuses_a_root_that_is_a_link(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "state").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "state" / "snapshots")
    store = SnapshotStore(tmp_path / "state" / "snapshots", limit_bytes=MIB, keep=1, retention_s=1)
    with pytest.raises(OSError):
        store.open()


def test_ids_and_client_names() -> None:
    ids = {SnapshotStore.new_id() for _ in range(100)}
    assert len(ids) == 100 and all(SNAPSHOT_ID.fullmatch(i) and len(i) == 14 for i in ids)


def test_a_bad_client_name_gets_no_folder(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for client in ["../x", ".hidden", "", "a/b"]:
        with pytest.raises(SnapshotError):
            store.draft(client)
    assert os.listdir(store.root) == []


def test_a_commit_must_fit_its_draft(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    draft = store.draft("alice")
    for bad in [meta_for("../x"), meta_for("s-abcdefabcdef", client="bob"), meta_for("s-abcdefabcdef", kind="other")]:
        with pytest.raises(ValueError):
            draft.commit(bad)
    draft.discard()
    assert os.listdir(client_dir(store)) == []


def test_entry_bound_names_what_it_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_copy, "MAX_ENTRIES", 10)
    ws = tmp_path / "many"
    ws.mkdir()
    for i in range(30):
        (ws / f"f{i:02d}").write_text("x")
    store = make_store(tmp_path)
    draft = store.draft("alice")
    with hostfs.dir_fd(ws) as fd:
        report = draft.copy_workspace(fd)
    draft.discard()
    assert report.files == 10
    assert report.skipped == [".: more than 10 entries, the rest left out"]


def test_restore_past_the_sessions_disk_cap_says_so(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    meta = snapshot(store, ws_fd)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with hostfs.dir_fd(fresh) as fd, pytest.raises(SnapshotError) as caught:
        store.restore_workspace("alice", meta.snapshot_id, fd, None, limit_bytes=100_000)
    assert "do not fit this session's disk cap" in str(caught.value)
    assert not isinstance(caught.value, SnapshotTooLarge)


def test_restore_fills_folders_the_host_made_first(tmp_path: Path, ws_fd: int) -> None:
    store = make_store(tmp_path)
    meta = snapshot(store, ws_fd)
    fresh = tmp_path / "fresh"
    (fresh / ".coderunner").mkdir(parents=True)
    (fresh / ".coderunner" / "host-made").write_text("kept")
    (fresh / "secret.txt").write_text("host's")
    with hostfs.dir_fd(fresh) as fd:
        report = store.restore_workspace("alice", meta.snapshot_id, fd, OWNER)
    assert report.skipped == ["secret.txt: already in the workspace, kept as it was"]
    assert (fresh / "secret.txt").read_text() == "host's"
    assert (fresh / ".coderunner" / "host-made").read_text() == "kept"
    assert os.stat(fresh / ".coderunner").st_uid == OWNER[0]
    assert (fresh / "data" / "table.csv").exists()


def test_the_quick_mount_id_agrees_with_hostfs(tmp_path: Path) -> None:
    for path in [tmp_path, Path("/proc"), Path("/")]:
        with hostfs.dir_fd(path) as fd:
            assert tree_copy.fast_mount_id(fd) == hostfs.mount_id(fd)


def test_reported_names_cannot_forge_lines_and_many_are_counted(tmp_path: Path) -> None:
    ws = tmp_path / "odd"
    ws.mkdir()
    os.mkfifo(os.path.join(os.fsencode(ws), b"bad\xff\nname: a fake line"))
    for i in range(tree_copy.MAX_SKIPPED_NAMED + 5):
        os.mkfifo(ws / f"pipe{i:04d}")
    store = make_store(tmp_path)
    draft = store.draft("alice")
    with hostfs.dir_fd(ws) as fd:
        report = draft.copy_workspace(fd)
    draft.discard()
    assert len(report.skipped) == tree_copy.MAX_SKIPPED_NAMED + 1
    assert report.skipped[-1] == "... and 6 more entries left out"
    named = [line for line in report.skipped if line.startswith("bad")]
    assert named == ["bad??name: a fake line: a fifo, left out"]
    assert all("\n" not in line and line.encode() for line in report.skipped)


def plant_damaged(
    store: SnapshotStore, snapshot_id: str, meta: bytes | None, age_s: float, client: str = "alice"
) -> Path:
    """A snapshot folder whose meta.json is `meta` (None: missing), last changed `age_s` ago."""
    folder = client_dir(store, client) / snapshot_id
    folder.mkdir(parents=True)
    (folder / "state").mkdir()
    (folder / "state" / "v-0001.pkl").write_bytes(b"x" * 5000)
    if meta is not None:
        (folder / "meta.json").write_bytes(meta)
    when = time.time() - age_s
    os.utime(folder, (when, when))
    return folder


DAMAGE = {
    "s-oversized000": b"{" + b" " * snapshot_store.MAX_META_BYTES + b"}",
    "s-garbled00000": b"{not json",
    "s-missing00000": None,
    "s-invalid00000": b'{"snapshot_id": "s-invalid00000"}',
    # A record that claims another client: the folder it lies in says whose it is, not the record.
    "s-claimsbob000": json.dumps(meta_for("s-claimsbob000", client="bob").as_json()).encode(),
}


def test_a_damaged_snapshot_is_listed_counted_and_deletable_by_its_owner_only(tmp_path: Path) -> None:
    store = make_store(tmp_path, keep=20, retention_s=3600)
    now = time.time()
    commit_empty(store, "s-good-older00", created=now - 30)
    commit_empty(store, "s-good-newer00", created=now - 20)
    for age, (snapshot_id, meta) in zip([10, 40, 50, 60, 70], DAMAGE.items(), strict=True):
        plant_damaged(store, snapshot_id, meta, age)

    listing = store.listing("alice")
    assert [m.snapshot_id for m in listing.snapshots] == ["s-good-newer00", "s-good-older00"]
    assert [d.snapshot_id for d in listing.damaged] == list(DAMAGE)
    oversized = listing.damaged[0]
    assert "oversized" in oversized.why and oversized.size_bytes > snapshot_store.MAX_META_BYTES
    assert all(d.size_bytes >= 5000 and d.client == "alice" and d.kind == "snapshot" for d in listing.damaged)
    with pytest.raises(SnapshotNotFound, match="damaged"):
        store.get("alice", "s-garbled00000")

    # Another client neither sees nor deletes them, whatever a record claims.
    assert store.listing("bob") == snapshot_store.Listing([], [])
    with pytest.raises(SnapshotNotFound):
        store.delete("bob", "s-claimsbob000")
    assert (client_dir(store) / "s-claimsbob000").is_dir()

    # Counted against keep with the good ones (aged by their folder's mtime): the two newest stay.
    store.keep = 2
    removed = store.prune("alice")
    assert sorted(removed) == sorted(["s-good-older00", *list(DAMAGE)[1:]])
    listing = store.listing("alice")
    assert [m.snapshot_id for m in listing.snapshots] == ["s-good-newer00"]
    assert [d.snapshot_id for d in listing.damaged] == ["s-oversized000"]

    # Its owner deletes it like any other.
    store.delete("alice", "s-oversized000")
    assert sorted(os.listdir(client_dir(store))) == ["s-good-newer00"]
    with pytest.raises(SnapshotNotFound):
        store.delete("alice", "s-oversized000")


def test_a_damaged_snapshot_past_its_retention_is_pruned(tmp_path: Path) -> None:
    store = make_store(tmp_path, keep=20, retention_s=3600)
    plant_damaged(store, "s-garbled00000", b"{not json", 7200)
    plant_damaged(store, "s-missing00000", None, 10)
    assert store.prune("alice") == ["s-garbled00000"]
    assert os.listdir(client_dir(store)) == ["s-missing00000"]


def test_the_next_start_removes_every_damaged_snapshot_and_keeps_the_good(tmp_path: Path) -> None:
    store = make_store(tmp_path, keep=20, retention_s=3600)
    commit_empty(store, "s-good-newer00")
    commit_empty(store, "keep-proj", kind="persistent")
    for snapshot_id, meta in DAMAGE.items():
        plant_damaged(store, snapshot_id, meta, 5)
    plant_damaged(store, "keep-broken", b"[]", 5)  # a persistent state's record too
    plant_damaged(store, "s-ofbob0000000", b"{not json", 5, client="bob")
    again = SnapshotStore(store.root, limit_bytes=MIB, keep=20, retention_s=3600)
    again.open()
    assert sorted(os.listdir(client_dir(store))) == ["keep-proj", "s-good-newer00"]
    assert os.listdir(client_dir(store, "bob")) == []


def test_a_record_past_the_bound_is_never_written(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    draft = store.draft("alice")
    meta = meta_for(store.new_id())
    meta.state_report = {"saved": ["x" * snapshot_store.MAX_META_BYTES]}
    with pytest.raises(SnapshotError, match="nothing was kept"):
        draft.commit(meta)
    draft.discard()
    assert os.listdir(client_dir(store)) == []
