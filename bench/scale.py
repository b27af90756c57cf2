"""Concurrency and density: many clients and many sessions, each beside a baseline from the same run.

    .venv/bin/python bench/scale.py [--sessions 50] [--clients 8] [--calls 400] [--rounds 20] [--raw 10]
                                    [--only concurrency] [--baseline-src /tmp/base/src] [--summary out.json]

1. Concurrency: `--clients` MCP clients over streamable HTTP to one `coderunner serve`, each with
   its own session, all running `1+1` at once; beside it the same number of raw ipykernels
   (jupyter_client, unsandboxed) driven at once from one process, and with --baseline-src the same
   clients to a server from another tree (before/after). Rounds run the lanes in a fresh random order.
   Prints throughput (calls/s), per-call p50/p99, and each server's CPU time per call (/proc).
   The sessions run at CPU weight `--cpu-weight` (100, as the raw kernels; the server's default 20
   lets other load on the machine delay them, which is its purpose, not the server's cost).
   `--only concurrency` runs just this part (about a minute).
2. Density: `--sessions` idle sessions (each ran `1+1`); PSS of every process in each sandbox
   (/proc/PID/smaps_rollup, bwrap included) per session, beside the PSS of `--raw` idle raw
   ipykernels alive at the same time (same Python environment, so shared pages are shared alike).
   Also the host's MemAvailable drop per session. Derives idle sessions per GiB.
3. Start-up of `--sessions` sessions, one create_session after another, with the warm pool
   (default pool_size) and without (pool_size=0); two servers, lanes alternating session by session.
4. create_session to first `1+1` result, with and without the pool, interleaved: `--rounds` rounds,
   each a create+run+close on each server, with a pause between rounds (an agent's think time,
   in which the pool refills). Anchor lane: one warm `run_python` into an existing session (the
   floor: a pooled create-to-first-result is two MCP round trips).
3b. (burst) the same starts back to back on each server in turn: the pool's refill has no pause.
Runs on a small machine with `--sessions 10 --clients 4`; every figure says what it was measured on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx2
from jupyter_client.manager import AsyncKernelManager
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from coderunner.config import load_settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import cpu_seconds, own_src
from summary import Figure, add_summary_argument, write_summary

TOKEN = "bench-" + secrets.token_hex(16)
#: Pause between create-to-first-result rounds: the think time in which a pool refills.
THINK_S = 1.5


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] * 1000


def row(name: str, samples: list[float]) -> str:
    return (
        f"{name:44} p50 {pct(samples, 0.5):8.2f} ms  p90 {pct(samples, 0.9):8.2f}  p99 {pct(samples, 0.99):8.2f}"
        f"  n {len(samples)}"
    )


# --- servers and clients --------------------------------------------------------------------------


def bench_env(root: Path, **extra: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_TOKEN_FILE": str(root / "token"),
        "CODERUNNER_TOKEN": TOKEN,
        "CODERUNNER_LOG_LEVEL": "WARNING",
        "CODERUNNER_TOOLS": "all",  # the bench calls sessions, one-shots and snapshots too
        "CODERUNNER_EXPORT_DIR": "",
        "PYTHONPATH": str(own_src()),  # this checkout's server, not whatever the venv has installed
    }
    for key in ("CODERUNNER_SANDBOX_ENV", "CODERUNNER_BACKEND", "CODERUNNER_OCI_RUNTIME", "CODERUNNER_IMAGE"):
        if key in os.environ:
            env[key] = os.environ[key]
    env.update(extra)
    return env


def stdio_server(root: Path, **extra: str) -> Client:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=bench_env(root, **extra)
    )
    return Client(params, read_timeout_seconds=300)


@contextlib.contextmanager
def http_server(root: Path, **extra: str) -> Iterator[tuple[str, int]]:
    """A `coderunner serve` over streamable HTTP: its MCP URL and its pid."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "coderunner.cli", "serve", "--transport", "streamable-http", "--port", str(port)],
        env=bench_env(root, **extra),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the bench server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp", process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@contextlib.asynccontextmanager
async def http_client(url: str, name: str) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {TOKEN}", "X-CodeRunner-Client": name}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=None)) as http,
        Client(streamable_http_client(url, http_client=http), read_timeout_seconds=300) as client,
    ):
        yield client


async def call(client: Client, tool: str, **arguments: object) -> str:
    result = await client.call_tool(tool, arguments)
    text = "".join(getattr(block, "text", "") for block in result.content)
    if result.is_error:
        raise RuntimeError(f"{tool}: {text}")
    return text


async def create(client: Client) -> str:
    return json.loads(await call(client, "create_session"))["session_id"]


# --- the raw baseline -------------------------------------------------------------------------------


