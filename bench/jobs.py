"""What the job tools add per call, beside a plain run_python measured in the same run, lanes interleaved.

    .venv/bin/python bench/jobs.py [--rounds 200] [--before /work/main/src]

One `coderunner serve` over stdio (the official MCP client), one session. Each round runs, in turn:
- plain:      run_python('1+1'), answered whole (the baseline);
- wait_ended: manage_jobs wait on a job that has ended (a read: nothing new, its status and kernel line);
- background: run_python('1+1', detach_after_s=0), then manage_jobs wait until it is done (the job path whole).
With --before SRC, a second server runs the code in SRC (e.g. the main branch's src/, without jobs)
and a fourth lane, plain@before, times run_python there: what the job machinery costs a plain run.
Lanes interleave round by round, so drift of a shared machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters


def server_params(root: Path, src: str | None = None) -> StdioServerParameters:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_TOOLS": "all",
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_LOG_LEVEL": "WARNING",
    }
    for key in ("CODERUNNER_SANDBOX_ENV", "CODERUNNER_BACKEND", "CODERUNNER_OCI_RUNTIME", "CODERUNNER_IMAGE"):
        if key in os.environ:
            env[key] = os.environ[key]
    if src is not None:
        env["PYTHONPATH"] = src
    return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)


def job_of(result: Any) -> tuple[str, str]:
    job = (result.meta or {})["coderunner/job"]
    return job["job_id"], job["status"]


async def bench(rounds: int, root: Path, before: str | None) -> dict[str, list[float]]:
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(Client(server_params(root / "a"), read_timeout_seconds=120))
        lanes = await job_lanes(client)
        if before is not None:
            old = await stack.enter_async_context(Client(server_params(root / "b", before), read_timeout_seconds=120))

            async def plain_before() -> None:
                result = await old.call_tool("run_python", {"code": "1+1"})
                assert not result.is_error

            lanes["plain@before"] = plain_before
        for lane in lanes.values():  # warm each path once
            await lane()
        samples: dict[str, list[float]] = {name: [] for name in lanes}
        for _ in range(rounds):
            for name, lane in lanes.items():
                began = time.perf_counter()
                await lane()
                samples[name].append(time.perf_counter() - began)
        return samples


async def job_lanes(client: Client) -> dict[str, Callable[[], Awaitable[None]]]:
    """The lanes on the server with jobs: plain run_python, a manage_jobs wait read, a background run."""
    await client.call_tool("run_python", {"code": "1+1"})  # the kernel is up
    ended, _ = job_of(await client.call_tool("run_python", {"code": "1+1", "detach_after_s": 0}))
    while (
        job_of(await client.call_tool("manage_jobs", {"action": "wait", "job_id": ended, "timeout_s": 30}))[1]
        == "running"
    ):
        pass

    async def plain() -> None:
        result = await client.call_tool("run_python", {"code": "1+1"})
        assert not result.is_error

    async def read() -> None:
        result = await client.call_tool("manage_jobs", {"action": "wait", "job_id": ended, "timeout_s": 0})
        assert job_of(result)[1] == "done", result

    async def background() -> None:
        nonlocal ended  # the newest ended job: a session keeps only its last few
        job_id, status = job_of(await client.call_tool("run_python", {"code": "1+1", "detach_after_s": 0}))
        while status == "running":
            _, status = job_of(
                await client.call_tool("manage_jobs", {"action": "wait", "job_id": job_id, "timeout_s": 30})
            )
        ended = job_id

    return {"plain": plain, "wait_ended": read, "background": background}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--before", help="src/ of a version without jobs, for a plain@before lane")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="crj-", dir="/tmp"))
    root.chmod(0o711)  # a root server's sandbox users pass through
    for server in ("a", "b"):
        (root / server).mkdir(mode=0o711)
    try:
        samples = anyio.run(bench, args.rounds, root, args.before)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {name: statistics.median(values) * 1000 for name, values in samples.items()}
    for name, values in samples.items():
        ordered = sorted(values)
        p90 = ordered[int(len(ordered) * 0.9) - 1] * 1000
        print(f"{name:11s} median {median[name]:7.2f} ms   p90 {p90:7.2f} ms   n={len(values)}")
    plain = median["plain"]
    ended = median["wait_ended"]
    print(f"manage_jobs wait on an ended job: {ended:.2f} ms per call (plain run_python: {plain:.2f} ms)")
    print(f"background run + manage_jobs wait over plain run_python: {median['background'] - median['plain']:+.2f} ms")
    if "plain@before" in median:
        print(f"plain run_python, jobs over before: {median['plain'] - median['plain@before']:+.2f} ms")


if __name__ == "__main__":
    main()
