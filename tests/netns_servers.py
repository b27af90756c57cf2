"""Test HTTP servers in a network namespace of the test's own, reachable from the host only.

One namespace, one veth pair, two plain-HTTP servers on port 80:
- `public`: an address in TEST-NET-2 (198.51.100.0/24), which the egress proxy treats as public;
- `private`: a 10.x address (RFC 1918), which the proxy must refuse even when it is allowlisted.

Each test module starts one (module-scoped fixture) and it is removed however the module ends.
The namespace is held by a process of ours (`unshare --net`), never named under /run/netns: the
first `ip netns add` on a machine bind-mounts /run/netns over itself, which hides the namespace
files of podman containers running at that moment.
Each server answers GET / with BODY and GET /bytes/N with N bytes (bounded), and closes. The
host side of the pair takes a /30 per server out of a per-process slot, so parallel test runs
(other worktrees) on this machine do not collide; a longer prefix wins any overlap with a wider
route someone else adds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

BODY = "egress-test-server-ok"
#: The largest /bytes/N answer.
MAX_BYTES = 64 * 2**20
START_TIMEOUT_S = 10.0

SERVER_CODE = r"""
import http.server, socketserver, sys
BODY, MAX = sys.argv[2].encode(), int(sys.argv[3])
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *args):
        pass
    def do_GET(self):
        if self.path.startswith("/bytes/"):
            size = min(int(self.path.split("/")[2]), MAX)
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            chunk = b"x" * 65536
            while size > 0:
                self.wfile.write(chunk[:size])
                size -= 65536
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)
class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
Server((sys.argv[1], 80), Handler).serve_forever()
"""


@dataclass(frozen=True)
class NetnsServers:
    namespace: str
    public_ip: str
    private_ip: str
    #: The host's own address on the pair (the proxy refuses it: it is one of the host's).
    host_ip: str


def available() -> str | None:
    """Why the servers cannot be made here, or None."""
    if os.getuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "needs iproute2 (ip) and util-linux (unshare, nsenter)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _inside(holder: int) -> list[str]:
    """argv prefix that runs a command in the namespace `holder` (a pid) keeps alive."""
    return ["nsenter", f"--net=/proc/{holder}/ns/net", "--"]


def _wait_listening(holder: int, address: str) -> None:
    """The server is up when a connect from inside its namespace succeeds."""
    probe = f"import socket; socket.create_connection(({address!r}, 80), timeout=1).close()"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        done = subprocess.run([*_inside(holder), sys.executable, "-c", probe], capture_output=True, timeout=10)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"test server {address} did not start: {done.stderr.decode()[-500:]}")
        time.sleep(0.05)


def _wait_unshared(pid: int) -> None:
    """Until `unshare` has made its namespace (its net ns differs from ours), bounded."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        if time.monotonic() > deadline:
            raise RuntimeError("unshare --net did not make a namespace")
        time.sleep(0.01)


@contextlib.contextmanager
def netns_servers() -> Iterator[NetnsServers]:
    slot = os.getpid() % 60  # /30 blocks 4*slot .. 4*slot+3 of each range (public one below .240)
    namespace = f"crn{os.getpid()}"
    host_if, ns_if = f"crh{os.getpid()}"[:15], f"crs{os.getpid()}"[:15]
    public_host, public = f"198.51.100.{4 * slot + 1}", f"198.51.100.{4 * slot + 2}"
    private_host, private = f"10.213.{slot}.1", f"10.213.{slot}.2"
    processes: list[subprocess.Popen[bytes]] = []
    holder = subprocess.Popen(
        ["unshare", "--net", "--", "sleep", "3600"],  # bounded, should we be killed
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_unshared(holder.pid)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", str(holder.pid))
        _ip("addr", "add", f"{public_host}/30", "dev", host_if)
        _ip("addr", "add", f"{private_host}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        for args in (
            ("addr", "add", f"{public}/30", "dev", ns_if),
            ("addr", "add", f"{private}/30", "dev", ns_if),
            ("link", "set", ns_if, "up"),
            ("link", "set", "lo", "up"),
        ):
            subprocess.run([*_inside(holder.pid), "ip", *args], check=True, capture_output=True, timeout=10)
        for address in (public, private):
            processes.append(
                subprocess.Popen(
                    [
                        *_inside(holder.pid),
                        sys.executable,
                        "-c",
                        SERVER_CODE,
                        address,
                        BODY,
                        str(MAX_BYTES),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for address in (public, private):
            _wait_listening(holder.pid, address)
        yield NetnsServers(namespace=namespace, public_ip=public, private_ip=private, host_ip=public_host)
    finally:
        for process in processes:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _ip("link", "del", host_if)
        holder.kill()  # the namespace (and the veth's other end) goes with its last process
        with contextlib.suppress(subprocess.TimeoutExpired):
            holder.wait(timeout=5)


def host_reaches(address: str) -> bool:
    """Whether the host itself reaches a server (a check that the fixture works, not the sandbox)."""
    with contextlib.suppress(OSError), socket.create_connection((address, 80), timeout=3):
        return True
    return False
