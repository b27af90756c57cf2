"""Sleeps and wake-ups per warm call, lane by lane: which hops a loaded machine punishes.

    .venv/bin/python bench/wakeups.py [--rounds 6] [--per-round 20] [--burners 0] [--baseline-src /work/main/src]

The lanes are latency.py's (raw ipykernel, minimal MCP, coderunner bwrap; with --baseline-src also
another tree's server), interleaved in shuffled rounds. Around each lane's batch of warm `1+1` calls
every thread of every process on that lane's path is read from /proc/PID/task/TID: the bench itself
(the client), the MCP server, and each process below it (bwrap, the sandbox's init, the kernel).

Why: a warm call costs about the same CPU in every lane, yet under load ours took twice a raw
kernel's time. A process that sleeps must wait for a time slice when it is woken, so on a machine
with more runnable threads than cores each wake-up on the path costs a wait. Printed per call:

- voluntary context switches (the thread slept: it waited for a message, a lock, a timer),
- involuntary ones (it was preempted),
- run-queue wait (ms runnable but not running, /proc/.../schedstat): what the load actually cost.

`--burners N` starts N spinning processes for the run (3 per core is the issue's contention) and
ends them, by their own pids, after. The load average at the end is printed beside the figures.
Counting starts once the servers have settled (latency.settled: their kernels started ahead are up).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
from mcp import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import (
    _passable,
    kernelspec_dir,
    mcp_run,
    minimal_params,
    raw_execute,
    raw_kernel,
    server_params,
    server_pid,
    settled,
    timed,
)

from coderunner.config import load_settings


@dataclass
class ThreadCount:
    """What one thread had done by the time it was read."""

    voluntary: int = 0
    involuntary: int = 0
    waited_ns: int = 0
    ran_ns: int = 0


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from every thread's children list)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [int(child) for child in _read(f"/proc/{pid}/task/{tid}/children").split()]
    return found


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children(current)
    return found


def role(pid: int, top: int, top_name: str) -> str:
    """What a process on a lane's path is, from its command line."""
    if pid == top:
        return top_name
    with contextlib.suppress(OSError):
        comm = _read(f"/proc/{pid}/comm").strip()
        if comm != "python" and not comm.startswith("python3"):
            return comm  # bwrap, sandbox-init (the init names itself)
        words = _read(f"/proc/{pid}/cmdline").replace("\0", " ")
        return "kernel" if "ipykernel" in words or "kernel_boot" in words else comm
    return "gone"


def thread_name(pid: int, tid: int, rank: int) -> str:
    """`main`, a named thread's own name (ZMQbg/IO/0), else python#N: the Nth thread started."""
    if pid == tid:
        return "main"
    with contextlib.suppress(OSError):
        name = _read(f"/proc/{pid}/task/{tid}/comm").strip()
        return f"{name}#{rank}" if name == "python" else name
    return "?"


def snapshot(processes: dict[int, str]) -> dict[tuple[str, int, int], tuple[str, ThreadCount]]:
    """Every thread of `processes` (pid -> role): its counters, keyed by (role, pid, tid)."""
    found = {}
    for pid, name in processes.items():
        with contextlib.suppress(OSError):
            for rank, tid in enumerate(sorted(int(entry) for entry in os.listdir(f"/proc/{pid}/task"))):
                with contextlib.suppress(OSError):
                    count = ThreadCount()
                    for line in _read(f"/proc/{pid}/task/{tid}/status").splitlines():
                        if line.startswith("voluntary_ctxt_switches"):
                            count.voluntary = int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            count.involuntary = int(line.split()[1])
                    ran, waited, _ = _read(f"/proc/{pid}/task/{tid}/schedstat").split()
                    count.ran_ns, count.waited_ns = int(ran), int(waited)
                    found[(name, pid, tid)] = (thread_name(pid, tid, rank), count)
    return found


