"""gvisor against bwrap in one run, lanes interleaved: cold start, warm `1+1`, snapshot and restore.

    .venv/bin/python bench/gvisor.py [--rounds 3] [--warm 20] [--size-mb 100]

One SessionManager per backend. Per round, backends in turn (so drift hits both alike):
- cold: create a session and answer `1+1`;
- warm: the median of `--warm` further `1+1` round trips in it;
- then that session gets `--size-mb` MB of random numpy data and a thread counting in a local variable;
- snapshot: manage_snapshots save's work. On gvisor a memory checkpoint (runsc checkpoint of the whole
  sandbox, the workspace copied while it is stopped, and the sandbox restored in place to run on);
  on bwrap the pickled namespace (the thread is listed as not saved);
- restore: a new session from that snapshot, to its first answer (`data.nbytes`);
- thread: whether the restored copy's counter thread is alive and kept its count (gvisor only: a
  pickle cannot carry a thread).
Medians per backend and lane; the snapshot's size beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
from pathlib import Path

import anyio
from snapshots import run, timed  # bench/snapshots.py, beside this script

from coderunner.config import Settings
from coderunner.sandbox import SandboxUnavailable, make_backend
from coderunner.sessions import Session, SessionManager
from coderunner.sessions.session_snapshots import Seed

FILL = """
import threading, time
import numpy as np
data = np.random.default_rng(1).random({size} * 2**20 // 8)
counts = []
def _count():
    n = 0
    while True:
        n += 1
        if len(counts) < 100_000:
            counts.append(n)
        time.sleep(0.02)
threading.Thread(target=_count, daemon=True).start()
time.sleep(0.2)
"""
THREAD = "print(threading.active_count() > 1 and counts == list(range(1, len(counts) + 1)) and len(counts) > 0)"


def settings(backend: str, root: Path, size_mb: int) -> Settings:
    return Settings(
        runtime_dir=root / "r",
        workspaces_dir=root / "w",
        token_file=root / "token",
        export_dir=None,
        backend=backend,
        memory_mb=max(2048, 4 * size_mb),
        snapshot_limit_mb=max(4096, 8 * size_mb),
        pool_size=0,
    )


async def cold(manager: SessionManager) -> Session:
    session = await manager.create()
    await run(session, "1+1")
    return session


async def restore(manager: SessionManager, seed: Seed) -> Session:
    restored = await manager.create(manager.options(), seed=seed)
    await run(restored, "data.nbytes")
    return restored


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--backends", default="bwrap,gvisor")
    args = parser.parse_args()
    roots: list[Path] = []
    lanes: dict[str, dict[str, list[float]]] = {}
    threads: dict[str, list[str]] = {}
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(lambda: [shutil.rmtree(root, ignore_errors=True) for root in roots])
        managers: dict[str, SessionManager] = {}
        for name in args.backends.split(","):
            root = Path(tempfile.mkdtemp(prefix="crg-", dir="/tmp"))
            root.chmod(0o711)
            roots.append(root)
            config = settings(name, root, args.size_mb)
            try:
                backend = make_backend(config)
            except SandboxUnavailable as exc:
                print(f"{name}: skipped ({exc})")
                continue
            managers[name] = await stack.enter_async_context(SessionManager(config, backend))
            lanes[name] = {key: [] for key in ("cold_s", "warm_ms", "snapshot_s", "restore_s", "size_mb")}
            threads[name] = []
        for _ in range(args.rounds):
            for name, manager in managers.items():
                lane = lanes[name]
                session = await timed(lane["cold_s"], cold(manager))
                trips = []
                for _ in range(args.warm):
                    await timed(trips, run(session, "1+1"))
                lane["warm_ms"].append(statistics.median(trips) * 1000)
                await run(session, FILL.format(size=args.size_mb))
                taken = await timed(lane["snapshot_s"], manager.snapshots.take(session))
                lane["size_mb"].append(taken.meta.size_bytes / 2**20)
                seed = Seed(session.options.client, taken.meta.snapshot_id)
                restored = await timed(lane["restore_s"], restore(manager, seed))
                threads[name].append(
                    (await run(restored, THREAD)).strip() if "memory" in taken.meta.state_report else "n/a"
                )
                for each in (restored, session):
                    await manager.close(each.session_id)
                await anyio.to_thread.run_sync(manager.snapshots.store.delete, seed.client, seed.snapshot_id)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"{args.rounds} rounds, backends interleaved; snapshots of a session holding {args.size_mb} MB; load {load}")
    print(
        f"{'backend':8} {'cold s':>7} {'warm 1+1 ms':>12} {'snapshot s':>11} {'restore s':>10} {'size MB':>8}"
        "  thread kept"
    )
    for name, lane in lanes.items():
        cells = [statistics.median(lane[key]) for key in ("cold_s", "warm_ms", "snapshot_s", "restore_s", "size_mb")]
        print(
            f"{name:8} {cells[0]:7.2f} {cells[1]:12.1f} {cells[2]:11.2f} {cells[3]:10.2f} {cells[4]:8.0f}  "
            f"{','.join(threads[name])}"
        )


if __name__ == "__main__":
    anyio.run(main)