def kernelspec(python: Path, root: Path) -> None:
    spec = root / "kernels" / "bench-python"
    spec.mkdir(parents=True)
    argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "bench", "language": "python"}))
    os.environ["JUPYTER_PATH"] = str(root)
    os.environ["JUPYTER_RUNTIME_DIR"] = str(root / "runtime")


class RawKernel:
    async def start(self) -> RawKernel:
        self.manager = AsyncKernelManager(kernel_name="bench-python")
        await self.manager.start_kernel(stderr=subprocess.DEVNULL)
        self.client = self.manager.client()
        self.client.start_channels()
        await self.client.wait_for_ready(timeout=120)
        return self

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid  # type: ignore[union-attr]

    async def run(self, code: str = "1+1") -> None:
        msg_id = self.client.execute(code)
        while True:
            msg = await self.client.get_iopub_msg(timeout=60)
            mine = msg["parent_header"].get("msg_id") == msg_id
            if mine and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        while (await self.client.get_shell_msg(timeout=60))["parent_header"].get("msg_id") != msg_id:
            pass

    async def stop(self) -> None:
        self.client.stop_channels()
        await self.manager.shutdown_kernel(now=True)


# --- /proc ------------------------------------------------------------------------------------------


def pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as handle:
                found.extend(int(child) for child in handle.read().split())
    return found


def tree(pid: int) -> list[int]:
    pids, pending = [], [pid]
    while pending:
        current = pending.pop()
        pids.append(current)
        pending.extend(children(current))
    return pids


def sandbox_roots(runtime: Path) -> list[int]:
    """The outermost process of each sandbox of the server whose runtime dir is `runtime`."""
    marker = str(runtime).encode()
    mine = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                    mine.add(int(entry))
    roots = []
    for pid in mine:
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent not in mine:
                roots.append(pid)
    return roots


def mem_available_mb() -> float:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


# --- 1. concurrency ---------------------------------------------------------------------------------


