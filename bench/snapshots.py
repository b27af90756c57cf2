"""Snapshot and restore of a session holding `--size-mb` of data, per backend, beside a baseline.

    .venv/bin/python bench/snapshots.py [--size-mb 500] [--rounds 3] [--backends bwrap,podman,gvisor] [--summary PATH]

Each backend gets a SessionManager and one session holding a numpy array of --size-mb MB (random,
so nothing compresses) plus a file of the same size in its workspace. Per round, backends and
lanes in turn (so drift hits every lane alike):
- snapshot: manage_snapshots save's work (guest pickles the namespace while the host copies the
  workspace into the store, then the host copies the pickles beside it);
- restore: a new session from that snapshot, to its first answer (`data.nbytes`);
- baseline: what a user would do by hand in the same kernel: `np.save` the array to the workspace and
  `np.load` it back, plus `shutil.copyfile` of the workspace file (the same bytes through the same disk).
Medians and fastest rounds are printed per backend and lane, with each lane's ratio to the baseline
(the target is at most 1.5x: a snapshot or a restore costs at most half again what doing it by hand
costs), and every round's figures beside them (the machine's noise shows there). With --summary, each
backend's snapshot and restore medians beside the baseline's, as JSON for bench/suite.py.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from summary import Figure, add_summary_argument, write_summary

from coderunner.config import Settings
from coderunner.sandbox import SandboxUnavailable, make_backend
from coderunner.sessions import Session, SessionManager
from coderunner.sessions.session_snapshots import Seed
from coderunner.vocabulary.sandbox_request import SandboxRequest

OCI_RUNTIMES = {"podman": "runc"}
#: Issue 29: a snapshot, and a restore, at most this many times the by-hand baseline.
TARGET_RATIO = 1.5


def settings(backend: str, root: Path, size_mb: int) -> Settings:
    extra: dict[str, Any] = {"oci_runtime": OCI_RUNTIMES[backend]} if backend in OCI_RUNTIMES else {}
    return Settings(
        runtime_dir=root / "r",
        workspaces_dir=root / "w",
        token_file=root / "token",
        export_dir=None,
        backend=backend,
        memory_mb=max(2048, 4 * size_mb),
        disk_mb=max(2048, 6 * size_mb),
        snapshot_limit_mb=8 * size_mb,
        pool_size=0,
        **extra,
    )


async def run(session: Session, code: str) -> str:
    result = await session.run(code, 600, None)
    text = result.outcome.output.text()
    if result.outcome.status.value != "ok":
        raise RuntimeError(f"{code!r} failed: {text[-500:]}")
    return text


async def timed(lane: list[float], work: Any) -> Any:
    began = time.perf_counter()
    answer = await work
    lane.append(time.perf_counter() - began)
    return answer


async def restore(manager: SessionManager, options: Any, seed: Seed) -> Session:
    """A session from the snapshot, to its first answer."""
    restored = await manager.create(options, seed=seed)
    await run(restored, "data.nbytes")
    return restored


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="bwrap,podman,gvisor")
    add_summary_argument(parser)
    args = parser.parse_args()
    names = [name for name in args.backends.split(",") if name]
    size = args.size_mb
    fill = (
        f"import numpy as np, os\ndata = np.random.default_rng(1).random({size * 2**20 // 8})\n"
        f"with open('blob.bin', 'wb') as out:\n    out.write(os.urandom({size * 2**20}))\n"
        "print(data.nbytes)"
    )
    baseline_cell = (
        "import shutil\nnp.save('copy.npy', data)\nback = np.load('copy.npy')\n"
        "shutil.copyfile('blob.bin', 'blob.copy')\nos.unlink('copy.npy')\nos.unlink('blob.copy')\ndel back"
    )
    roots: list[Path] = []
    lanes: dict[str, dict[str, list[float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(lambda: [shutil.rmtree(root, ignore_errors=True) for root in roots])
        managers: dict[str, tuple[SessionManager, Session]] = {}
        for name in names:
            root = Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp"))
            root.chmod(0o711)
            roots.append(root)
            config = settings(name, root, size)
            try:
                backend = make_backend(config)
            except SandboxUnavailable as exc:
                print(f"{name}: skipped ({exc})")
                continue
            manager = await stack.enter_async_context(SessionManager(config, backend))
            session = await manager.create()
            await run(session, fill)
            managers[name] = (manager, session)
            lanes[name] = {"snapshot_s": [], "restore_s": [], "baseline_s": []}
        for _ in range(args.rounds):
            for name, (manager, session) in managers.items():
                lane = lanes[name]
                taken = await timed(lane["snapshot_s"], manager.snapshots.take(session))
                seed = Seed(session.options.client, taken.meta.snapshot_id)
                options = manager.options(SandboxRequest(memory_mb=session.options.limits.memory_mb))
                restored = await timed(lane["restore_s"], restore(manager, options, seed))
                await manager.close(restored.session_id)
                store = manager.snapshots.store
                await anyio.to_thread.run_sync(store.delete, seed.client, seed.snapshot_id)
                try:
                    await timed(lane["baseline_s"], run(session, baseline_cell))
                except RuntimeError as exc:
                    raise RuntimeError(f"{name}: {exc}") from None
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"session holding {size} MB in memory + {size} MB in its workspace; {args.rounds} rounds; load {load}")
    print("baseline: np.save + np.load of the array and a copy of the file, in the same kernel")
    print("medians, then each lane's fastest round (the least disturbed by other work on the machine)")
    heads = ("snapshot s", "restore s", "baseline s", "snapshot x", "restore x")
    print(f"{'backend':14} " + " ".join(f"{head:>11}" for head in heads))
    for name, lane in lanes.items():
        for label, pick in (("median", statistics.median), ("fastest", min)):
            snap, back, base = (pick(lane[key]) for key in ("snapshot_s", "restore_s", "baseline_s"))
            shown = f"{name} {label}"
            print(f"{shown:14} {snap:11.2f} {back:11.2f} {base:11.2f} {snap / base:10.2f}x {back / base:10.2f}x")
    write_summary(args.summary, "snapshots", summary_figures(lanes, size))
    for name, lane in lanes.items():
        rounds = zip(lane["snapshot_s"], lane["restore_s"], lane["baseline_s"], strict=True)
        print(f"{name} each round (snapshot/restore/baseline s): " + ", ".join(
            f"{snap:.2f}/{back:.2f}/{base:.2f}" for snap, back, base in rounds
        ))  # fmt: skip


def summary_figures(lanes: dict[str, dict[str, list[float]]], size: int) -> list[Figure]:
    """Each backend's snapshot and restore medians beside the by-hand baseline's, against the issue's target."""
    found = []
    for name, lane in lanes.items():
        base = statistics.median(lane["baseline_s"])
        for key, what in (("snapshot_s", "snapshot"), ("restore_s", "restore")):
            value = statistics.median(lane[key])
            found.append(Figure(f"{name}: {what} of {size} MB, median", round(value, 3), "s", baseline=round(base, 3),
                                baseline_name="np.save + np.load + a copy", target=f"<= {TARGET_RATIO:g}x",
                                met=value <= TARGET_RATIO * base))  # fmt: skip
    return found


if __name__ == "__main__":
    anyio.run(main)
