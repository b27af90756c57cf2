"""A bystander's run_python('1+1') latency while two other sessions spin every core, lanes interleaved.

    .venv/bin/python bench/cpu_spin.py [--rounds 3] [--probes 40] [--spinners 4] [--src DIR]

Each spinning session starts `--spinners` busy processes from its kernel (they keep burning after
the call that started them returned, like a forgotten background thread) and later kills them.
Lanes alternate: quiet (nobody spins) and spinning (two sessions spin). Figures: the bystander's
1+1, the server's own turn-around (manage_sessions list, which needs no kernel), and the wall time of a
fixed piece of host work outside any sandbox (the user's own programs, which sandboxes should not
crowd out). --src runs another source tree's
server (e.g. an older commit exported with `git archive`) to measure before and after;
CODERUNNER_SESSION_CPU_WEIGHT=100 in the environment gives the neutral weight of earlier versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parents[1]
SPIN = """
import subprocess, sys
spinners = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range({count})]
len(spinners)
"""
STOP = "[p.kill() for p in spinners]; [p.wait() for p in spinners]; 'stopped'"
HOST_WORK = [sys.executable, "-c", "sum(range(10**7))"]


def params(root: Path, src: Path) -> StdioServerParameters:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(src),
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_TOOLS": "all",
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_LOG_LEVEL": "WARNING",
    }
    for key in ("CODERUNNER_SANDBOX_ENV", "CODERUNNER_BACKEND", "CODERUNNER_SESSION_CPU_WEIGHT"):
        if key in os.environ:
            env[key] = os.environ[key]
    return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)


async def host_work() -> float:
    began = time.perf_counter()
    await anyio.run_process(HOST_WORK, check=True)
    return time.perf_counter() - began


async def timed_call(client: Client, tool: str, arguments: dict[str, object]) -> float:
    began = time.perf_counter()
    result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise RuntimeError(f"{tool}: {result.content}")
    return time.perf_counter() - began


def row(name: str, samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[max(int(len(ms) * 0.95) - 1, 0)]
    return f"  {name:26} median {statistics.median(ms):8.1f} ms   p95 {p95:8.1f} ms   max {ms[-1]:8.1f} ms"


async def main(rounds: int, probes: int, spinners: int, src: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp"))
    root.chmod(0o711)
    names = ("1+1", "manage_sessions list", "host work")
    lanes: dict[str, list[float]] = {f"{lane} {name}": [] for name in names for lane in ("quiet", "spinning")}
    try:
        async with Client(params(root, src), read_timeout_seconds=300) as client:
            for _ in range(10):
                await timed_call(client, "run_python", {"code": "1+1"})
            spinning = []
            for _ in range(2):
                created = await client.call_tool("create_session", {})
                spinning.append(json.loads(created.content[0].text)["session_id"])  # type: ignore[union-attr]
            for _ in range(rounds):
                for lane in ("quiet", "spinning"):
                    if lane == "spinning":
                        for session_id in spinning:
                            code = SPIN.format(count=spinners)
                            await timed_call(client, "run_python", {"code": code, "session_id": session_id})
                        await anyio.sleep(1)
                    for _ in range(probes):
                        lanes[f"{lane} 1+1"].append(await timed_call(client, "run_python", {"code": "1+1"}))
                        lanes[f"{lane} manage_sessions list"].append(
                            await timed_call(client, "manage_sessions", {"action": "list"})
                        )
                    for _ in range(3):
                        lanes[f"{lane} host work"].append(await host_work())
                    if lane == "spinning":
                        for session_id in spinning:
                            await timed_call(client, "run_python", {"code": STOP, "session_id": session_id})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"server from {src}: 2 sessions x {spinners} spinning processes on {os.cpu_count()} cores, {rounds} rounds")
    for name, samples in lanes.items():
        print(row(name, samples))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--spinners", type=int, default=4)
    parser.add_argument("--src", type=Path, default=REPO / "src")
    args = parser.parse_args()
    anyio.run(main, args.rounds, args.probes, args.spinners, args.src.resolve())
