"""Latency of CodeRunner beside two anchors, all lanes interleaved in shuffled rounds in the same run.

    .venv/bin/python bench/latency.py [--rounds 30] [--per-round 10] [--colds 10] [--backend bwrap ...]
                                      [--baseline-src /tmp/main/src] [--template] [--pool-size N]

Warm: one `1+1` round trip, in three kinds of lane:
- raw: `execute` on a jupyter_client AsyncKernelClient to a plain (unsandboxed) ipykernel from the
  same Python environment, waiting for the reply and the idle status, as a raw client would;
- minimal MCP: `run_python` through the official MCP client over stdio to bench/minimal_mcp.py, the
  least an MCP server around the same kernel can do (what the SDK and transport cost);
- coderunner BACKEND: `run_python` through the same client to `coderunner serve`, into a kernel
  inside the sandbox (and, with --baseline-src, the same for another tree: before and after).
Every round runs `--per-round` calls of each lane, the lanes in a fresh random order, so drift on a
shared machine (other load, CPU frequency) hits every lane alike. Printed: per-lane figures and
`CodeRunner / raw` and `CodeRunner / minimal MCP` (medians).

Cold: from asking for a new kernel to the first `1+1` result, raw and CodeRunner alternating in
shuffled order. CodeRunner: `create_session` then `run_python`. Raw: start_kernel, wait_for_ready,
execute. --template adds a lane beside each bwrap one whose server forks its kernels from the warm
template (kernel_template, issue 41; root only), interleaved with the others; its cold starts begin once
a session's status says its kernel came from the template. --pool-size 0 makes every CodeRunner cold start
a real one (the default pool hands out kernels started ahead).

The sandboxed kernels run at CPU weight 100 here (--cpu-weight), as the raw kernel does: the server's
default of 20 lets any other load on the machine delay them, which is its purpose, not per-call cost.

Warm calls count only once the servers have settled: a server just started fills its warm pool, and a
session's first call starts its reset standby; each such start is a burst of CPU (an interpreter and
its imports) beside the lanes, which on a loaded machine took seconds and slowed whichever lane ran
beside it. It is no part of a warm call's cost (--no-settle measures at once, as before).

Also printed: the CPU time each MCP server process spent per warm call (all its threads, from
/proc), which a loaded machine disturbs far less than wall time: what each server's own work costs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
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

import coderunner
from coderunner.config import load_settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summary import Figure, add_summary_argument, write_summary


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
    """`calls` warm round trips on a fresh raw kernel (for benches that measure one lane at a time)."""
    async with raw_kernel() as client:
        for _ in range(20):
            await raw_execute(client)
        return await timed(calls, lambda: raw_execute(client))


@contextlib.asynccontextmanager
async def raw_kernel():  # type: ignore[no-untyped-def]
    """A started raw kernel's client, shut down afterwards."""
    manager = AsyncKernelManager(kernel_name="bench-python")
    await manager.start_kernel(stderr=subprocess.DEVNULL)
    client = manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        yield client
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)


# --- CodeRunner through MCP over stdio ----------------------------------------------------------


def own_src() -> Path:
    """The source tree this bench imports coderunner from: its servers run the same code (a checkout
    measures itself, not whatever tree the venv has installed)."""
    return Path(coderunner.__file__).resolve().parents[1]


def bench_env(root: Path, backend: str = "bwrap") -> dict[str, str]:
    """A bench server's whole environment: its own dirs, quiet logs, the backend's own settings, this tree."""
    env = {
        "PYTHONPATH": str(own_src()),
        "CODERUNNER_BACKEND": backend,
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_LOG_LEVEL": "WARNING",
        "CODERUNNER_TOOLS": "all",  # the bench calls sessions, one-shots and snapshots too
    }
    for key in ("CODERUNNER_SANDBOX_ENV", "CODERUNNER_OCI_RUNTIME", "CODERUNNER_IMAGE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def server_params(
    root: Path,
    backend: str = "bwrap",
    lane: str = "",
    src: Path | None = None,
    cpu_weight: int | None = None,
    extra: dict[str, str] | None = None,
) -> StdioServerParameters:
    env = {**bench_env(root, backend), LANE_MARK: lane or f"coderunner {backend}", **(extra or {})}
    if src is not None:  # another tree's server, e.g. `git archive main src | tar -x -C /tmp/main`
        env["PYTHONPATH"] = str(src)
    if cpu_weight is not None:
        env["CODERUNNER_SESSION_CPU_WEIGHT"] = str(cpu_weight)
    return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)


#: Set in each server's environment, so the bench finds its process and reads its CPU time.
LANE_MARK = "CODERUNNER_BENCH_LANE"


def server_pid(lane: str) -> int | None:
    """The pid of the server process started for `lane` (its environment carries LANE_MARK=lane)."""
    wanted = f"{LANE_MARK}={lane}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as handle:
                if wanted in handle.read().split(b"\0"):
                    return int(entry)
    return None


