"""A bystander's run_python('1+1') latency while other calls do heavy host-side work, lanes interleaved.

    .venv/bin/python bench/bystander.py [--rounds 3] [--copies 8] [--size-mb 500] [--burst 8] [--src DIR]

Lanes, in turn each round, all through the official MCP client over stdio to one server:
- quiet:   the bystander's `1+1` alone (its idle latency, measured in the same run);
- uploads: the same while another session runs `--copies` parallel transfer_file uploads of a
  `--size-mb` file from an import folder (the host copies each into the sandbox's workspace);
- copies:  the same while another session runs `--copies` parallel transfer_file downloads of a
  `--size-mb` file (the host copies each out of the sandbox into the export folder);
- burst:   the same while `--burst` parallel execute_code calls run (each a fresh sandbox).
Each lane reports median, p95 and max of the bystander's round trips. --src runs another source
tree's server (e.g. an older commit exported with `git archive`) to measure before and after.
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
MAKE_BIG = """
import os
block = os.urandom(1 << 20)
with open('big.bin', 'wb') as handle:
    for _ in range({size_mb}):
        handle.write(block)
os.path.getsize('big.bin')
"""


def params(root: Path, src: Path, size_mb: int, copies: int) -> StdioServerParameters:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(src),
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_TOOLS": "all",
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_EXPORT_DIR": str(root / "out"),
        "CODERUNNER_IMPORT_DIRS": json.dumps([str(root / "imports")]),
        "CODERUNNER_DISK_MB": str(size_mb * (copies + 1) + 512),
        "CODERUNNER_LOG_LEVEL": "WARNING",
    }
    for key in ("CODERUNNER_SANDBOX_ENV", "CODERUNNER_BACKEND"):
        if key in os.environ:
            env[key] = os.environ[key]
    return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)


def copy_arguments(number: int, session_id: str) -> dict[str, object]:
    return {"direction": "download", "sandbox_path": "big.bin", "host_path": f"copy-{number}.bin", "overwrite": True,
            "session_id": session_id}  # fmt: skip


def upload_arguments(number: int, session_id: str, source: Path) -> dict[str, object]:
    return {"direction": "upload", "host_path": str(source), "sandbox_path": f"up-{number}.bin", "overwrite": True,
            "session_id": session_id}  # fmt: skip


def make_import(root: Path, size_mb: int) -> Path:
    """A real (not sparse) file in the import folder, so every byte is read and written."""
    (root / "imports").mkdir(mode=0o755)
    source = root / "imports" / "big-in.bin"
    block = os.urandom(1 << 20)
    with open(source, "wb") as handle:
        for _ in range(size_mb):
            handle.write(block)
    return source


async def checked(client: Client, tool: str, arguments: dict[str, object]) -> None:
    result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise RuntimeError(f"{tool}: {result.content}")


async def probe_while(client: Client, busy: anyio.Event | None, count: int) -> list[float]:
    """Bystander round trips: `count` of them, or as many as fit until `busy` is set (at least 3)."""
    samples: list[float] = []
    while (busy is None and len(samples) < count) or (busy is not None and (not busy.is_set() or len(samples) < 3)):
        began = time.perf_counter()
        await checked(client, "run_python", {"code": "1+1"})
        samples.append(time.perf_counter() - began)
    return samples


async def loaded_lane(client: Client, work: list[tuple[str, dict[str, object]]]) -> list[float]:
    done = anyio.Event()
    samples: list[float] = []

    async def probing() -> None:
        samples.extend(await probe_while(client, done, 0))

    async with anyio.create_task_group() as tg:
        tg.start_soon(probing)
        async with anyio.create_task_group() as workers:
            for tool, arguments in work:
                workers.start_soon(checked, client, tool, arguments)
        done.set()
    return samples


def row(name: str, samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[max(int(len(ms) * 0.95) - 1, 0)]
    return f"  {name:8} median {statistics.median(ms):8.1f} ms   p95 {p95:8.1f} ms   max {ms[-1]:8.1f} ms   n {len(ms)}"


async def main(rounds: int, copies: int, size_mb: int, burst: int, src: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp"))
    root.chmod(0o711)
    lanes: dict[str, list[float]] = {"quiet": [], "uploads": [], "copies": [], "burst": []}
    source = make_import(root, size_mb)
    try:
        async with Client(params(root, src, size_mb, copies), read_timeout_seconds=600) as client:
            for _ in range(10):
                await checked(client, "run_python", {"code": "1+1"})
            created = await client.call_tool("create_session", {})
            session_id = json.loads(created.content[0].text)["session_id"]  # type: ignore[union-attr]
            await checked(client, "run_python", {"code": MAKE_BIG.format(size_mb=size_mb), "session_id": session_id,
                                                 "timeout_s": 300})  # fmt: skip
            copy_work: list[tuple[str, dict[str, object]]] = [
                ("transfer_file", copy_arguments(n, session_id)) for n in range(copies)
            ]
            upload_work: list[tuple[str, dict[str, object]]] = [
                ("transfer_file", upload_arguments(n, session_id, source)) for n in range(copies)
            ]
            burst_work: list[tuple[str, dict[str, object]]] = [
                ("execute_code", {"language": "bash", "code": "echo hi"}) for _ in range(burst)
            ]
            for _ in range(rounds):
                lanes["quiet"] += await probe_while(client, None, 30)
                lanes["uploads"] += await loaded_lane(client, upload_work)
                lanes["copies"] += await loaded_lane(client, copy_work)
                for leftover in (root / "out").glob("copy-*.bin"):
                    leftover.unlink()
                lanes["burst"] += await loaded_lane(client, burst_work)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"server from {src}: bystander run_python('1+1'); {copies} x {size_mb} MiB uploads, then as many "
          f"downloads; {burst} x execute_code; {rounds} rounds")  # fmt: skip
    quiet = statistics.median(lanes["quiet"])
    for name, samples in lanes.items():
        print(row(name, samples) + f"   median {statistics.median(samples) / quiet:5.2f}x quiet")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--size-mb", type=int, default=500)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--src", type=Path, default=REPO / "src")
    args = parser.parse_args()
    anyio.run(main, args.rounds, args.copies, args.size_mb, args.burst, args.src.resolve())
