"""A snapshot's workspace copy is a reflink where the file system has them (issue 19): on a loop-mounted
XFS made with reflink=1, Draft.copy_workspace and restore_workspace give byte-identical files that
share the source's extents (FIEMAP says so, block for block, and free space barely moves), while the
size cap still counts every byte. A control lane copies byte by byte (sendfile) on the same file
system and must show no sharing, so the extent check itself is proven able to fail."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs import tree_copy
from coderunner.snapshots.store import SnapshotMeta, SnapshotStore, SnapshotTooLarge

MIB = 1 << 20
BIG = 256 * MIB
#: The image: room for the file, a control copy made byte by byte, and XFS's own log and metadata.
IMAGE_BYTES = 1024 * MIB
OWNER = (23456, 23457)

#: FS_IOC_FIEMAP = _IOWR('f', 11, struct fiemap); the header is 32 bytes, each extent 56.
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_SHARED = 0x2000
FIEMAP_HEADER = struct.Struct("=QQLLLL")
FIEMAP_EXTENT = struct.Struct("=QQQQQLLLL")
EXTENTS_PER_CALL = 256

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="making and loop-mounting a file system needs root")


@dataclass(frozen=True)
class Extent:
    logical: int
    physical: int
    length: int
    flags: int


def extents(path: Path) -> list[Extent]:
    """The file's extents as the kernel maps them (FIEMAP, data written back first)."""
    found: list[Extent] = []
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        start = 0
        while True:
            request = bytearray(FIEMAP_HEADER.size + EXTENTS_PER_CALL * FIEMAP_EXTENT.size)
            FIEMAP_HEADER.pack_into(request, 0, start, (1 << 64) - 1 - start, FIEMAP_FLAG_SYNC, 0, EXTENTS_PER_CALL, 0)
            fcntl.ioctl(fd, FS_IOC_FIEMAP, request)
            mapped = FIEMAP_HEADER.unpack_from(request, 0)[3]
            if mapped == 0:
                return found
            for index in range(mapped):
                logical, physical, length, _, _, flags, _, _, _ = FIEMAP_EXTENT.unpack_from(
                    request, FIEMAP_HEADER.size + index * FIEMAP_EXTENT.size
                )
                found.append(Extent(logical, physical, length, flags))
            last = found[-1]
            if last.flags & FIEMAP_EXTENT_LAST:
                return found
            start = last.logical + last.length
    finally:
        os.close(fd)


def physical_map(path: Path) -> dict[int, int]:
    """logical offset -> physical offset of each 4 KiB block, to compare two files block for block."""
    blocks: dict[int, int] = {}
    for extent in extents(path):
        for step in range(0, extent.length, 4096):
            blocks[extent.logical + step] = extent.physical + step
    return blocks


def shared_bytes(path: Path) -> int:
    return sum(extent.length for extent in extents(path) if extent.flags & FIEMAP_EXTENT_SHARED)


def assert_clone_of(copy: Path, original: Path) -> None:
    """`copy` holds `original`'s bytes in `original`'s very blocks, marked shared: a reflink, not a copy."""
    size = original.stat().st_size
    assert copy.stat().st_size == size
    assert shared_bytes(copy) >= size, f"{copy.name}: only {shared_bytes(copy)} of {size} bytes share extents"
    assert physical_map(copy) == physical_map(original), f"{copy.name} lies in other blocks than {original.name}"


def digest(path: Path) -> str:
    hashed = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(4 * MIB):
            hashed.update(chunk)
    return hashed.hexdigest()