async def concurrency(
    root: Path, clients: int, calls: int, rounds: int, cpu_weight: int, baseline: Path | None
) -> list[Figure]:
    per_round = max(calls // rounds, 5)
    env = {
        "CODERUNNER_MAX_SESSIONS": str(clients + 4),
        "CODERUNNER_POOL_SIZE": "0",
        "CODERUNNER_SESSION_CPU_WEIGHT": str(cpu_weight),
    }
    servers = {"coderunner": own_src()}
    if baseline is not None:
        servers["baseline"] = baseline
    samples: dict[str, list[float]] = {name: [] for name in [*servers, "raw"]}
    walls = dict.fromkeys(samples, 0.0)
    cpu = dict.fromkeys(servers, 0.0)
    async with contextlib.AsyncExitStack() as stack:
        runners: dict[str, list] = {}  # type: ignore[type-arg]
        pids: dict[str, int] = {}
        for name, src in servers.items():
            url, pids[name] = stack.enter_context(http_server(root / f"conc-{name}", PYTHONPATH=str(src), **env))
            conns = [await stack.enter_async_context(http_client(url, f"bench-{i}")) for i in range(clients)]
            for conn in conns:  # each client's default session, started and warm
                for _ in range(5):
                    await call(conn, "run_python", code="1+1")
            runners[name] = [lambda c=conn: call(c, "run_python", code="1+1") for conn in conns]
        kernels = [await RawKernel().start() for _ in range(clients)]
        stack.push_async_callback(lambda: _stop_all(kernels))
        for kernel in kernels:
            for _ in range(5):
                await kernel.run()
        runners["raw"] = [kernel.run for kernel in kernels]

        async def lane(name: str) -> None:
            async def one(runner) -> None:  # type: ignore[no-untyped-def]
                for _ in range(per_round):
                    began = time.perf_counter()
                    await runner()
                    samples[name].append(time.perf_counter() - began)

            began, cpu_began = time.perf_counter(), cpu_seconds(pids.get(name))
            async with anyio.create_task_group() as tg:
                for runner in runners[name]:
                    tg.start_soon(one, runner)
            walls[name] += time.perf_counter() - began
            if name in cpu:
                cpu[name] += cpu_seconds(pids.get(name)) - cpu_began

        for _ in range(rounds):
            for name in random.sample(list(runners), len(runners)):
                await lane(name)
    rate = {name: len(samples[name]) / walls[name] for name in samples}
    print(f"\n1. {clients} clients at once, `1+1` each in its own session ({rounds} shuffled rounds; "
          f"sessions at CPU weight {cpu_weight}; load {os.getloadavg()[0]:.2f})")  # fmt: skip
    for name in servers:
        print(row(f"{name}, {clients} MCP clients (HTTP)", samples[name]))
    print(row(f"raw ipykernel, {clients} kernels", samples["raw"]))
    for name in servers:
        print(
            f"   {name}: {rate[name]:.0f} calls/s against raw {rate['raw']:.0f} ({rate[name] / rate['raw']:.2f}x); "
            f"p50 {pct(samples[name], 0.5) / pct(samples['raw'], 0.5):.2f}x raw; "
            f"server CPU {cpu[name] / len(samples[name]) * 1000:.2f} ms per call"
        )
    figures = []
    for name in servers:
        ours = name == "coderunner"  # the baseline tree's figures are for comparison: no target of their own
        label, notes = ("", "") if ours else (f" ({name})", f"the server of {servers[name]}")
        p99 = pct(samples[name], 0.99)
        figures += [
            Figure(f"{clients} HTTP clients at once, calls/s{label}", round(rate[name], 1), "calls/s",
                   baseline=round(rate["raw"], 1), baseline_name=f"{clients} raw kernels at once",
                   target=">= 0.9x" if ours else "", met=rate[name] >= 0.9 * rate["raw"] if ours else None,
                   notes=notes),
            Figure(f"{clients} HTTP clients at once, p99{label}", round(p99, 1), "ms",
                   baseline=round(pct(samples["raw"], 0.99), 1), baseline_name=f"{clients} raw kernels at once",
                   target="< 100 ms" if ours else "", met=p99 < 100 if ours else None, notes=notes),
        ]  # fmt: skip
    return figures


async def _stop_all(kernels: list[RawKernel]) -> None:
    for kernel in kernels:
        await kernel.stop()


# --- 2 and 3. density and start-up of many -------------------------------------------------------


async def many(root: Path, sessions: int, raw_count: int) -> None:
    pool_size = load_settings().pool_size
    limits = {"CODERUNNER_MAX_SESSIONS": str(sessions + pool_size + 1)}
    pooled_root, cold_root = root / "pooled", root / "cold"
    starts: dict[str, list[float]] = {"pool": [], "cold": []}
    walls = {"pool": 0.0, "cold": 0.0}
    async with (
        stdio_server(pooled_root, **limits) as pooled,
        stdio_server(cold_root, CODERUNNER_POOL_SIZE="0", **limits) as cold,
    ):
        await call(pooled, "manage_sessions", action="list")
        await call(cold, "manage_sessions", action="list")
        await anyio.sleep(5)  # the pool's first fill, as on a server that has been up a moment
        available_before = mem_available_mb()
        for _ in range(sessions):
            for name, client in (("pool", pooled), ("cold", cold)):
                began = time.perf_counter()
                session_id = await create(client)
                await call(client, "run_python", code="1+1", session_id=session_id)
                took = time.perf_counter() - began
                starts[name].append(took)
                walls[name] += took
        await anyio.sleep(3)  # let both settle (the pool's refill included)
        available_after = mem_available_mb()
        per_session = []
        for runtime in (pooled_root / "r", cold_root / "r"):
            for pid in sandbox_roots(runtime):
                per_session.append(sum(pss_kb(p) for p in tree(pid)) / 1024)
        raws = [await RawKernel().start() for _ in range(raw_count)]
        for kernel in raws:
            await kernel.run()
        await anyio.sleep(1)
        raw_pss = [sum(pss_kb(p) for p in tree(kernel.pid)) / 1024 for kernel in raws]
        for kernel in raws:
            await kernel.stop()
    live = 2 * sessions + pool_size  # both servers' sessions and the pool's idle members
    mean = statistics.mean(per_session)
    raw_mean = statistics.mean(raw_pss)
    drop = (available_before - available_after) / (2 * sessions)
    print(f"\n2. {len(per_session)} idle sandboxes alive ({2 * sessions} sessions on two servers, the pool's too)")
    print(
        f"   PSS per session (every process in its sandbox): mean {mean:.1f} MiB, "
        f"median {statistics.median(per_session):.1f}, max {max(per_session):.1f}  (n {len(per_session)})"
    )
    print(f"   PSS per raw ipykernel, {raw_count} alive at once: mean {raw_mean:.1f} MiB  ({mean / raw_mean:.2f}x)")
    print(f"   host MemAvailable drop per session: {drop:.1f} MiB (servers' own share included; {live} sandboxes)")
    print(f"   => about {1024 / max(mean, drop):.0f} idle sessions per GiB "
          f"(by the larger of PSS and MemAvailable drop)")  # fmt: skip
    print(f"\n3. {sessions} sessions started one after another (create_session + first `1+1`), lanes alternating")
    print(row(f"pool_size={pool_size}", starts["pool"]) + f"  total {walls['pool']:.1f} s")
    print(row("pool_size=0 (cold)", starts["cold"]) + f"  total {walls['cold']:.1f} s")


async def burst(root: Path, sessions: int) -> None:
    """Section 3 without think time: each server starts its sessions back to back, the pool's
    refill competing with them (the lanes cannot interleave: the gap would be the think time)."""
    pool_size = load_settings().pool_size
    limits = {"CODERUNNER_MAX_SESSIONS": str(sessions + pool_size + 1)}
    totals: dict[str, list[float]] = {}
    for name, extra in (("cold", {"CODERUNNER_POOL_SIZE": "0"}), ("pool", {})):
        async with stdio_server(root / f"b{name}", **limits, **extra) as client:
            await call(client, "manage_sessions", action="list")
            await anyio.sleep(5)  # the pool's first fill
            samples = []
            for _ in range(sessions):
                began = time.perf_counter()
                session_id = await create(client)
                await call(client, "run_python", code="1+1", session_id=session_id)
                samples.append(time.perf_counter() - began)
            totals[name] = samples
    print(f"\n3b. {sessions} sessions back to back on one server (no pause), cold lane first")
    print(row(f"pool_size={pool_size}", totals["pool"]) + f"  total {sum(totals['pool']):.1f} s")
    print(row("pool_size=0 (cold)", totals["cold"]) + f"  total {sum(totals['cold']):.1f} s")


# --- 4. create to first result --------------------------------------------------------------------


async def first_result(root: Path, rounds: int) -> None:
    samples: dict[str, list[float]] = {"pool": [], "cold": [], "warm": []}
    async with (
        stdio_server(root / "fp") as pooled,
        stdio_server(root / "fc", CODERUNNER_POOL_SIZE="0") as cold,
    ):
        for client in (pooled, cold):
            await call(client, "run_python", code="1+1")  # the default session: both servers warm
        await anyio.sleep(THINK_S * 2)
        for index in range(rounds):
            lanes = [("pool", pooled), ("cold", cold), ("warm", pooled)]
            random.Random(index).shuffle(lanes)
            for name, client in lanes:
                began = time.perf_counter()
                if name == "warm":  # the floor: one MCP round trip into a session that exists
                    await call(client, "run_python", code="1+1")
                    samples[name].append(time.perf_counter() - began)
                    continue
                session_id = await create(client)
                await call(client, "run_python", code="1+1", session_id=session_id)
                samples[name].append(time.perf_counter() - began)
                await call(client, "manage_sessions", action="close", session_id=session_id)
            await anyio.sleep(THINK_S)
    print(f"\n4. create_session to first `1+1` result, {rounds} shuffled rounds, {THINK_S:g} s between rounds")
    print(row("warm pool", samples["pool"]))
    print(row("pool_size=0 (cold)", samples["cold"]))
    print(row("anchor: warm `1+1` in an existing session", samples["warm"]))
    print(f"   pool / cold p50: {pct(samples['pool'], 0.5) / pct(samples['cold'], 0.5):.3f}x")


async def main(args: argparse.Namespace) -> None:
    settings = load_settings()
    root = Path(tempfile.mkdtemp(prefix="crs-", dir="/tmp"))
    root.chmod(0o711)  # a root server's sandbox users pass through
    kernelspec(settings.sandbox_env / "bin" / "python", root / "jupyter")
    print(f"machine: {os.cpu_count()} cores, {mem_available_mb():.0f} MiB available, load {os.getloadavg()[0]:.2f}")
    figures: list[Figure] = []
    try:
        if "first" in args.only:
            await first_result(root, args.rounds)
        if "concurrency" in args.only:
            figures += await concurrency(root, args.clients, args.calls, args.rounds, args.cpu_weight, args.baseline)
        if "many" in args.only:
            await many(root, args.sessions, args.raw)
        if "burst" in args.only:
            await burst(root, args.sessions)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_summary(args.summary, "scale", figures)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=50, help="idle sessions per lane (density, start-up)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--calls", type=int, default=400, help="`1+1` calls per client, over all rounds")
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds (concurrency, first result)")
    parser.add_argument("--raw", type=int, default=10, help="raw ipykernels alive beside the sessions")
    parser.add_argument(
        "--only", action="append", choices=["first", "concurrency", "many", "burst"], help="run only these parts"
    )
    parser.add_argument(
        "--cpu-weight", type=int, default=100,
        help="concurrency: sessions' CPU weight (server default 20); 100 schedules them like the raw kernels",
    )  # fmt: skip
    parser.add_argument("--baseline-src", dest="baseline", type=Path, help="concurrency: also another tree's server")
    add_summary_argument(parser)
    parsed = parser.parse_args()
    parsed.baseline = parsed.baseline.resolve() if parsed.baseline else None
    parsed.only = parsed.only or ["first", "concurrency", "many", "burst"]
    anyio.run(main, parsed)