def cpu_seconds(pid: int | None) -> float:
    """User plus system CPU time of a process and all its threads (0 where there is no /proc)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of `pid` and every process below it (0 for those gone meanwhile)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            total += cpu_seconds(current)
            for tid in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{tid}/children") as handle:
                    todo += [int(child) for child in handle.read().split()]
    return total


async def settled(pids: list[int], quiet_cpu_s: float = 0.05, window_s: float = 1.0, most_s: float = 180.0) -> float:
    """Wait until the servers' trees spend under `quiet_cpu_s` of CPU in a `window_s` (their warm pool,
    reset standbys and one-shot sandboxes started ahead are all up): a start is a burst of CPU beside the
    lanes that is no part of a warm call's cost. Returns the seconds waited (at most `most_s`)."""
    began = time.monotonic()
    while time.monotonic() - began < most_s:
        before = sum(tree_cpu_seconds(pid) for pid in pids)
        await anyio.sleep(window_s)
        if sum(tree_cpu_seconds(pid) for pid in pids) - before < quiet_cpu_s:
            break
    return time.monotonic() - began


async def mcp_run(client: Client, session_id: str | None = None) -> None:
    arguments: dict[str, object] = {"code": "1+1"}
    if session_id:
        arguments["session_id"] = session_id
    result = await client.call_tool("run_python", arguments)
    if result.is_error:
        raise RuntimeError(result.content)


def minimal_params() -> StdioServerParameters:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root")}
    env.update({key: os.environ[key] for key in ("JUPYTER_PATH", "JUPYTER_RUNTIME_DIR")})
    env[LANE_MARK] = "minimal MCP"
    script = Path(__file__).resolve().parent / "minimal_mcp.py"
    return StdioServerParameters(command=sys.executable, args=[str(script)], env=env)


async def template_ready(client: Client, within_s: float = 300.0) -> None:
    """Once a new session's kernel comes from the template (the server warms it in the background)."""
    with anyio.fail_after(within_s):
        while True:
            created = await client.call_tool("create_session", {})
            session_id = json.loads(created.content[0].text)["session_id"]  # type: ignore[union-attr]
            await mcp_run(client, session_id)
            said = await client.call_tool("manage_sessions", {"action": "status", "session_id": session_id})
            await client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
            if json.loads(said.content[0].text).get("kernel_start") == "template":  # type: ignore[union-attr]
                return
            await anyio.sleep(1)


async def coderunner_cold(client: Client) -> float:
    began = time.perf_counter()
    created = await client.call_tool("create_session", {})
    session_id = json.loads(created.content[0].text)["session_id"]  # type: ignore[union-attr]
    await mcp_run(client, session_id)
    elapsed = time.perf_counter() - began
    await client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
    return elapsed


def ratio(ours: list[float], anchor: list[float]) -> str:
    return f"{statistics.median(ours) / statistics.median(anchor):.2f}x"


