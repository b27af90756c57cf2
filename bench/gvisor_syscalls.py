"""Syscalls per warm `1+1` in a gvisor sandbox, by thread and by call, from runsc's own strace.

    .venv/bin/python bench/gvisor_syscalls.py [--cells 10]

Why: under runsc's ptrace platform each syscall costs tens of µs, so a warm `1+1` costs about what
its syscalls do; unlike a latency, their count does not move with the machine's load. One session
runs under `runsc --strace` (debug log in a temp dir); the cells between two marker stats are counted.
Threads are named as gVisor sees them: [1:1] is the channel relay, [2:n] the kernel's threads.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import shutil
import tempfile
from pathlib import Path

import anyio
from snapshots import run  # bench/snapshots.py, beside this script

from coderunner.config import Settings
from coderunner.sandbox import make_backend
from coderunner.sessions import SessionManager

#: A syscall's exit line in runsc's strace: "[pid:tid] name X call(...".
EXIT = re.compile(r"\] \[ *(\d+): *(\d+)\] (\S+) X ([a-z_0-9]+)\(")
MARK = "import os\ntry:\n    os.stat('/{}')\nexcept OSError:\n    pass"


def count(log: Path, cells: int) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(by thread, by call) between the marker stats, per cell."""
    threads: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    inside = False
    with log.open(errors="replace") as lines:
        for line in lines:
            if "MARKER_BEGIN" in line and " X " in line:
                inside = True
                continue
            if "MARKER_END" in line:
                break
            found = EXIT.search(line) if inside else None
            if found:
                threads[f"[{found[1]}:{found[2]}] {found[3]}"] += 1
                calls[found[4]] += 1
    return (
        collections.Counter({k: round(v / cells) for k, v in threads.items()}),
        collections.Counter({k: round(v / cells) for k, v in calls.items()}),
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=10)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="crg-", dir="/tmp"))
    try:
        root.chmod(0o711)
        logs = root / "log"
        logs.mkdir()
        config = Settings(runtime_dir=root / "r", workspaces_dir=root / "w", token_file=root / "token",
                          export_dir=None, backend="gvisor", pool_size=0)  # fmt: skip
        backend = make_backend(config)
        flags = (*backend.runsc.flags, "strace", "debug", f"debug-log={logs}/")
        backend.runsc = dataclasses.replace(backend.runsc, flags=flags)  # type: ignore[attr-defined]
        async with SessionManager(config, backend) as manager:
            session = await manager.create()
            await run(session, "1+1")
            await run(session, MARK.format("MARKER_BEGIN"))
            for _ in range(args.cells):
                await run(session, "1+1")
            await run(session, MARK.format("MARKER_END"))
        boot = next(logs.glob("*.boot.txt"))
        threads, calls = count(boot, args.cells + 1)  # the end marker's cell is counted too
        print(f"syscalls per warm `1+1` (of {args.cells}): {sum(calls.values())}")
        print("by thread: " + ", ".join(f"{name} {n}" for name, n in threads.most_common()))
        print("by call:   " + ", ".join(f"{name} {n}" for name, n in calls.most_common(12)))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    anyio.run(main)
