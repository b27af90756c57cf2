"""What a session's start costs beside sessions already held, against the same start beside none (issues 40, 41).

    sudo .venv/bin/python bench/held_starts.py [--held 100] [--creates 10] [--rounds 2] [--template|--cold]

One SessionManager on the bwrap backend (pool_size 0, no reset standby: each create is a real start). The lanes
alternate in rounds: "0 held" makes `--creates` sessions one after another, each to its first `1+1` result and
closed; then N sessions are opened and kept idle, and two lanes take turns create by create: "N held" starts as
the server does (bwrap in the start namespace, sandbox/start_namespace.py), "N held, host ns" with bwrap in the
host's mount namespace as before it (the backend's `use_start_namespace` off); then they are closed. Per create:

    bwrap setup + init   CPU of the sandbox's pid 1 process (schedstat, nanoseconds): bwrap's child, which
                         builds the mounts (for each bind, bwrap reads the whole mount table it copied from the
                         host), then the init's Python (guest/sandbox_init.py)
    outer bwrap          CPU of the outer bwrap process
    create + 1+1         wall time to the first result
    bwrap's mounts       lines of the outer bwrap's mountinfo: the table its sandbox's bwrap copied and read

Why: each held session adds mounts to the host's table (its workspace's loop mount, its staged outbox), and every
bind of every later start walks that table. Root only where the workspaces are capped (loop mounts); the table is
printed. No timing assertions anywhere: figures only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

MIB = 2**20


def cpu_ms(pid: int) -> float:
    """CPU a process ran so far (its schedstat), in ms."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e6


def host_mounts() -> int:
    return Path("/proc/self/mountinfo").read_text().count("\n")


async def one_create(manager: Any) -> dict[str, float]:
    from coderunner.sandbox.pid_watcher import pid_of

    began = time.perf_counter()
    session = await manager.create()
    try:
        result = await session.run("1+1", 60, None)
        took_ms = (time.perf_counter() - began) * 1000
        if "2" not in "".join(result.outcome.output.head):
            raise RuntimeError(f"1+1 gave {result!r}")
        process = session.kernel.process
        init = pid_of(process.hold.init) if process.hold is not None and process.hold.init is not None else None
        if init is None:
            raise RuntimeError("the sandbox's pid 1 is not known: not a bwrap sandbox?")
        seen = Path(f"/proc/{process.pid}/mountinfo").read_text().count("\n")
        return {"init": cpu_ms(init), "outer": cpu_ms(process.pid), "create": took_ms, "mounts": seen}
    finally:
        await manager.close(session.session_id)


async def lane(manager: Any, creates: int, pause_s: float) -> list[dict[str, float]]:
    samples = []
    for _ in range(creates):
        samples.append(await one_create(manager))
        await anyio.sleep(pause_s)
    return samples


async def two_lanes(manager: Any, creates: int, pause_s: float) -> tuple[list[dict[str, float]], ...]:
    """Creates in turn with bwrap in the start namespace and in the host's."""
    ours: list[dict[str, float]] = []
    host: list[dict[str, float]] = []
    try:
        for _ in range(creates):
            for use, samples in ((True, ours), (False, host)):
                manager.backend.use_start_namespace = use
                samples.append(await one_create(manager))
                await anyio.sleep(pause_s)
    finally:
        manager.backend.use_start_namespace = True
    return ours, host


async def held(manager: Any, count: int) -> list[Any]:
    sessions: list[Any] = []

    async def open_one() -> None:
        session = await manager.create()
        await session.run("1+1", 120, None)
        sessions.append(session)

    with anyio.fail_after(600):
        async with anyio.create_task_group() as group:
            for _ in range(count):
                group.start_soon(open_one)
    return sessions


async def close_all(manager: Any, sessions: list[Any]) -> None:
    with anyio.fail_after(300):
        async with anyio.create_task_group() as group:
            for session in sessions:
                group.start_soon(manager.close, session.session_id)