def used_bytes(mount: Path) -> int:
    os.sync()
    info = os.statvfs(mount)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def fill(path: Path, size: int) -> None:
    block = os.urandom(MIB)
    with open(path, "wb") as out:
        for index in range(size // MIB):
            out.write(index.to_bytes(8, "little") + block[8:])  # no two MiB alike: nothing to dedupe


@pytest.fixture
def reflink_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh XFS with reflink=1 in a sparse image, loop-mounted; unmounted and removed even on failure."""
    mkfs = shutil.which("mkfs.xfs")
    assert mkfs is not None, "mkfs.xfs is missing: install the xfsprogs package (install.sh lists it)"
    image = tmp_path / "reflink.img"
    mount = tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as out:
        out.truncate(IMAGE_BYTES)
    subprocess.run([mkfs, "-q", "-m", "reflink=1", str(image)], check=True, timeout=120)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True, timeout=60)
    try:
        yield mount
    finally:
        unmount(mount)
        image.unlink()


def unmount(mount: Path) -> None:
    """Unmount (retrying a busy mount briefly, then lazily) so the loop device is freed either way."""
    for _ in range(20):
        if subprocess.run(["umount", str(mount)], timeout=60).returncode == 0:
            return
        time.sleep(0.25)
    subprocess.run(["umount", "-l", str(mount)], check=True, timeout=60)


def snapshot(store: SnapshotStore, workspace: Path) -> tuple[str, tree_copy.CopyReport, int]:
    """copy_workspace into a draft and commit it: (snapshot id, the copy's report, bytes charged)."""
    draft = store.draft("alice")
    try:
        with hostfs.dir_fd(workspace) as fd:
            report = draft.copy_workspace(fd)
        taken = draft.bytes_taken
        meta = SnapshotMeta(store.new_id(), "alice", "", time.time(), "snapshot", "abcd1234", "bwrap", {}, taken, 0, {})
        draft.commit(meta)
    except BaseException:
        draft.discard()
        raise
    return meta.snapshot_id, report, taken


def test_snapshot_and_restore_share_extents_on_a_reflink_file_system(reflink_fs: Path) -> None:
    workspace = reflink_fs / "workspace"
    workspace.mkdir()
    (workspace / "sub").mkdir()
    original = workspace / "sub" / "data.bin"
    fill(original, BIG)
    (workspace / "note.txt").write_text("small file\n")
    want = digest(original)
    store = SnapshotStore(reflink_fs / "snapshots", limit_bytes=BIG + 16 * MIB, keep=20, retention_s=86400.0)
    store.open()

    before = used_bytes(reflink_fs)
    snapshot_id, report, taken = snapshot(store, workspace)
    snapshot_used = used_bytes(reflink_fs) - before
    stored = store.root / "alice" / snapshot_id / "workspace" / "sub" / "data.bin"

    # The cap counts a cloned file at its full size, exactly as a copied one.
    assert report.files == 2
    assert report.bytes == taken == BIG + len("small file\n")
    assert digest(stored) == want
    assert_clone_of(stored, original)
    assert snapshot_used < BIG // 10, f"the snapshot took {snapshot_used} bytes of space for a {BIG}-byte file"

    restored_ws = reflink_fs / "restored"
    restored_ws.mkdir()
    before = used_bytes(reflink_fs)
    with hostfs.dir_fd(restored_ws) as fd:
        restored_report = store.restore_workspace("alice", snapshot_id, fd, OWNER, limit_bytes=BIG + MIB)
    restore_used = used_bytes(reflink_fs) - before
    restored = restored_ws / "sub" / "data.bin"

    assert restored_report.bytes == BIG + len("small file\n")
    assert (restored.stat().st_uid, restored.stat().st_gid) == OWNER
    assert digest(restored) == want
    assert_clone_of(restored, original)
    assert restore_used < BIG // 10, f"the restore took {restore_used} bytes of space for a {BIG}-byte file"

    # Shared blocks are copy-on-write: the agent writing its workspace after the snapshot leaves the
    # snapshot and the restored copy as they were.
    with open(original, "r+b") as out:
        out.write(b"\xff" * MIB)
    assert digest(stored) == want
    assert digest(restored) == want
    assert digest(original) != want


def test_a_cloned_workspace_still_counts_against_the_snapshot_cap(reflink_fs: Path) -> None:
    workspace = reflink_fs / "workspace"
    workspace.mkdir()
    fill(workspace / "a.bin", 12 * MIB)
    fill(workspace / "b.bin", 12 * MIB)
    store = SnapshotStore(reflink_fs / "snapshots", limit_bytes=16 * MIB, keep=20, retention_s=86400.0)
    store.open()
    # a.bin is cloned and charged its 12 MiB, so b.bin no longer fits: a clone is not free of the cap.
    with pytest.raises(SnapshotTooLarge, match=r"24\.0 MiB so far, the cap is 16 MiB"):
        snapshot(store, workspace)
    assert [name for name in os.listdir(store.root / "alice") if not name.startswith(".")] == []


def test_the_extent_check_fails_for_a_byte_copy(reflink_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same snapshot with copy_file_range refused (as on a pair it cannot serve), so
    tree_copy falls back to sendfile (a byte copy in the kernel, never a clone). The bytes match, and
    the checks above must say it is no clone."""
    workspace = reflink_fs / "workspace"
    workspace.mkdir()
    original = workspace / "data.bin"
    fill(original, 32 * MIB)
    store = SnapshotStore(reflink_fs / "snapshots", limit_bytes=64 * MIB, keep=20, retention_s=86400.0)
    store.open()

    def refused(*_: object) -> int:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(tree_copy.os, "copy_file_range", refused)
    before = used_bytes(reflink_fs)
    snapshot_id, _, taken = snapshot(store, workspace)
    used = used_bytes(reflink_fs) - before
    stored = store.root / "alice" / snapshot_id / "workspace" / "data.bin"

    assert taken == 32 * MIB
    assert digest(stored) == digest(original)
    assert shared_bytes(stored) == 0
    assert physical_map(stored).keys() == physical_map(original).keys()
    assert not set(physical_map(stored).values()) & set(physical_map(original).values())
    assert used >= 32 * MIB
    with pytest.raises(AssertionError):
        assert_clone_of(stored, original)
