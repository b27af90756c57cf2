"""What a snapshot's workspace copy costs where the file system has reflinks: XFS (reflink=1) against
ext4, in one run, lanes interleaved.

    sudo .venv/bin/python bench/snapshot_reflink.py [--runs 3] [--mb 500]

Two sparse images side by side in one temporary folder (BENCH_DIR, default /var/tmp), one made
XFS with reflink=1 and one ext4, both loop-mounted, so both lanes go through the same loop layer
to the same disk. On each, a workspace holding one file of --mb MB and a snapshot store. Each round,
for each file system in turn (the order flips every round): copy_workspace into a draft (the
snapshot), then restore_workspace into a fresh folder with a sandbox owner (the restore). Each lane
is timed twice: the call alone, and the call plus the writeback it causes (os.sync), since a copy's
bytes are not on disk until then. Space
is the file system's used blocks after writeback, before against after. Everything is written back
before each lane, untimed; snapshots and restored folders are removed between rounds. All is
unmounted and removed at the end, even on failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from coderunner.hostfs import dirfd as hostfs
from coderunner.snapshots.store import SnapshotMeta, SnapshotStore

MB = 1_000_000
MIB = 1 << 20
SANDBOX = (999, 995)
T = TypeVar("T")


@dataclass
class Lane:
    """One measured step on one file system: seconds (call alone, call plus writeback) and bytes used."""

    call: list[float] = field(default_factory=list)
    with_sync: list[float] = field(default_factory=list)
    used: list[int] = field(default_factory=list)


def used_bytes(mount: Path) -> int:
    info = os.statvfs(mount)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def measured(lane: Lane, mount: Path, action: Callable[..., T], *args: object) -> T:
    os.sync()  # the previous lane's writeback is not charged to this one
    before = used_bytes(mount)
    began = time.perf_counter()
    result = action(*args)
    called = time.perf_counter()
    os.sync()
    synced = time.perf_counter()
    lane.call.append(called - began)
    lane.with_sync.append(synced - began)
    lane.used.append(used_bytes(mount) - before)
    return result


def make_fs(root: Path, name: str, mkfs: list[str], image_bytes: int) -> Path:
    image = root / f"{name}.img"
    mount = root / name
    mount.mkdir()
    with open(image, "wb") as out:
        out.truncate(image_bytes)
    subprocess.run([*mkfs, str(image)], check=True, timeout=300, stdout=subprocess.DEVNULL)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True, timeout=60)
    return mount


def unmount(mount: Path) -> None:
    for _ in range(20):
        if subprocess.run(["umount", str(mount)], timeout=60, stderr=subprocess.DEVNULL).returncode == 0:
            return
        time.sleep(0.25)
    subprocess.run(["umount", "-l", str(mount)], timeout=60)


def make_file(path: Path, size: int) -> None:
    block = bytearray(os.urandom(MIB))
    with open(path, "wb") as out:
        left = size
        index = 0
        while left > 0:
            block[:8] = index.to_bytes(8, "little")  # no two MiB alike
            out.write(block[: min(left, MIB)])
            left -= MIB
            index += 1


def snapshot_once(store: SnapshotStore, workspace: Path) -> str:
    draft = store.draft("bench")
    with hostfs.dir_fd(workspace) as fd:
        draft.copy_workspace(fd)
    meta = SnapshotMeta(store.new_id(), "bench", "", time.time(), "snapshot", "bench", "bwrap", {}, 0, 0, {})
    draft.commit(meta)
    return meta.snapshot_id


def restore_once(store: SnapshotStore, snapshot_id: str, target: Path) -> None:
    target.mkdir()
    with hostfs.dir_fd(target) as fd:
        store.restore_workspace("bench", snapshot_id, fd, SANDBOX)


def main(runs: int, megabytes: int) -> None:
    if os.getuid() != 0:
        raise SystemExit("making and loop-mounting file systems needs root: run this as root")
    if shutil.which("mkfs.xfs") is None:
        raise SystemExit("mkfs.xfs is missing: install the xfsprogs package")
    size = megabytes * MB
    image_bytes = max(4 * size, 1 << 30)  # the file, its copy and restore without reflinks, and metadata
    root = Path(tempfile.mkdtemp(prefix="crreflink-", dir=os.environ.get("BENCH_DIR", "/var/tmp")))
    mounts: list[Path] = []
    try:
        systems = {
            "xfs reflink=1": ["mkfs.xfs", "-q", "-m", "reflink=1"],
            "ext4": ["mkfs.ext4", "-q", "-F"],
        }
        stores: dict[str, tuple[Path, SnapshotStore]] = {}
        for label, mkfs in systems.items():
            mount = make_fs(root, label.split()[0], mkfs, image_bytes)
            mounts.append(mount)
            (mount / "workspace").mkdir()
            make_file(mount / "workspace" / "data.bin", size)
            store = SnapshotStore(mount / "snapshots", limit_bytes=size + 64 * MIB, keep=1000, retention_s=86400)
            store.open()
            stores[label] = (mount, store)
        lanes = {(label, step): Lane() for label in systems for step in ("snapshot", "restore")}
        for run in range(runs):
            order = list(stores.items())
            for label, (mount, store) in order if run % 2 == 0 else reversed(order):  # neither always first
                snapshot_id = measured(lanes[label, "snapshot"], mount, snapshot_once, store, mount / "workspace")
                target = mount / "restored"
                measured(lanes[label, "restore"], mount, restore_once, store, snapshot_id, target)
                shutil.rmtree(target)
                store.delete("bench", snapshot_id)
        print(f"kernel {os.uname().release}; one {megabytes} MB file; {runs} runs, median (each run)")
        for (label, step), lane in lanes.items():
            call = statistics.median(lane.call) * 1000
            synced = statistics.median(lane.with_sync) * 1000
            used = statistics.median(lane.used) / MB
            runs_shown = ", ".join(f"{sample * 1000:.0f}" for sample in lane.with_sync)
            print(
                f"  {label:14} {step:8} call {call:8.1f} ms   with writeback {synced:8.1f} ms "
                f"({runs_shown})   space used {used:7.1f} MB"
            )
    finally:
        for mount in mounts:
            unmount(mount)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mb", type=int, default=500)
    args = parser.parse_args()
    main(args.runs, args.mb)
