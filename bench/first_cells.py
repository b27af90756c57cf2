"""The first chart and the first pandas cell of a new session, beside the same cell in a warm session.

    .venv/bin/python bench/first_cells.py [--rounds 6] [--settle 4] [--baseline-src /tmp/base/src]
                                          [--backend bwrap] [--summary PATH]

Two `coderunner serve` over stdio (the official MCP client), from this checkout:
- pooled: the default warm pool (a new session takes a sandbox started ahead);
- cold: pool_size=0 (a new session starts its sandbox and kernel on create).
With --baseline-src, the same two from another tree's src/ (before/after in one run).
Lanes, per cell (a chart: pyplot, one line plot, shown; pandas: a 1,000-row frame grouped and described):
- new session on each server: create_session, then the cell as its first call; timed both from the
  cell's call to its result (the figure the target is on) and from create_session to the result;
  then the session is closed;
- warm: the same cell again in the pooled server's default session, which ran it before (the baseline);
  and in the cold server's (no pool refilling beside it: what a refill's imports cost a warm cell).
Every round runs every lane once, in a fresh random order, `--settle` seconds apart (an agent's think
time: the pool refills and the standby starts in it), so load on a shared machine hits all lanes alike.
Also printed: the memory of an idle new session (manage_sessions status before its first cell) on each server.
Issue 37's target: the first chart in a new session at most 1.5x a warm chart cell.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from latency import bench_env
from mcp import Client, StdioServerParameters
from summary import Figure, add_summary_argument, write_summary

REPO = Path(__file__).resolve().parents[1]
#: Issue 37: the first chart in a new session at most this many times a warm chart cell.
TARGET_RATIO = 1.5
CELLS = {
    "chart": (
        "import matplotlib.pyplot as plt\n"
        "plt.figure(figsize=(4, 3))\n"
        "plt.plot(range(10), [x * x for x in range(10)])\n"
        "plt.title('squares')\n"
        "plt.show()"
    ),
    "pandas": (
        "import pandas as pd\n"
        "df = pd.DataFrame({'x': range(1000), 'y': [i % 7 for i in range(1000)]})\n"
        "df.groupby('y').x.describe()"
    ),
}


def server(root: Path, backend: str, src: Path, pool_size: int) -> StdioServerParameters:
    env = {
        **bench_env(root, backend),
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_EXPORT_DIR": "",
        "CODERUNNER_POOL_SIZE": str(pool_size),
        "CODERUNNER_TOKEN": "bench-token-" + "0" * 24,
        "CODERUNNER_TOKEN_FILE": str(root / "token"),
        "PYTHONPATH": str(src),
    }
    return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)


async def call(client: Client, tool: str, **arguments: object) -> tuple[str, int]:
    """The reply's text and its number of images; raises if the tool said it failed."""
    result = await client.call_tool(tool, arguments)
    text = "".join(getattr(block, "text", "") for block in result.content)
    if result.is_error:
        raise RuntimeError(f"{tool}: {text[:2000]}")
    return text, sum(1 for block in result.content if block.type == "image")


def check(kind: str, reply: tuple[str, int]) -> bool:
    """Raises unless the cell did its work; True if matplotlib said it was building its font cache
    (it says so only past 5 s: a cell without the prebuilt list may have built one without a word)."""
    text, images = reply
    if kind == "chart" and images != 1:
        raise RuntimeError(f"the chart cell sent {images} images: {text[:2000]}")
    if kind == "pandas" and "count" not in text:
        raise RuntimeError(f"the pandas cell did not describe its frame: {text[:2000]}")
    return "building the font cache" in text


@contextlib.asynccontextmanager
async def open_server(root: Path, backend: str, src: Path, pool_size: int) -> AsyncIterator[Client]:
    root.mkdir()
    root.chmod(0o711)  # a root server's sandbox users pass through
    async with Client(server(root, backend, src, pool_size), read_timeout_seconds=300) as client:
        for kind, code in CELLS.items():  # the default session: warm, and its cells' imports done
            check(kind, await call(client, "run_python", code=code))
        yield client


async def new_session(client: Client, kind: str) -> tuple[float, float, bool]:
    """(the first cell alone, create_session to its result, whether matplotlib said it built its font
    cache) in a new session, which is then closed."""
    began = time.perf_counter()
    session_id = json.loads((await call(client, "create_session"))[0])["session_id"]
    created = time.perf_counter()
    reply = await call(client, "run_python", code=CELLS[kind], session_id=session_id)
    done = time.perf_counter()
    await call(client, "manage_sessions", action="close", session_id=session_id)
    return done - created, done - began, check(kind, reply)


#: The kernel's own resident and proportional memory, in MiB (a cell that imports nothing new).
KERNEL_MEMORY = (
    "print(*(int(line.split()[1]) / 1024 for name in ('status', 'smaps_rollup')"
    " for line in open(f'/proc/self/{name}') if line.startswith(('VmRSS:', 'Pss:'))))"
)


