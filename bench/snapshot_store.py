"""What a snapshot's file copy costs on the host: the store against `cp -a` of the same tree.

    sudo .venv/bin/python bench/snapshot_store.py [--runs 3] [--big-mb 500] [--small 20000]

Two workspaces on the same file system as the store: one big file, and many small files in
folders of 100. Each round runs, interleaved: copy_workspace into a draft (the snapshot's copy),
`cp -a` of the workspace (the baseline), restore_workspace into a fresh folder with a sandbox
owner (the restore), `cp -a` of the stored copy (its baseline). Caches stay warm for all lanes
alike; outputs are removed between lanes, and all is written back (sync) before each, untimed.
copy_file_range is a reflink only on file systems that share extents (btrfs, XFS with reflink);
elsewhere it is an in-kernel copy, as cp's. BENCH_DIR picks the file system (default /var/tmp).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from coderunner.hostfs import dirfd as hostfs
from coderunner.snapshots.store import SnapshotMeta, SnapshotStore

SANDBOX = (999, 995)


def make_big(folder: Path, megabytes: int) -> None:
    folder.mkdir()
    chunk = os.urandom(1 << 20)
    with open(folder / "data.bin", "wb") as out:
        for _ in range(megabytes):
            out.write(chunk)


def make_small(folder: Path, count: int) -> None:
    folder.mkdir()
    body = os.urandom(1024)
    for index in range(count):
        sub = folder / f"d{index // 100:04d}"
        if index % 100 == 0:
            sub.mkdir()
        (sub / f"f{index:05d}.txt").write_bytes(body)


def timed(action) -> float:  # type: ignore[no-untyped-def]
    os.sync()  # the previous lane's writeback is not charged to this one
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def snapshot_lane(store: SnapshotStore, workspace: Path) -> tuple[float, str]:
    draft = store.draft("bench")
    with hostfs.dir_fd(workspace) as fd:
        seconds = timed(lambda: draft.copy_workspace(fd))
    meta = SnapshotMeta(store.new_id(), "bench", "", time.time(), "snapshot", "bench", "bwrap", {}, 0, 0, {})
    draft.commit(meta)
    return seconds, meta.snapshot_id


def restore_lane(store: SnapshotStore, snapshot_id: str, target: Path) -> float:
    target.mkdir()
    with hostfs.dir_fd(target) as fd:
        return timed(lambda: store.restore_workspace("bench", snapshot_id, fd, SANDBOX))


def cp_lane(source: Path, target: Path) -> float:
    return timed(lambda: subprocess.run(["cp", "-a", str(source), str(target)], check=True, timeout=600))


def main(runs: int, big_mb: int, small: int) -> None:
    if os.getuid() != 0:
        raise SystemExit("restoring to a sandbox owner needs root: run this as root")
    root = Path(tempfile.mkdtemp(prefix="crsnap-", dir=os.environ.get("BENCH_DIR", "/var/tmp")))
    try:
        store = SnapshotStore(root / "store", limit_bytes=(big_mb + 64) << 20, keep=1000, retention_s=86400)
        store.open()
        workspaces = {f"one {big_mb} MB file": root / "big", f"{small} small files": root / "small"}
        make_big(workspaces[f"one {big_mb} MB file"], big_mb)
        make_small(workspaces[f"{small} small files"], small)
        for label, workspace in workspaces.items():
            times: dict[str, list[float]] = {
                "snapshot copy": [],
                "cp -a (workspace)": [],
                "restore": [],
                "cp -a (stored)": [],
            }
            for _ in range(runs):
                seconds, snapshot_id = snapshot_lane(store, workspace)
                times["snapshot copy"].append(seconds)
                times["cp -a (workspace)"].append(cp_lane(workspace, root / "cp-out"))
                shutil.rmtree(root / "cp-out")
                times["restore"].append(restore_lane(store, snapshot_id, root / "restored"))
                shutil.rmtree(root / "restored")
                times["cp -a (stored)"].append(
                    cp_lane(store.root / "bench" / snapshot_id / "workspace", root / "cp-out")
                )
                shutil.rmtree(root / "cp-out")
                store.delete("bench", snapshot_id)
            print(f"{label} ({runs} runs, median):")
            for name, samples in times.items():
                each = ", ".join(f"{sample * 1000:.0f}" for sample in samples)
                print(f"  {name:20} {statistics.median(samples) * 1000:9.1f} ms   (each run: {each})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--big-mb", type=int, default=500)
    parser.add_argument("--small", type=int, default=20_000)
    args = parser.parse_args()
    main(args.runs, args.big_mb, args.small)