async def main(args: argparse.Namespace) -> None:
    from coderunner.config import load_settings
    from coderunner.sandbox import make_backend
    from coderunner.sandbox.bwrap import BwrapBackend
    from coderunner.sessions.manager import SessionManager

    root = Path(tempfile.mkdtemp(prefix="crheld-", dir="/tmp"))
    os.chmod(root, 0o755)
    os.environ.update(
        CODERUNNER_CONFIG=os.devnull,
        CODERUNNER_RUNTIME_DIR=str(root / "run"),
        CODERUNNER_WORKSPACES_DIR=str(root / "workspaces"),
    )
    settings = load_settings().model_copy(
        update={"pool_size": 0, "reset_standby": False, "kernel_template": args.template,
                "max_sessions": args.held + 8}
    )  # fmt: skip
    backend = make_backend(settings)
    if not isinstance(backend, BwrapBackend):
        raise SystemExit("this bench measures bwrap sandboxes")
    if backend.cgroups is not None:  # neutral weight: measure a start, not the machine's load
        backend.cgroups.cpu_weight = 100
    many, host_ns = f"{args.held} held", f"{args.held} held, host ns"
    figures: dict[str, list[dict[str, float]]] = {"0 held": [], many: [], host_ns: []}
    tables: dict[str, list[int]] = {name: [] for name in figures}
    try:
        async with SessionManager(settings, backend) as manager:
            with anyio.fail_after(300):
                while args.template and manager.template.template is None:
                    await anyio.sleep(0.2)
            await one_create(manager)  # not counted: the machine's caches warm alike
            for _ in range(args.rounds):
                tables["0 held"].append(host_mounts())
                figures["0 held"] += await lane(manager, args.creates, args.pause)
                sessions = await held(manager, args.held)
                await anyio.sleep(2)  # their starts settled
                tables[many].append(host_mounts())
                tables[host_ns].append(host_mounts())
                ours, host = await two_lanes(manager, args.creates, args.pause)
                figures[many] += ours
                figures[host_ns] += host
                await close_all(manager, sessions)
                await anyio.sleep(2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    kind = "template" if args.template else "cold"
    print(f"{kind} starts, {args.creates} creates a lane a round, {args.rounds} rounds, medians (p90):")
    print(f"{'lane':>20} {'host mounts':>12} {'bwrap mounts':>13} {'bwrap setup + init CPU-ms':>26} "
          f"{'outer bwrap CPU-ms':>19} {'create + 1+1 ms':>16}")  # fmt: skip
    base = statistics.median(sample["init"] for sample in figures["0 held"])
    for name, samples in figures.items():
        cells = []
        for key in ("init", "outer", "create"):
            values = sorted(sample[key] for sample in samples)
            cells.append(f"{statistics.median(values):6.1f} ({values[int(len(values) * 0.9) - 1]:6.1f})")
        seen = max(int(sample["mounts"]) for sample in samples)
        print(f"{name:>20} {max(tables[name]):>12} {seen:>13} {cells[0]:>26} {cells[1]:>19} {cells[2]:>16}")
    extra = max(tables[many]) - max(tables["0 held"])
    for name in (many, host_ns):
        held_init = statistics.median(sample["init"] for sample in figures[name])
        print(f"{name} ({extra} more host mounts): a sandbox's setup CPU {held_init - base:+.1f} ms beside none")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, default=100, help="sessions held idle in the second lane")
    parser.add_argument("--creates", type=int, default=10, help="creates a lane a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.2, help="seconds between creates")
    starts = parser.add_mutually_exclusive_group()
    starts.add_argument("--template", dest="template", action="store_true", default=True,
                        help="kernels forked from the template (the default)")  # fmt: skip
    starts.add_argument("--cold", dest="template", action="store_false", help="kernels started cold")
    anyio.run(main, parser.parse_args())