@dataclass
class Tally:
    """One lane's counts summed over its batches, per (role, pid, thread name)."""

    calls: int = 0

    def __post_init__(self) -> None:
        self.rows: dict[tuple[str, int, str], ThreadCount] = defaultdict(ThreadCount)

    def add(self, before: dict, after: dict, calls: int) -> None:  # type: ignore[type-arg]
        self.calls += calls
        for key, (name, count) in after.items():
            old = before.get(key, ("", ThreadCount()))[1]
            row = self.rows[(key[0], key[1], name)]
            row.voluntary += count.voluntary - old.voluntary
            row.involuntary += count.involuntary - old.involuntary
            row.waited_ns += count.waited_ns - old.waited_ns
            row.ran_ns += count.ran_ns - old.ran_ns

    def merged(self) -> dict[tuple[str, str], ThreadCount]:
        """Per (role, thread): the busiest kernel is the lane's kernel; any other (a server's pool of
        ready kernels) is summed into one row, "other kernels", off the call's path."""
        busy: dict[int, int] = defaultdict(int)
        for (who, pid, _), count in self.rows.items():
            if who == "kernel":
                busy[pid] += count.voluntary
        mine = max(busy, key=lambda pid: busy[pid]) if busy else None
        merged: dict[tuple[str, str], ThreadCount] = defaultdict(ThreadCount)
        for (who, pid, thread), count in self.rows.items():
            key = ("other kernels", "all") if who == "kernel" and pid != mine else (who, thread)
            row = merged[key]
            row.voluntary += count.voluntary
            row.involuntary += count.involuntary
            row.waited_ns += count.waited_ns
            row.ran_ns += count.ran_ns
        return merged

    def per_call(self) -> Iterator[tuple[str, str, float, float, float, float]]:
        """(role, thread, voluntary, involuntary, run-queue wait ms, CPU ms) per call, rows that did anything."""
        for (who, thread), count in sorted(self.merged().items()):
            voluntary, involuntary = count.voluntary / self.calls, count.involuntary / self.calls
            waited, ran = count.waited_ns / self.calls / 1e6, count.ran_ns / self.calls / 1e6
            if voluntary >= 0.05 or involuntary >= 0.05:
                yield who, thread, voluntary, involuntary, waited, ran


def lane_processes(top: int, top_name: str, bench: int, kernels_only: bool) -> Callable[[], dict[int, str]]:
    """The processes on a lane's path, looked up afresh for each batch (a kernel may be replaced).

    `kernels_only`: of `top`'s children only kernels (the raw lane: the bench's other children are
    the servers of the other lanes and the burners)."""

    def find() -> dict[int, str]:
        found = {bench: "bench (client)"}
        if kernels_only:
            found.update({pid: "kernel" for pid in children(top) if role(pid, top, top_name) == "kernel"})
            return found
        for pid in tree(top):
            found[pid] = role(pid, top, top_name)
        return found

    return find


def scheduling_group(pid: int) -> str:
    """Where the scheduler weighs a process: its cgroup v1 cpu.shares (or v2 cpu.weight) from its own
    group up to the root, or, in the root group, its autogroup (one per session, weight 1024 at nice 0)."""
    chain = cpu_weight_chain(pid)
    if chain.startswith("cpu=") or chain == "/=" or chain == "unknown":
        with contextlib.suppress(OSError):
            return _read(f"/proc/{pid}/autogroup").split()[0]
    return chain


def cpu_weight_chain(pid: int) -> str:
    """The cgroup v1 cpu.shares (or v2 cpu.weight) from a process's cgroup up to the root."""
    with contextlib.suppress(OSError):
        for line in _read(f"/proc/{pid}/cgroup").splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(",") or controllers == "":
                base = Path("/sys/fs/cgroup/cpu") if controllers else Path("/sys/fs/cgroup")
                name = "cpu.shares" if controllers else "cpu.weight"
                parts = []
                here = base / path.lstrip("/")
                while here != base.parent:
                    with contextlib.suppress(OSError):
                        parts.append(f"{here.name or '/'}={_read(str(here / name)).strip()}")
                    here = here.parent
                if parts:
                    return " < ".join(parts)
    return "unknown"


@contextlib.contextmanager
def burners(count: int) -> Iterator[None]:
    """`count` spinning processes for the duration (killed by their own pids after)."""
    spinning = [  # each in a session (an autogroup) of its own, as independent work on the machine is
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(count)
    ]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