async def main(
    rounds: int,
    per_round: int,
    colds: int,
    backends: list[str],
    baseline: Path | None,
    cpu_weight: int,
    summary: Path | None = None,
    settle: bool = True,
    template: bool = False,
    pool_size: int | None = None,
) -> None:
    settings = load_settings()
    root = _passable(Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp")))
    os.environ["JUPYTER_PATH"] = str(kernelspec_dir(settings.sandbox_env / "bin" / "python", root / "jupyter"))
    os.environ["JUPYTER_RUNTIME_DIR"] = str(root / "jupyter-runtime")
    warm: dict[str, list[float]] = {}
    cold: dict[str, list[float]] = {}
    cpu: dict[str, float] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            raw = await stack.enter_async_context(raw_kernel())
            minimal = await stack.enter_async_context(Client(minimal_params(), read_timeout_seconds=120))
            common = {"CODERUNNER_POOL_SIZE": str(pool_size)} if pool_size is not None else {}
            targets = [(f"coderunner {backend}", backend, None, common) for backend in backends]
            if template:
                on = {**common, "CODERUNNER_KERNEL_TEMPLATE": "1"}
                targets += [(f"coderunner {b} template", b, None, on) for b in backends if b == "bwrap"]
            if baseline is not None:
                targets += [(f"coderunner {backend} baseline", backend, baseline, common) for backend in backends]
            ours = {
                lane: await stack.enter_async_context(
                    Client(
                        server_params(root / lane.replace(" ", "-"), backend, lane, src, cpu_weight, extra),
                        read_timeout_seconds=120,
                    )
                )
                for lane, backend, src, extra in targets
            }

            async def minimal_run() -> None:
                result = await minimal.call_tool("run_python", {"code": "1+1"})
                if result.is_error:
                    raise RuntimeError(result.content)

            lanes: dict[str, Callable[[], Awaitable[None]]] = {
                "raw": lambda: raw_execute(raw),
                "minimal MCP": minimal_run,
            }
            for lane, client in ours.items():
                lanes[lane] = lambda client=client: mcp_run(client)  # type: ignore[misc]
            for call in lanes.values():  # warm up every lane before anything counts
                await timed(20, call)
            warm = {name: [] for name in lanes}
            pids = {name: server_pid(name) for name in lanes if name != "raw"}
            if settle:
                waited = await settled([pid for pid in pids.values() if pid is not None])
                print(f"servers settled (their kernels started ahead are up) after {waited:.1f} s")
            cpu = dict.fromkeys(pids, 0.0)
            for _ in range(rounds):
                for name in random.sample(list(lanes), len(lanes)):
                    began = cpu_seconds(pids.get(name))
                    warm[name] += await timed(per_round, lanes[name])
                    if name in cpu:
                        cpu[name] += cpu_seconds(pids.get(name)) - began

            for lane, client in ours.items():
                if lane.endswith(" template"):
                    await template_ready(client)
            cold_lanes: dict[str, Callable[[], Awaitable[float]]] = {"raw": raw_cold_start}
            for lane, client in ours.items():
                cold_lanes[lane] = lambda client=client: coderunner_cold(client)  # type: ignore[misc]
            cold = {name: [] for name in cold_lanes}
            for _ in range(colds):
                for name in random.sample(list(cold_lanes), len(cold_lanes)):
                    cold[name].append(await cold_lanes[name]())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"{rounds} rounds x {per_round} warm calls per lane, shuffled; {colds} cold starts per lane, shuffled")
    print(f"{'measure':40} {'median ms':>10} {'p90 ms':>9} {'min ms':>9} {'n':>5}")
    rows = [(f"warm 1+1, {name}", samples) for name, samples in warm.items()]
    rows += [(f"cold start, {name}", samples) for name, samples in cold.items() if samples]
    for name, samples in rows:
        row = summarize(samples)
        print(f"{name:40} {row['median_ms']:10.2f} {row['p90_ms']:9.2f} {row['min_ms']:9.2f} {row['n']:5d}")
    per_call = {name: seconds / len(warm[name]) * 1000 for name, seconds in cpu.items()}
    for name, ms in per_call.items():
        print(f"server CPU per warm call, {name}: {ms:.2f} ms")
    for lane in ours:
        mine = warm[lane]
        colder = f"; cold CodeRunner / raw {ratio(cold[lane], cold['raw'])}" if cold[lane] else ""
        print(
            f"{lane}: warm CodeRunner / raw {ratio(mine, warm['raw'])}, "
            f"CodeRunner / minimal MCP {ratio(mine, warm['minimal MCP'])}{colder}"
        )
    print(f"load {' '.join(f'{value:.2f}' for value in os.getloadavg())}")
    write_summary(summary, "latency", figures(warm, per_call))


def figures(warm: dict[str, list[float]], cpu_ms: dict[str, float]) -> list[Figure]:
    """The issue's warm-call target (median beside the raw kernel's, same run) and what explains it."""
    raw = statistics.median(warm["raw"]) * 1000
    found = []
    for lane, samples in warm.items():
        if lane == "raw":
            continue
        value = statistics.median(samples) * 1000
        ours = lane.startswith("coderunner") and not lane.endswith("baseline")
        notes = f"server CPU {cpu_ms[lane]:.2f} ms per call" if lane in cpu_ms else ""
        found.append(
            Figure(f"warm run_python('1+1'), {lane}, median", round(value, 2), "ms", baseline=round(raw, 2),
                   baseline_name="raw kernel (jupyter_client)", target="<= 1.1x" if ours else "",
                   met=value <= 1.1 * raw if ours else None, notes=notes)
        )  # fmt: skip
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="shuffled rounds of warm calls")
    parser.add_argument("--per-round", type=int, default=10, help="warm calls of each lane per round")
    parser.add_argument("--colds", type=int, default=10, help="cold starts per lane")
    parser.add_argument(
        "--backend", action="append", choices=["bwrap", "podman", "docker", "apple"],
        help="CodeRunner backend(s) to measure (repeatable; default bwrap)",
    )  # fmt: skip
    parser.add_argument("--baseline-src", type=Path, help="also measure another tree's server (its src folder)")
    parser.add_argument(
        "--cpu-weight", type=int, default=100,
        help="sessions' CPU weight (server default 20); 100 schedules the sandboxed kernel like the raw one",
    )  # fmt: skip
    parser.add_argument(
        "--no-settle", action="store_true",
        help="count warm calls at once, while the servers may still be starting kernels ahead (pool, standbys)",
    )  # fmt: skip
    parser.add_argument("--template", action="store_true", help="a bwrap lane with kernel_template on beside each")
    parser.add_argument("--pool-size", type=int, help="every CodeRunner server's pool_size (0: real cold starts)")
    add_summary_argument(parser)
    args = parser.parse_args()
    baseline = args.baseline_src.resolve() if args.baseline_src else None
    backends = args.backend or ["bwrap"]
    anyio.run(
        main, args.rounds, args.per_round, args.colds, backends, baseline, args.cpu_weight, args.summary,
        not args.no_settle,
        args.template, args.pool_size,
    )  # fmt: skip
