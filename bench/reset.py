"""kernel_reset to first result: with the session's standby kernel, without it, and (optionally) another tree.

    .venv/bin/python bench/reset.py [--rounds 20] [--load 2] [--baseline-src /tmp/base/src] [--backend bwrap]
                                    [--template] [--in-a-row 8] [--summary PATH]

Each lane is its own `coderunner serve` over stdio (the official MCP client), one session each:
- standby: reset_standby on (the default): a reset swaps in the fresh kernel the session started ahead;
- cold: reset_standby off: a reset kills the kernel and starts a new sandbox, as before;
- baseline (with --baseline-src): the same calls to a server run from another source tree (before).
With --template (bwrap, root), the same lanes again with kernel_template on ("standby template", "cold template",
"baseline template": the before lane is then only that one), each waiting first until its template is warm.
With --in-a-row N, each turn of a lane is N resets back to back (an agent's loop: no standby can be ready again
between them), the settle only between turns.
One sample is `kernel_reset` then `run_python('1+1')`, timed from the reset's call to the result. Every
round takes one sample of each lane, the lanes in a fresh random order, so drift on a shared machine
hits every lane alike; between samples the bench waits `--settle` seconds (the standby is started again
in the background after a swap, as an agent's think time would let it). `--load N` runs N busy host
processes (the bench's own, killed at its end) throughout: the issue's figure was taken under load.
Printed: median, p90 and min. With --summary, the standby lane's median beside the cold one's, against
the issue's target (at most 150 ms), as JSON for bench/suite.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from latency import bench_env, template_ready
from mcp import Client, StdioServerParameters
from summary import Figure, add_summary_argument, write_summary

REPO = Path(__file__).resolve().parents[1]
#: Issue 29: kernel_reset to first result at most this long.
TARGET_MS = 150.0


def summarize(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[max(int(len(ordered) * 0.9) - 1, 0)]
    median, least = statistics.median(ordered), ordered[0]
    return f"median {median * 1000:7.1f} ms   p90 {p90 * 1000:7.1f} ms   min {least * 1000:7.1f} ms"


def server(root: Path, backend: str, src: Path, standby: bool, template: bool = False) -> StdioServerParameters:
    env = {
        **bench_env(root, backend),
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_POOL_SIZE": "0",
        "CODERUNNER_RESET_STANDBY": "1" if standby else "0",
        "CODERUNNER_KERNEL_TEMPLATE": "1" if template else "0",
        "CODERUNNER_TOKEN": "bench-token-" + "0" * 24,
        "CODERUNNER_TOKEN_FILE": str(root / "token"),
        "PYTHONPATH": str(src),
    }
    return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)


@contextlib.asynccontextmanager
async def lane(root: Path, backend: str, src: Path, standby: bool, template: bool) -> AsyncIterator[Client]:
    root.mkdir()
    root.chmod(0o711)  # a root server's sandbox users pass through
    async with Client(server(root, backend, src, standby, template), read_timeout_seconds=120) as client:
        if template:
            await template_ready(client)
        first = await client.call_tool("run_python", {"code": "1+1"})
        assert not first.is_error, first
        yield client


async def sample(client: Client) -> float:
    began = time.perf_counter()
    reset = await client.call_tool("kernel_reset", {})
    result = await client.call_tool("run_python", {"code": "1+1"})
    took = time.perf_counter() - began
    assert not reset.is_error and not result.is_error, (reset, result)
    text = "".join(block.text for block in result.content if block.type == "text")
    assert text.splitlines()[0] == "2", text
    return took


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--settle", type=float, default=1.5, help="seconds between samples")
    parser.add_argument("--backend", default="bwrap")
    parser.add_argument("--baseline-src", type=Path, help="another tree's src/ (a 'before' lane)")
    parser.add_argument("--load", type=int, default=0, help="busy host processes running throughout")
    parser.add_argument("--template", action="store_true", help="also each lane with kernel_template on")
    parser.add_argument("--in-a-row", type=int, default=1, help="resets back to back in each turn of a lane")
    add_summary_argument(parser)
    args = parser.parse_args()
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(args.load)
    ]
    try:
        await measure(args)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(timeout=10)


async def measure(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="crr-", dir="/tmp"))
    root.chmod(0o711)
    lanes = {"standby": (REPO / "src", True, False), "cold": (REPO / "src", False, False)}
    if args.baseline_src is not None:
        lanes["baseline"] = (args.baseline_src.resolve(), False, False)
    if args.template:
        lanes.update({f"{name} template": (src, standby, True) for name, (src, standby, _) in list(lanes.items())})
        lanes.pop("baseline", None)  # another tree's template is what a before lane is for here
    samples: dict[str, list[float]] = {name: [] for name in lanes}
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = {
                name: await stack.enter_async_context(lane(root / name.replace(" ", "-"), args.backend, *how))
                for name, how in lanes.items()
            }
            await anyio.sleep(args.settle)
            for round_number in range(args.rounds):
                order = list(clients)
                random.shuffle(order)
                for name in order:
                    for _ in range(args.in_a_row):
                        samples[name].append(await sample(clients[name]))
                    await anyio.sleep(args.settle)
                print(f"round {round_number + 1}/{args.rounds}", file=sys.stderr, end="\r")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = f", {args.load} busy host processes" if args.load else ""
    row = f", {args.in_a_row} resets in a row a turn" if args.in_a_row > 1 else ""
    print(f"kernel_reset then run_python('1+1'), {args.backend}{load}, {args.rounds} rounds{row}, lanes interleaved:")
    for name, taken in samples.items():
        print(f"  {name:18} {summarize(taken)}")
    standby, cold = (statistics.median(samples[name]) * 1000 for name in ("standby", "cold"))
    figure = Figure("kernel_reset to first result, median", round(standby, 1), "ms", baseline=round(cold, 1),
                    baseline_name="reset_standby off", target=f"<= {TARGET_MS:g} ms", met=standby <= TARGET_MS,
                    notes=f"{args.load} busy host processes" if args.load else "")  # fmt: skip
    write_summary(args.summary, "reset", [figure])


if __name__ == "__main__":
    anyio.run(main)
