"""The kernel channels' cost and bound: warm `1+1`, cold start, and server RSS under an IOPub flood.

    .venv/bin/python bench/kernel_channels.py [--baseline-src /path/to/other/checkout/src] [--rounds 6]

Each lane is a `coderunner serve` over stdio (bwrap). With --baseline-src a second lane runs the
same server from another source tree (PYTHONPATH), e.g. `git archive main src | tar -x -C /tmp/main`;
the lanes are interleaved round by round so that the shared machine's noise falls on both.

The flood: a kernel thread publishes MESSAGES messages of FRAMES frames of FRAME_MB MiB each on
its own IOPub socket, signed, after its cell returned (nobody reads), then one call waits for it.
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

sys.path.insert(0, str(Path(__file__).parent))
from latency import _passable, bench_env

FRAME_MB, FRAMES, MESSAGES = 30, 4, 20
FLOOD = f"""
import threading, time
_k = get_ipython().kernel
_big = b'F' * ({FRAME_MB} << 20)
flood_done = threading.Event()
def _flood():
    time.sleep(0.5)
    for _ in range({MESSAGES}):
        msg = _k.session.msg('display_data', content={{'data': {{'text/plain': 'flood'}}, 'metadata': {{}}}})
        _k.iopub_socket.send_multipart([b'display_data', *_k.session.serialize(msg), *[_big] * {FRAMES}], copy=False)
    flood_done.set()
threading.Thread(target=_flood, daemon=True).start()
"""
#: Tiny messages as fast as the kernel can publish them, for SPAM_S seconds, between calls.
SPAM_S = 20
SPAM = f"""
import threading, time
_k = get_ipython().kernel
def _spam():
    msg = _k.session.msg('stream', content={{'name': 'stdout', 'text': 'x'}})
    frames = [b'stream', *_k.session.serialize(msg)]  # the same signed message again and again
    time.sleep(0.5)  # after the cell has returned
    end = time.monotonic() + {SPAM_S}
    while time.monotonic() < end:
        _k.iopub_socket.send_multipart(frames)
threading.Thread(target=_spam, daemon=True).start()
"""


class Lane:
    def __init__(self, name: str, root: Path, source: str | None) -> None:
        self.name, self.root, self.source = name, root, source
        self.warm: list[float] = []
        self.cold: list[float] = []

    def params(self) -> StdioServerParameters:
        env = bench_env(self.root)
        if self.source:
            env["PYTHONPATH"] = self.source
        return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)

    def server_pid(self) -> int:
        needle = str(self.root / "r").encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if needle in environ and b"serve" in cmdline and b"bwrap" not in cmdline:
                return int(entry)
        raise RuntimeError("server process not found")


async def call(client: Client, code: str, session_id: str | None = None, timeout_s: float = 60) -> str:
    arguments: dict[str, object] = {"code": code, "timeout_s": timeout_s}
    if session_id:
        arguments["session_id"] = session_id
    result = await client.call_tool("run_python", arguments)
    text = "".join(getattr(block, "text", "") for block in result.content)
    if result.is_error:
        raise RuntimeError(text)
    return text


def status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


async def flood(lane: Lane, client: Client) -> str:
    pid = lane.server_pid()
    created = await client.call_tool("create_session", {})
    session = json.loads(created.content[0].text)["session_id"]  # type: ignore[union-attr]
    await call(client, "1", session)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from here on
    before = status_mb(pid, "VmRSS")
    await call(client, FLOOD, session)
    await anyio.sleep(3)
    between = status_mb(pid, "VmRSS")
    await call(client, "flood_done.wait(120)", session, timeout_s=150)
    peak = status_mb(pid, "VmHWM")
    await client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    return f"RSS {before:.0f} MiB before, {between:.0f} MiB between calls, peak {peak:.0f} MiB"


async def spam(client: Client, calls: int) -> str:
    """A bystander's warm 1+1 (the default session) while another session's kernel spams."""
    created = await client.call_tool("create_session", {})
    session = json.loads(created.content[0].text)["session_id"]  # type: ignore[union-attr]
    quiet = []
    for _ in range(calls):
        began = time.perf_counter()
        await call(client, "1+1")
        quiet.append(time.perf_counter() - began)
    await call(client, SPAM, session)
    await anyio.sleep(1)
    noisy = []
    for _ in range(calls):
        began = time.perf_counter()
        await call(client, "1+1")
        noisy.append(time.perf_counter() - began)
    await client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    return (
        f"bystander 1+1 median {statistics.median(quiet) * 1000:.2f} ms quiet, "
        f"{statistics.median(noisy) * 1000:.2f} ms while another kernel spams tiny IOPub messages"
    )


async def main(rounds: int, calls: int, baseline: str | None) -> None:
    root = _passable(Path(tempfile.mkdtemp(prefix="crk-", dir="/tmp")))
    lanes = [Lane("this tree", root / "this", None)]
    if baseline:
        lanes.append(Lane("baseline", root / "base", baseline))
    floods: dict[str, str] = {}
    spams: dict[str, str] = {}
    try:
        async with Client(lanes[0].params(), read_timeout_seconds=300) as first:
            clients = [first]
            if len(lanes) > 1:
                second = Client(lanes[1].params(), read_timeout_seconds=300)
                await second.__aenter__()
                clients.append(second)
            try:
                for client in clients:
                    for _ in range(20):
                        await call(client, "1+1")
                for _ in range(rounds):
                    for lane, client in zip(lanes, clients, strict=True):
                        for _ in range(calls):
                            began = time.perf_counter()
                            await call(client, "1+1")
                            lane.warm.append(time.perf_counter() - began)
                        began = time.perf_counter()
                        created = await client.call_tool("create_session", {})
                        session = json.loads(created.content[0].text)["session_id"]  # type: ignore[union-attr]
                        await call(client, "1+1", session)
                        lane.cold.append(time.perf_counter() - began)
                        await client.call_tool("manage_sessions", {"action": "close", "session_id": session})
                for lane, client in zip(lanes, clients, strict=True):
                    floods[lane.name] = await flood(lane, client)
                for lane, client in zip(lanes, clients, strict=True):
                    spams[lane.name] = await spam(client, calls)
            finally:
                if len(clients) > 1:
                    await clients[1].__aexit__(None, None, None)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'lane':12} {'warm median ms':>15} {'warm p90 ms':>12} {'cold median ms':>15} {'n warm':>7} {'n cold':>7}")
    for lane in lanes:
        warm, cold = sorted(lane.warm), sorted(lane.cold)
        print(
            f"{lane.name:12} {statistics.median(warm) * 1000:15.2f} {warm[int(len(warm) * 0.9) - 1] * 1000:12.2f} "
            f"{statistics.median(cold) * 1000:15.1f} {len(warm):7d} {len(cold):7d}"
        )
    for name, figure in floods.items():
        print(f"IOPub flood {MESSAGES} x {FRAMES} x {FRAME_MB} MiB, {name}: {figure}")
    for name, figure in spams.items():
        print(f"{name}: {figure}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", help="another checkout's src dir, run as the second lane")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (one cold start each)")
    parser.add_argument("--calls", type=int, default=50, help="warm calls per lane per round")
    args = parser.parse_args()
    anyio.run(main, args.rounds, args.calls, args.baseline_src)