async def main(rounds: int, per_round: int, baseline: Path | None, cpu_weight: int, settle: bool) -> None:
    settings = load_settings()
    root = _passable(Path(tempfile.mkdtemp(prefix="crw-", dir="/tmp")))
    os.environ["JUPYTER_PATH"] = str(kernelspec_dir(settings.sandbox_env / "bin" / "python", root / "jupyter"))
    os.environ["JUPYTER_RUNTIME_DIR"] = str(root / "jupyter-runtime")
    bench = os.getpid()
    tallies: dict[str, Tally] = {}
    walls: dict[str, list[float]] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            raw = await stack.enter_async_context(raw_kernel())
            minimal = await stack.enter_async_context(Client(minimal_params(), read_timeout_seconds=120))
            targets = [("coderunner bwrap", None)]
            if baseline is not None:
                targets.append(("coderunner bwrap baseline", baseline))
            ours = {
                lane: await stack.enter_async_context(
                    Client(
                        server_params(root / lane.replace(" ", "-"), "bwrap", lane, src, cpu_weight),
                        read_timeout_seconds=120,
                    )
                )
                for lane, src in targets
            }

            async def minimal_run() -> None:
                result = await minimal.call_tool("run_python", {"code": "1+1"})
                if result.is_error:
                    raise RuntimeError(result.content)

            lanes: dict[str, Callable[[], Awaitable[None]]] = {"raw": lambda: raw_execute(raw)}
            lanes["minimal MCP"] = minimal_run
            for lane, client in ours.items():
                lanes[lane] = lambda client=client: mcp_run(client)  # type: ignore[misc]
            for call in lanes.values():
                await timed(20, call)
            servers = {name: server_pid(name) for name in lanes if name != "raw"}
            finders: dict[str, Callable[[], dict[int, str]]] = {
                # the raw kernel is the bench's own child; the servers' trees belong to their lanes
                "raw": lane_processes(bench, "bench (client)", bench, kernels_only=True),
            }
            if settle:
                waited = await settled([pid for pid in servers.values() if pid is not None])
                print(f"servers settled (their kernels started ahead are up) after {waited:.1f} s")
            for name, pid in servers.items():
                assert pid is not None, f"no server process found for {name}"
                finders[name] = lane_processes(pid, "server", bench, kernels_only=False)
            for name, find in finders.items():
                groups = {f"{who} {pid}": scheduling_group(pid) for pid, who in find().items()}
                print(f"{name}: scheduled in: " + "; ".join(f"{who}: {group}" for who, group in groups.items()))
            tallies = {name: Tally() for name in lanes}
            walls = {name: [] for name in lanes}
            for _ in range(rounds):
                for name in random.sample(list(lanes), len(lanes)):
                    processes = finders[name]()
                    before = snapshot(processes)
                    walls[name] += await timed(per_round, lanes[name])
                    tallies[name].add(before, snapshot(processes), per_round)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(tallies, walls, rounds, per_round)


def report(tallies: dict[str, Tally], walls: dict[str, list[float]], rounds: int, per_round: int) -> None:
    print(f"\n{rounds} rounds x {per_round} warm 1+1 calls per lane, shuffled; figures per call")
    print(
        f"{'lane':28} {'process':16} {'thread':16} {'voluntary':>9} {'involunt.':>9} {'rq wait ms':>10} {'cpu ms':>7}"
    )
    for lane, tally in tallies.items():
        for who, thread, voluntary, involuntary, waited, ran in tally.per_call():
            print(f"{lane:28} {who:16} {thread:16} {voluntary:9.2f} {involuntary:9.2f} {waited:10.3f} {ran:7.3f}")
        print()
    roles = sorted({row[0] for tally in tallies.values() for row in tally.per_call()} - {"other kernels"})
    print("per process, side by side: voluntary / involuntary switches / run-queue wait ms / CPU ms, per call")
    print(f"{'process':16} " + " ".join(f"{lane:>30}" for lane in tallies))
    for who in [*roles, "path total"]:
        cells = []
        for tally in tallies.values():
            rows = [row for row in tally.per_call() if row[0] == who or (who == "path total" and row[0] in roles)]
            sums = [sum(row[at] for row in rows) for at in (2, 3, 4, 5)]
            cell = f"{sums[0]:.1f} / {sums[1]:.1f} / {sums[2]:.2f} / {sums[3]:.2f}"
            cells.append(f"{cell if rows else '-':>30}")
        print(f"{who:16} " + " ".join(cells))
    medians = " ".join(f"{statistics.median(walls[lane]) * 1000:>27.2f} ms" for lane in tallies)
    print(f"{'median wall':16} {medians}")
    print(f"load {' '.join(f'{value:.2f}' for value in os.getloadavg())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="shuffled rounds")
    parser.add_argument("--per-round", type=int, default=20, help="warm calls of each lane per round")
    parser.add_argument("--burners", type=int, default=0, help="spinning processes beside the lanes (6: 3 per core)")
    parser.add_argument("--baseline-src", type=Path, help="also measure another tree's server (its src folder)")
    parser.add_argument("--cpu-weight", type=int, default=100, help="sessions' CPU weight, as latency.py")
    parser.add_argument(
        "--no-settle", action="store_true",
        help="measure at once, while the servers may still be starting kernels ahead (pool, standbys)",
    )  # fmt: skip
    args = parser.parse_args()
    baseline = args.baseline_src.resolve() if args.baseline_src else None
    with burners(args.burners):
        anyio.run(main, args.rounds, args.per_round, baseline, args.cpu_weight, not args.no_settle)
