"""What the egress proxy costs: connection setup and a 50 MB download, proxy beside direct, one run.

    .venv/bin/python bench/egress.py [--rounds 8] [--requests 25] [--downloads 3] [--summary PATH]

Needs root (it makes a network namespace). The test server is a small HTTP server in a namespace
this script creates, reached over a veth pair on TEST-NET-2 (198.51.100.240/30: the host side is
.241, the server .242); it is torn down at the end, whatever happens.

Lanes, measured inside the sandboxes with the same client code (raw sockets, one connection per
request, timed from connect() to the last byte), interleaved round by round so all see the same load:
- allowlist/CONNECT: an `allowlist` session, through its forwarder (which hands each connection's
  socket to the host) and the host proxy (CONNECT tunnel, as HTTPS clients do);
- allowlist/forward: the same session, plain-HTTP forwarding (absolute-form GET, as for http:// URLs);
- internet/direct: an `internet` session, straight out (bwrap: through slirp4netns);
- host/direct: no sandbox, from this process, for reference;
- host/proxy socket: from this process straight to the allowlist session's proxy socket (CONNECT):
  the proxy's own share, without the in-sandbox forwarder (a plain client: bytes over the unix socket).
Setup cost is the median and p90 of a small request; throughput is a 50 MB body read and discarded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters
from summary import Figure, add_summary_argument, write_summary

HOST_IF, NS_IF = f"crbh{os.getpid() % 100000}", f"crbn{os.getpid() % 100000}"
HOST_IP, SERVER_IP, PREFIX = "198.51.100.241", "198.51.100.242", 30
PORT = 80
BIG = 50 * 2**20
SMALL_BODY = b"ok\n"

# --- the test server (runs inside the namespace: `bench/egress.py --serve`) ------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection: setup cost is what is measured

    def do_GET(self) -> None:
        size = BIG if self.path.startswith("/big") else len(SMALL_BODY)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        if size == len(SMALL_BODY):
            self.wfile.write(SMALL_BODY)
            return
        chunk = memoryview(bytes(2**20))
        for _ in range(size // len(chunk)):
            self.wfile.write(chunk)

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve() -> None:
    server = ThreadingHTTPServer(("0.0.0.0", PORT), _Handler)
    server.daemon_threads = True
    server.request_queue_size = 256
    print("listening", flush=True)
    server.serve_forever()


@contextlib.contextmanager
def namespace_server() -> Iterator[None]:
    """A namespace held by a process of ours (never named under /run/netns: a first `ip netns add`
    bind-mounts that dir over itself and hides running podman containers' namespaces), a veth pair
    and the server in it; all removed on the way out."""

    def ip(*args: str, inside: bool = False) -> None:
        prefix = ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"] if inside else []
        subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=10)

    holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "3600"], stdin=subprocess.DEVNULL)
    process = None
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            if time.monotonic() > deadline:
                raise RuntimeError("unshare --net did not make a namespace")
            time.sleep(0.01)
        ip("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF, "netns", str(holder.pid))
        ip("addr", "add", f"{HOST_IP}/{PREFIX}", "dev", HOST_IF)
        ip("link", "set", HOST_IF, "up")
        ip("addr", "add", f"{SERVER_IP}/{PREFIX}", "dev", NS_IF, inside=True)
        ip("link", "set", NS_IF, "up", inside=True)
        ip("link", "set", "lo", "up", inside=True)
        argv = ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--", sys.executable, __file__, "--serve"]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert process.stdout is not None
        if process.stdout.readline().strip() != b"listening":
            raise RuntimeError("the test server did not start")
        yield
    finally:
        if process is not None:
            process.kill()
            process.wait(timeout=10)
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, timeout=10)
        holder.kill()  # the namespace goes with its last process
        holder.wait(timeout=10)


# --- the client (the same source runs in the sandboxes and here) ----------------------------------

CLIENT = r'''
import os as _os, socket as _socket, time as _time

def _egress_fetch(host, port, path, mode, via=None):
    """One request on a fresh connection: (seconds from connect to last byte, body+head bytes).

    via: the proxy's unix socket (the host-side lane); else the proxy in HTTP_PROXY."""
    proxy = _os.environ.get("HTTP_PROXY", "").rpartition("/")[2]
    began = _time.perf_counter()
    if mode == "direct":
        sock = _socket.create_connection((host, port), timeout=60)
        target = path
    else:
        if via:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            sock.settimeout(60)
            sock.connect(via)
        else:
            phost, _, pport = proxy.rpartition(":")
            sock = _socket.create_connection((phost, int(pport)), timeout=60)
        target = f"http://{host}:{port}{path}" if mode == "forward" else path
        if mode == "connect":
            sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                if not chunk:
                    raise OSError("proxy closed the CONNECT")
                head += chunk
            if head.split(b" ", 2)[1] != b"200":
                raise OSError(head.decode(errors="replace")[:300])
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
    buffer = bytearray(256 * 1024)
    total, first = 0, b""
    while True:
        n = sock.recv_into(buffer)
        if not n:
            break
        if not first:
            first = bytes(buffer[:12])
        total += n
    sock.close()
    if b" 200" not in first:
        raise OSError(f"answer {first!r}")
    return _time.perf_counter() - began, total

def _egress_batch(host, port, path, mode, count, via=None):
    return [_egress_fetch(host, port, path, mode, via) for _ in range(count)]
'''


def local_batch(path: str, count: int, via: Path | None = None) -> list[tuple[float, int]]:
    """The host's own lanes: direct, or through the session's proxy socket (no forwarder hop)."""
    scope: dict[str, object] = {}
    exec(CLIENT, scope)
    mode, where = ("connect", str(via)) if via is not None else ("direct", None)
    return scope["_egress_batch"](SERVER_IP, PORT, path, mode, count, where)  # type: ignore[operator]


# --- the run ---------------------------------------------------------------------------------------


def server_params(root: Path) -> StdioServerParameters:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_TOOLS": "all",
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_ALLOWED_DOMAINS": json.dumps([SERVER_IP]),
        "CODERUNNER_EGRESS_AUDIT_LOG": str(root / "egress.jsonl"),
        "CODERUNNER_MAX_NETWORK": "internet",  # the internet/direct baseline lane
    }
    for key in (
        "PYTHONPATH",  # the checkout under test (bench runs use PYTHONPATH=src), not the venv's install
        "CODERUNNER_SANDBOX_ENV",
        "CODERUNNER_BACKEND",
        "CODERUNNER_OCI_RUNTIME",
        "CODERUNNER_IMAGE",
        "CODERUNNER_SESSION_CPU_WEIGHT",
    ):
        if key in os.environ:
            env[key] = os.environ[key]
    return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)


class Lanes:
    """Samples per lane: seconds per small request, MB/s per download."""

    def __init__(self) -> None:
        self.setup: dict[str, list[float]] = {}
        self.throughput: dict[str, list[float]] = {}

    def add(self, lane: str, kind: str, samples: list[tuple[float, int]]) -> None:
        if kind == "small":
            self.setup.setdefault(lane, []).extend(seconds for seconds, _ in samples)
            return
        for seconds, size in samples:
            if size < BIG:
                raise RuntimeError(f"{lane}: got {size:,} bytes of {BIG:,}")
            self.throughput.setdefault(lane, []).append(size / 2**20 / seconds)


async def main(rounds: int, requests: int, downloads: int) -> Lanes:
    if os.geteuid() != 0:
        raise SystemExit("bench/egress.py makes a network namespace: run it as root")
    root = Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp"))
    root.chmod(0o711)
    lanes = Lanes()
    try:
        with namespace_server():
            async with Client(server_params(root), read_timeout_seconds=600) as client:

                async def call(tool: str, arguments: dict[str, object]) -> str:
                    result = await client.call_tool(tool, arguments)
                    text = "\n".join(getattr(block, "text", "") for block in result.content)
                    if result.is_error:
                        raise RuntimeError(f"{tool}: {text}")
                    return text

                sessions = {}
                for network in ("allowlist", "internet"):
                    created = json.loads(await call("create_session", {"network": network}))
                    sessions[network] = created["session_id"]
                    await call("run_python", {"code": CLIENT, "session_id": sessions[network]})

                async def sandboxed(network: str, mode: str, path: str, count: int) -> list[tuple[float, int]]:
                    batch = f"_egress_batch({SERVER_IP!r}, {PORT}, {path!r}, {mode!r}, {count})"
                    code = f"print(__import__('json').dumps({batch}))"
                    text = await call("run_python", {"code": code, "session_id": sessions[network], "timeout_s": 600})
                    line = next(line for line in text.splitlines() if line.startswith("[["))
                    return [(seconds, size) for seconds, size in json.loads(line)]

                sockets = list((root / "r").glob("*/host/egress.sock"))
                if len(sockets) != 1:
                    raise RuntimeError(f"expected one proxy socket, found {sockets}")
                proxy_socket = sockets[0]
                plan = [
                    ("allowlist/CONNECT", "allowlist", "connect"),
                    ("allowlist/forward", "allowlist", "forward"),
                    ("internet/direct", "internet", "direct"),
                ]
                for _lane, network, mode in plan:  # warm-up, not counted
                    await sandboxed(network, mode, "/small", 3)
                for round_number in range(rounds):
                    order = plan if round_number % 2 == 0 else plan[::-1]
                    for lane, network, mode in order:
                        lanes.add(lane, "small", await sandboxed(network, mode, "/small", requests))
                    lanes.add("host/direct", "small", await anyio.to_thread.run_sync(local_batch, "/small", requests))
                    proxied = await anyio.to_thread.run_sync(local_batch, "/small", requests, proxy_socket)
                    lanes.add("host/proxy socket", "small", proxied)
                for round_number in range(downloads):
                    order = plan if round_number % 2 == 0 else plan[::-1]
                    for lane, network, mode in order:
                        lanes.add(lane, "big", await sandboxed(network, mode, "/big", 1))
                    lanes.add("host/direct", "big", await anyio.to_thread.run_sync(local_batch, "/big", 1))
                    lanes.add(
                        "host/proxy socket", "big", await anyio.to_thread.run_sync(local_batch, "/big", 1, proxy_socket)
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(lanes)
    return lanes


def report(lanes: Lanes) -> None:
    direct = statistics.median(lanes.setup["internet/direct"])
    print(f"\nconnection setup + small request ({len(lanes.setup['internet/direct'])} per lane, interleaved)")
    print(f"{'lane':20} {'median ms':>10} {'p90 ms':>8} {'vs internet':>12}")
    for lane, samples in lanes.setup.items():
        ordered = sorted(samples)
        median, p90 = statistics.median(ordered), ordered[int(len(ordered) * 0.9) - 1]
        print(f"{lane:20} {median * 1000:10.2f} {p90 * 1000:8.2f} {(median - direct) * 1000:+11.2f}")
    print(f"\n50 MB download ({len(lanes.throughput['internet/direct'])} per lane, interleaved)")
    print(f"{'lane':20} {'median MB/s':>12} {'min MB/s':>9}")
    for lane, samples in lanes.throughput.items():
        print(f"{lane:20} {statistics.median(samples):12.0f} {min(samples):9.0f}")


def figures(lanes: Lanes) -> list[Figure]:
    """Issue 29 item 5: the allowlist at least 0.8x direct throughput, at most +1 ms to open a connection."""
    direct_mb = statistics.median(lanes.throughput["internet/direct"])
    direct_ms = statistics.median(lanes.setup["internet/direct"]) * 1000
    out = []
    for lane in ("allowlist/CONNECT", "allowlist/forward"):
        mb = statistics.median(lanes.throughput[lane])
        out.append(Figure(f"{lane} 50 MB download, median", round(mb), "MB/s", baseline=round(direct_mb),
                          baseline_name="internet/direct", target=">= 0.8x", met=mb >= 0.8 * direct_mb))  # fmt: skip
    for lane in ("allowlist/CONNECT", "allowlist/forward"):
        ms = statistics.median(lanes.setup[lane]) * 1000
        out.append(Figure(f"{lane} connect + small request, median", round(ms, 2), "ms", baseline=round(direct_ms, 2),
                          baseline_name="internet/direct", target="<= +1 ms", met=ms <= direct_ms + 1.0))  # fmt: skip
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of small requests (lanes alternate)")
    parser.add_argument("--requests", type=int, default=25, help="small requests per lane and round")
    parser.add_argument("--downloads", type=int, default=3, help="50 MB downloads per lane")
    add_summary_argument(parser)
    arguments = parser.parse_args()
    if arguments.serve:
        serve()
    else:
        started, load = time.monotonic(), os.getloadavg()[0]
        measured = anyio.run(main, arguments.rounds, arguments.requests, arguments.downloads)
        print(f"\n(run took {time.monotonic() - started:.0f}s; load average {load:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs)")  # fmt: skip
        write_summary(arguments.summary, "egress", figures(measured))
