"""Latency of CodeRunner beside a raw jupyter_client + ipykernel baseline, measured in the same run.

    .venv/bin/python bench/latency.py [--calls 300] [--colds 10] [--backend bwrap --backend podman ...]

Warm: one `1+1` round trip. For CodeRunner that is a `run_python` call through the official MCP
client over stdio to `coderunner serve`, into a kernel inside bubblewrap. For the baseline it is
`execute` on a jupyter_client AsyncKernelClient to a plain (unsandboxed) ipykernel from the same
Python environment, waiting for the reply and the idle status, as a raw client would.

Cold: from asking for a new kernel to the first `1+1` result. CodeRunner: `create_session` then
`run_python`. Baseline: AsyncKernelManager.start_kernel, wait_for_ready, then execute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from jupyter_client.manager import AsyncKernelManager
from mcp import Client, StdioServerParameters

from coderunner.config import load_settings


def _passable(path: Path) -> Path:
    """A root server's sandbox user must be able to pass through the bench's temp dir."""
    path.chmod(0o711)
    return path


def summarize(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[int(len(ordered) * 0.9) - 1] * 1000,
        "min_ms": ordered[0] * 1000,
        "n": len(ordered),
    }


async def timed(count: int, call: Callable[[], Awaitable[None]]) -> list[float]:
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - began)
    return samples


# --- the raw baseline ---------------------------------------------------------------------------


def kernelspec_dir(python: Path, root: Path) -> Path:
    spec = root / "kernels" / "bench-python"
    spec.mkdir(parents=True)
    argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "bench", "language": "python"}))
    return root


async def raw_execute(client, code: str = "1+1") -> None:  # type: ignore[no-untyped-def]
    msg_id = client.execute(code)
    while True:
        msg = await client.get_iopub_msg(timeout=30)
        mine = msg["parent_header"].get("msg_id") == msg_id
        if mine and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while (await client.get_shell_msg(timeout=30))["parent_header"].get("msg_id") != msg_id:
        pass


async def raw_cold_start() -> float:
    began = time.perf_counter()
    manager = AsyncKernelManager(kernel_name="bench-python")
    await manager.start_kernel(stderr=subprocess.DEVNULL)
    client = manager.client()
    client.start_channels()
    await client.wait_for_ready(timeout=60)
    await raw_execute(client)
    elapsed = time.perf_counter() - began
    client.stop_channels()
    await manager.shutdown_kernel(now=True)
    return elapsed


async def raw_warm(calls: int) -> list[float]:
    manager = AsyncKernelManager(kernel_name="bench-python")
    await manager.start_kernel(stderr=subprocess.DEVNULL)
    client = manager.client()
    client.start_channels()
    await client.wait_for_ready(timeout=60)
    for _ in range(20):
        await raw_execute(client)
    samples = await timed(calls, lambda: raw_execute(client))
    client.stop_channels()
    await manager.shutdown_kernel(now=True)
    return samples


# --- CodeRunner through MCP over stdio ----------------------------------------------------------


def bench_env(root: Path, backend: str = "bwrap") -> dict[str, str]:
    """A bench server's whole environment: its own dirs, quiet logs, the backend's own settings."""
    env = {
        "CODERUNNER_BACKEND": backend,
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_LOG_LEVEL": "WARNING",
    }
    for key in ("CODERUNNER_SANDBOX_ENV", "CODERUNNER_OCI_RUNTIME", "CODERUNNER_IMAGE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def server_params(root: Path, backend: str = "bwrap") -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=bench_env(root, backend)
    )


async def mcp_run(client: Client, session_id: str | None = None) -> None:
    arguments: dict[str, object] = {"code": "1+1"}
    if session_id:
        arguments["session_id"] = session_id
    result = await client.call_tool("run_python", arguments)
    if result.is_error:
        raise RuntimeError(result.content)


async def coderunner(calls: int, colds: int, root: Path, backend: str) -> tuple[list[float], list[float]]:
    async with Client(server_params(root, backend), read_timeout_seconds=120) as client:
        for _ in range(20):
            await mcp_run(client)
        warm = await timed(calls, lambda: mcp_run(client))
        cold = []
        for _ in range(colds):
            began = time.perf_counter()
            created = await client.call_tool("create_session", {})
            session_id = json.loads(created.content[0].text)["session_id"]  # type: ignore[union-attr]
            await mcp_run(client, session_id)
            cold.append(time.perf_counter() - began)
            await client.call_tool("close_session", {"session_id": session_id})
    return warm, cold


async def main(calls: int, colds: int, backends: list[str]) -> None:
    settings = load_settings()
    root = _passable(Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp")))
    os.environ["JUPYTER_PATH"] = str(kernelspec_dir(settings.sandbox_env / "bin" / "python", root / "jupyter"))
    os.environ["JUPYTER_RUNTIME_DIR"] = str(root / "jupyter-runtime")
    ours: dict[str, tuple[list[float], list[float]]] = {}
    try:
        raw_w = await raw_warm(calls)
        raw_c = [await raw_cold_start() for _ in range(colds)]
        for backend in backends:
            ours[backend] = await coderunner(calls, colds, root / backend, backend)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = [("warm 1+1, raw jupyter_client", summarize(raw_w))]
    rows += [(f"warm 1+1, coderunner {backend}", summarize(warm)) for backend, (warm, _) in ours.items()]
    rows += [("cold start, raw jupyter_client", summarize(raw_c))]
    rows += [(f"cold start, coderunner {backend}", summarize(cold)) for backend, (_, cold) in ours.items()]
    print(f"{'measure':34} {'median ms':>10} {'p90 ms':>9} {'min ms':>9} {'n':>5}")
    for name, row in rows:
        print(f"{name:34} {row['median_ms']:10.2f} {row['p90_ms']:9.2f} {row['min_ms']:9.2f} {row['n']:5d}")
    raw_warm_row, raw_cold_row = summarize(raw_w), summarize(raw_c)
    for backend, (warm, cold) in ours.items():
        warm_row, cold_row = summarize(warm), summarize(cold)
        print(
            f"{backend}: warm {warm_row['median_ms'] / raw_warm_row['median_ms']:.2f}x raw "
            f"(p90 {warm_row['p90_ms'] / raw_warm_row['p90_ms']:.2f}x), "
            f"cold {cold_row['median_ms'] / raw_cold_row['median_ms']:.2f}x raw"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="warm round trips per side (at least 200)")
    parser.add_argument("--colds", type=int, default=10, help="cold starts per side")
    parser.add_argument(
        "--backend", action="append", choices=["bwrap", "podman", "docker", "apple"],
        help="CodeRunner backend(s) to measure (repeatable; default bwrap)",
    )  # fmt: skip
    args = parser.parse_args()
    anyio.run(main, max(args.calls, 200), args.colds, args.backend or ["bwrap"])
