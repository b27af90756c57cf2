"""What a sandbox's host side costs to prepare: mounts staged by fd (root) and the export outbox.

    sudo .venv/bin/python bench/staging.py [--runs 200]

Lanes, interleaved in one run on throwaway folders: the baseline (a host-only dir made and
removed, what every sandbox already pays), the export outbox alone, and the outbox plus one
id-mapped read-write mount of a folder under a 0700 parent. Each lane is prepare_mounts() then
close(), as a session open and close do; a copy-out of one small file is timed on its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from coderunner.hostfs.sandbox_mounts import ExportPlan, prepare_mounts
from coderunner.sandbox import Mount

SANDBOX = (999, 995)


def lane_baseline(base: Path, workspace: Path, folder: Path, out: Path) -> None:
    host = Path(tempfile.mkdtemp(dir=base))
    (host / "outbox").mkdir()
    shutil.rmtree(host)


def _lane(mounts: tuple[Mount, ...]):  # type: ignore[no-untyped-def]
    def lane(base: Path, workspace: Path, folder: Path, out: Path) -> None:
        host = Path(tempfile.mkdtemp(dir=base))
        plan = prepare_mounts(mounts, host, workspace, SANDBOX, ExportPlan("/mnt/outputs", out, 1 << 30, None))
        assert plan.close()
        shutil.rmtree(host)

    return lane


def main(runs: int) -> None:
    if os.getuid() != 0:
        raise SystemExit("staging is what a root server does: run this as root")
    root = Path(tempfile.mkdtemp(prefix="crstg-", dir="/tmp"))
    try:
        private = root / "private"
        private.mkdir(mode=0o700)
        folder = private / "project"
        folder.mkdir()
        os.chown(folder, 1234, 1234)
        workspace, out = root / "workspace", root / "exports"
        workspace.mkdir()
        out.mkdir()
        lanes = {
            "baseline (host dir only)": lane_baseline,
            "export outbox": _lane(()),
            "outbox + id-mapped rw mount": _lane((Mount(folder, "/project", writable=True),)),
        }
        times: dict[str, list[float]] = {name: [] for name in lanes}
        for _ in range(runs):
            for name, lane in lanes.items():
                began = time.perf_counter()
                lane(root, workspace, folder, out / "client")
                times[name].append((time.perf_counter() - began) * 1000)
        base = statistics.median(times["baseline (host dir only)"])
        for name, samples in times.items():
            median = statistics.median(samples)
            p95 = sorted(samples)[int(len(samples) * 0.95) - 1]
            print(f"{name:32} median {median:7.3f} ms  p95 {p95:7.3f} ms  (+{median - base:.3f} ms over baseline)")
        host = Path(tempfile.mkdtemp(dir=root))
        plan = prepare_mounts((), host, workspace, SANDBOX, ExportPlan("/mnt/outputs", out / "copy", 1 << 30, None))
        assert plan.exporter is not None
        copies = []
        for index in range(runs):
            (plan.exporter.outbox / f"f{index}.csv").write_text("a,b\n1,2\n")
            began = time.perf_counter()
            plan.export()
            copies.append((time.perf_counter() - began) * 1000)
        plan.close()
        print(f"{'copy-out of one new small file':32} median {statistics.median(copies):7.3f} ms"
              f"  (outbox growing to {runs} files)")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    main(parser.parse_args().runs)
