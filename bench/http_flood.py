"""HTTP latency with and without a flood of half-open connections, lanes interleaved.

    .venv/bin/python bench/http_flood.py [--flood 1500] [--rounds 4] [--probes 25] [--nofile 1024] [--src DIR]

The flood: N loopback connections that connect and never send a request head (the cheapest
attack on an HTTP server: no token is needed to open a connection). The server runs with
RLIMIT_NOFILE at --nofile (1024 is the usual default), so a flood larger than that is what
filled the descriptors before connections were bounded. Each probe is a fresh connection
asking /health, then an authenticated MCP `initialize` (timeout 5 s each: a timed-out probe
counts as 5 s and as failed). Rounds alternate
the quiet lane and the flood lane. --src runs another source tree's server (e.g. an older
commit exported with `git archive`) to measure before and after on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2

PROBE_TIMEOUT_S = 5.0
TOKEN = "bench-token-" + "0" * 32
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}},
}
MCP_HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "Authorization": f"Bearer {TOKEN}",
}
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(src: Path, nofile: int) -> Iterator[int]:
    root = Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp"))
    root.chmod(0o711)
    port = _free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(src),
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_TOOLS": "all",
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_TOKEN": TOKEN,
        "CODERUNNER_LOG_LEVEL": "ERROR",
    }
    for key in ("CODERUNNER_SANDBOX_ENV", "CODERUNNER_BACKEND"):
        if key in os.environ:
            env[key] = os.environ[key]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    argv = [sys.executable, "-m", "coderunner.cli", "serve", "--transport", "streamable-http", "--port", str(port)]
    process = subprocess.Popen(argv, env=env, preexec_fn=limit, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while probe(port)[1] is False:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        shutil.rmtree(root, ignore_errors=True)


def probe(port: int) -> tuple[float, bool]:
    began = time.perf_counter()
    try:
        ok = httpx2.get(f"http://127.0.0.1:{port}/health", timeout=PROBE_TIMEOUT_S).status_code == 200
    except httpx2.HTTPError:
        ok = False
    return (time.perf_counter() - began if ok else PROBE_TIMEOUT_S), ok


def probe_authenticated(port: int) -> tuple[float, bool]:
    began = time.perf_counter()
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        ok = httpx2.post(url, json=INITIALIZE, headers=MCP_HEADERS, timeout=PROBE_TIMEOUT_S).status_code == 200
    except httpx2.HTTPError:
        ok = False
    return (time.perf_counter() - began if ok else PROBE_TIMEOUT_S), ok


@contextlib.contextmanager
def flood(port: int, count: int) -> Iterator[int]:
    """`count` half-open connections (bounded: 2 s to connect each); yields how many connected."""
    sockets = []
    try:
        for _ in range(count):
            with contextlib.suppress(OSError):
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        yield len(sockets)
    finally:
        for sock in sockets:
            sock.close()


def summary(samples: list[tuple[float, bool]]) -> str:
    times = sorted(t * 1000 for t, _ in samples)
    failed = sum(not ok for _, ok in samples)
    p95 = times[max(int(len(times) * 0.95) - 1, 0)]
    return f"p50 {statistics.median(times):8.1f} ms   p95 {p95:8.1f} ms   failed {failed}/{len(samples)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=1500, help="half-open connections (at most 5000)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--probes", type=int, default=25, help="/health probes per lane and round")
    parser.add_argument("--nofile", type=int, default=1024, help="the server's RLIMIT_NOFILE")
    parser.add_argument("--src", type=Path, default=REPO / "src", help="source tree the server runs from")
    args = parser.parse_args()
    lanes: dict[str, list[tuple[float, bool]]] = {
        "/health, quiet": [],
        "/health, flooded": [],
        "initialize with token, quiet": [],
        "initialize with token, flooded": [],
    }
    connected = []
    with server(args.src.resolve(), args.nofile) as port:
        for _ in range(args.rounds):
            lanes["/health, quiet"] += [probe(port) for _ in range(args.probes)]
            lanes["initialize with token, quiet"] += [probe_authenticated(port) for _ in range(args.probes)]
            with flood(port, min(args.flood, 5000)) as opened:
                connected.append(opened)
                lanes["/health, flooded"] += [probe(port) for _ in range(args.probes)]
                lanes["initialize with token, flooded"] += [probe_authenticated(port) for _ in range(args.probes)]
            time.sleep(1)  # let the server see the flood's connections close
    print(f"server from {args.src}, RLIMIT_NOFILE {args.nofile}, flood {args.flood} half-open connections "
          f"(connected per round: {connected})")  # fmt: skip
    for name, samples in lanes.items():
        print(f"  {name:32} {summary(samples)}")


if __name__ == "__main__":
    main()