async def idle_memory_mb(client: Client) -> tuple[float | None, float | None, str]:
    """manage_sessions status: the memory of a new session before its first cell (its sandbox: cgroup or the
    kernel's process tree), of the default session's standby kernel (started ahead for a reset), and
    the new session's kernel's own RSS and PSS as its first cell reads them."""
    session_id = json.loads((await call(client, "create_session"))[0])["session_id"]
    try:
        status = json.loads((await call(client, "manage_sessions", action="status", session_id=session_id))[0])
        rss, pss = (await call(client, "run_python", code=KERNEL_MEMORY, session_id=session_id))[0].split()[:2]
    finally:
        await call(client, "manage_sessions", action="close", session_id=session_id)
    default = json.loads((await call(client, "manage_sessions", action="status"))[0])
    kernel = f"kernel RSS {float(rss):.1f} MiB, PSS {float(pss):.1f} MiB"
    return status.get("usage", {}).get("memory_mb"), (default.get("standby") or {}).get("memory_mb"), kernel


def ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[max(int(len(ordered) * 0.9) - 1, 0)]
    return (
        f"median {statistics.median(ordered) * 1000:7.0f} ms   p90 {p90 * 1000:7.0f} ms   "
        f"min {ordered[0] * 1000:7.0f} ms   n {len(ordered)}"
    )


async def measure(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="crf-", dir="/tmp"))
    root.chmod(0o711)
    trees = {"": REPO / "src"}
    if args.baseline_src is not None:
        trees[" (before)"] = args.baseline_src.resolve()
    servers = {f"{way}{tag}": (src, size) for tag, src in trees.items() for way, size in (("pooled", 2), ("cold", 0))}
    cell: dict[str, list[float]] = {}
    whole: dict[str, list[float]] = {}
    memory: dict[str, tuple[float | None, float | None, str]] = {}
    said: dict[str, int] = {}  # first cells that said "Matplotlib is building the font cache", per server
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = {
                name: await stack.enter_async_context(open_server(root / f"s{index}", args.backend, src, size))
                for index, (name, (src, size)) in enumerate(servers.items())
            }
            await anyio.sleep(args.settle)
            for name, client in clients.items():
                memory[name] = await idle_memory_mb(client)
                await anyio.sleep(args.settle)
            lanes = [(kind, name) for kind in CELLS for name in [*clients, "warm", "warm (no pool)"]]
            for round_number in range(args.rounds):
                random.shuffle(lanes)
                for kind, name in lanes:
                    if name.startswith("warm"):
                        server = clients["pooled" if name == "warm" else "cold"]
                        began = time.perf_counter()
                        reply = await call(server, "run_python", code=CELLS[kind])
                        cell.setdefault(f"{kind} {name}", []).append(time.perf_counter() - began)
                        check(kind, reply)
                    else:
                        first, total, built = await new_session(clients[name], kind)
                        cell.setdefault(f"{kind} {name}", []).append(first)
                        whole.setdefault(f"{kind} {name}", []).append(total)
                        if built:
                            said[name] = said.get(name, 0) + 1
                    await anyio.sleep(args.settle)
                print(f"round {round_number + 1}/{args.rounds}", file=sys.stderr, end="\r")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, cell, whole, memory)
    for name, count in said.items():
        print(f"{name}: {count} first cells said 'Matplotlib is building the font cache' (a build over 5 s)")


def report(
    args: argparse.Namespace,
    cell: dict[str, list[float]],
    whole: dict[str, list[float]],
    memory: dict[str, tuple[float | None, float | None, str]],
) -> None:
    load = " ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"first cells, {args.backend}, {args.rounds} rounds, lanes interleaved, {args.settle:g} s apart, load {load}")
    for kind in CELLS:
        print(f"{kind}: the cell alone")
        for lane, samples in cell.items():
            if lane.startswith(kind + " "):
                print(f"  {lane:28} {ms(samples)}")
        print(f"{kind}: create_session to the first cell's result")
        for lane, samples in whole.items():
            if lane.startswith(kind + " "):
                print(f"  {lane:28} {ms(samples)}")
    print("memory (manage_sessions status): an idle new session before its first cell; the default session's standby")
    for name, (used, standby, kernel) in memory.items():
        shown = ["–" if value is None else f"{value:.1f} MiB" for value in (used, standby)]
        print(f"  {name:20} new session {shown[0]:>10}   standby {shown[1]:>10}   new session's {kernel}")
    median = {lane: statistics.median(samples) * 1000 for lane, samples in cell.items()}
    figures = []
    for kind in CELLS:
        warm = round(median[f"{kind} warm"], 1)
        for way in ("pooled", "cold"):
            value = round(median[f"{kind} {way}"], 1)
            target = f"<= {TARGET_RATIO:g}x" if kind == "chart" and way == "pooled" else ""
            met = value <= TARGET_RATIO * warm if target else None
            figures.append(Figure(f"first {kind} cell, new {way} session, median", value, "ms", baseline=warm,
                                  baseline_name=f"warm {kind} cell", target=target, met=met))  # fmt: skip
    write_summary(args.summary, "first_cells", figures)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--backend", default="bwrap")
    parser.add_argument("--baseline-src", type=Path, help="another tree's src/ (its servers as 'before' lanes)")
    add_summary_argument(parser)
    await measure(parser.parse_args())


if __name__ == "__main__":
    anyio.run(main)
