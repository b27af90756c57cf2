"""Warm `1+1` round trip on each way a client can reach CodeRunner, beside the raw baseline.

    .venv/bin/python bench/transports.py [--calls 300]

Same run, same machine: a raw jupyter_client + ipykernel round trip (see latency.py), then
`run_python` through the official MCP client over stdio, Streamable HTTP (with the bearer token),
legacy SSE, and through `coderunner proxy` (the client speaks stdio to the proxy, the proxy
speaks Streamable HTTP to a running server). The proxy's cost is its row minus the HTTP row.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx2
from latency import _passable, bench_env, kernelspec_dir, mcp_run, raw_warm, summarize, timed
from mcp import Client, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client

from coderunner.config import load_settings

TOKEN = secrets.token_urlsafe(32)
START_TIMEOUT_S = 60


def server_env(root: Path) -> dict[str, str]:
    return {**bench_env(root), "CODERUNNER_TOKEN": TOKEN, "CODERUNNER_TOKEN_FILE": str(root / "token")}


@contextlib.contextmanager
def http_server(root: Path, transport: str) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "coderunner.cli", "serve", "--transport", transport, "--port", str(port)],
        env=server_env(root),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{transport} server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/{'sse' if transport == 'sse' else 'mcp'}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


@contextlib.asynccontextmanager
async def connected(kind: str, root: Path) -> AsyncIterator[Client]:
    command = [sys.executable, "-m", "coderunner.cli"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    if kind == "stdio":
        params = StdioServerParameters(command=command[0], args=[*command[1:], "serve"], env=server_env(root))
        async with Client(params, read_timeout_seconds=120) as client:
            yield client
    elif kind == "sse":
        with http_server(root, "sse") as url:
            async with Client(sse_client(url, headers=auth), read_timeout_seconds=120) as client:
                yield client
    else:
        with http_server(root, "streamable-http") as url:
            if kind == "proxy":
                params = StdioServerParameters(
                    command=command[0], args=[*command[1:], "proxy", url], env=server_env(root)
                )
                async with Client(params, read_timeout_seconds=120) as client:
                    yield client
            else:
                async with (
                    httpx2.AsyncClient(headers=auth, timeout=httpx2.Timeout(30, read=None)) as http,
                    Client(streamable_http_client(url, http_client=http), read_timeout_seconds=120) as client,
                ):
                    yield client


async def warm(kind: str, calls: int, root: Path) -> list[float]:
    async with connected(kind, root) as client:
        for _ in range(20):
            await mcp_run(client)
        return await timed(calls, lambda: mcp_run(client))


async def main(calls: int) -> None:
    settings = load_settings()
    root = _passable(Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp")))
    os.environ["JUPYTER_PATH"] = str(kernelspec_dir(settings.sandbox_env / "bin" / "python", root / "jupyter"))
    os.environ["JUPYTER_RUNTIME_DIR"] = str(root / "jupyter-runtime")
    try:
        rows = [("raw jupyter_client", summarize(await raw_warm(calls)))]
        for kind in ("stdio", "streamable-http", "sse", "proxy"):
            rows.append((f"coderunner MCP {kind}", summarize(await warm(kind, calls, root))))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    raw = rows[0][1]["median_ms"]
    print(f"{'warm 1+1 round trip':34} {'median ms':>10} {'p90 ms':>9} {'min ms':>9} {'n':>5} {'x raw':>7}")
    for name, row in rows:
        ratio = row["median_ms"] / raw
        print(
            f"{name:34} {row['median_ms']:10.2f} {row['p90_ms']:9.2f} {row['min_ms']:9.2f} {row['n']:5d} {ratio:6.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="warm round trips per row (at least 100)")
    anyio.run(main, max(parser.parse_args().calls, 100))
