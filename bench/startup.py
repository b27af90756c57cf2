"""Server start as a client sees it: `coderunner --help`, a stdio `initialize`, the first `1+1` after launch.

    .venv/bin/python bench/startup.py [--rounds 10] [--summary PATH]

Claude Desktop and Cursor start the server at every launch, so these are waits a user has each time.
Every lane is timed from launching its process, lanes interleaved in shuffled rounds (so the load of a
shared machine hits them alike), each beside a baseline from the same rounds:
- help: `coderunner --help` as the console script runs it (this tree's src), beside `python -c pass`
  (the interpreter's own start, the floor);
- stdio: `coderunner serve` launched with its own dirs; the `initialize` request is written at once
  (as a client does) and timed to its answer; then `run_python('1+1')` is timed from the launch to
  its result (a session made on the way, from the warm pool when it is ready, as a user gets it);
- the same two on bench/minimal_mcp.py (the same SDK around one plain ipykernel of the sandboxes'
  environment, no sandbox): what the SDK, the interpreter and a kernel start cost by themselves.
The messages are JSON-RPC lines written by hand, so this process's own imports are never timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream
from latency import _passable, bench_env, kernelspec_dir
from summary import Figure, add_summary_argument, write_summary

from coderunner.config import load_settings

SRC = Path(__file__).resolve().parent.parent / "src"
MINIMAL = Path(__file__).resolve().parent / "minimal_mcp.py"
#: What the console script `coderunner` runs.
CONSOLE = "import sys; from coderunner.cli import main; sys.exit(main())"
#: Bounds: a launch to its answer, one JSON-RPC line, the process's exit once its stdin is closed.
ANSWER_WAIT_S = 120.0
MAX_LINE_BYTES = 1 << 20
EXIT_WAIT_S = 30.0
PROTOCOL = "2025-06-18"  # any version the SDK speaks; the server answers with the one it picks
TARGETS_MS = {"help": 500.0, "initialize": 800.0, "first": 1200.0}


def request(ident: int, method: str, params: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": ident, "method": method, "params": params}).encode() + b"\n"


async def answer(lines: BufferedByteReceiveStream, ident: int) -> dict[str, Any]:
    """The response to request `ident` (notifications and other lines before it are skipped)."""
    while True:
        message = json.loads(await lines.receive_until(b"\n", MAX_LINE_BYTES))
        if message.get("id") == ident:
            if "error" in message:
                raise RuntimeError(f"request {ident} failed: {message['error']}")
            return message["result"]


async def launch_to_first(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Seconds from launching the server to its `initialize` answer, and to the first `1+1` result."""
    began = time.perf_counter()
    process = await anyio.open_process(argv, env=env, stderr=None)
    assert process.stdin is not None and process.stdout is not None
    try:
        with anyio.fail_after(ANSWER_WAIT_S):
            client = {"name": "bench-startup", "version": "0"}
            await process.stdin.send(request(1, "initialize", {"protocolVersion": PROTOCOL, "capabilities": {},
                                                               "clientInfo": client}))  # fmt: skip
            lines = BufferedByteReceiveStream(process.stdout)
            await answer(lines, 1)
            initialized = time.perf_counter() - began
            note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            await process.stdin.send(json.dumps(note).encode() + b"\n")
            call = {"name": "run_python", "arguments": {"code": "1+1"}}
            await process.stdin.send(request(2, "tools/call", call))
            result = await answer(lines, 2)
            first = time.perf_counter() - began
        text = "".join(block.get("text", "") for block in result.get("content", []))
        if result.get("isError") or "2" not in text:
            raise RuntimeError(f"run_python('1+1') answered {text[:300]!r}")
        return initialized, first
    finally:
        await process.stdin.aclose()
        with anyio.move_on_after(EXIT_WAIT_S):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def run_once(argv: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    with anyio.fail_after(ANSWER_WAIT_S):
        done = await anyio.run_process(argv, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[-1]!r} exited {done.returncode}: {done.stderr.decode()[-300:]}")
    return time.perf_counter() - began


async def measure(rounds: int, root: Path) -> dict[str, list[float]]:
    """Each lane once per round, in a fresh random order; seconds."""
    python = sys.executable
    plain_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
                 "PYTHONPATH": str(SRC)}  # fmt: skip
    kernel_python = load_settings().sandbox_env / "bin" / "python"  # the sandboxes' environment (it has ipykernel)
    minimal_env = {**plain_env, "JUPYTER_PATH": str(kernelspec_dir(kernel_python, root / "jupyter"))}
    minimal_env["JUPYTER_RUNTIME_DIR"] = str(root / "jupyter-run")
    samples: dict[str, list[float]] = defaultdict(list)
    launches = 0

    async def ours() -> None:
        nonlocal launches
        launches += 1
        home = root / f"server-{launches}"
        home.mkdir()
        _passable(home)
        env = {**bench_env(home), "CODERUNNER_CONFIG": os.devnull, "PYTHONPATH": str(SRC),
               "CODERUNNER_TOKEN_FILE": str(home / "token")}  # fmt: skip
        try:
            initialized, first = await launch_to_first([python, "-c", CONSOLE, "serve"], env)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        samples["initialize/ours"].append(initialized)
        samples["first/ours"].append(first)

    async def minimal() -> None:
        initialized, first = await launch_to_first([python, str(MINIMAL)], minimal_env)
        samples["initialize/minimal"].append(initialized)
        samples["first/minimal"].append(first)

    async def help_ours() -> None:
        samples["help/ours"].append(await run_once([python, "-c", CONSOLE, "--help"], plain_env))

    async def help_plain() -> None:
        samples["help/plain"].append(await run_once([python, "-c", "pass"], plain_env))

    lanes = [ours, minimal, help_ours, help_plain]
    for number in range(rounds + 1):  # the first round only warms the page cache for every lane alike
        random.shuffle(lanes)
        for lane in lanes:
            await lane()
        if number == 0:
            samples.clear()
        print(f"round {number}/{rounds}", file=sys.stderr, end="\r")
    return samples


def figures(samples: dict[str, list[float]]) -> list[Figure]:
    ms = {name: statistics.median(values) * 1000 for name, values in samples.items()}
    rows = [
        ("help", "`coderunner --help`, median", "python -c pass", "< 500 ms"),
        ("initialize", "stdio `initialize` answered after launch, median", "minimal MCP server (same SDK)", "< 800 ms"),
        ("first", "first `1+1` after launch, median", "minimal MCP server + plain ipykernel", "< 1200 ms"),
    ]
    baselines = {"help": "help/plain", "initialize": "initialize/minimal", "first": "first/minimal"}
    found = []
    for key, name, baseline, target in rows:
        ours = ms[f"{key}/ours"]
        found.append(Figure(name, round(ours, 1), "ms", baseline=round(ms[baselines[key]], 1),
                            baseline_name=baseline, target=target, met=ours < TARGETS_MS[key]))  # fmt: skip
    return found


async def main(rounds: int, summary: Path | None) -> None:
    root = _passable(Path(tempfile.mkdtemp(prefix="crs-", dir="/tmp")))
    load_before = os.getloadavg()[0]
    try:
        samples = await measure(rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"server start, {rounds} interleaved rounds, load {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs; ms, median [min]")  # fmt: skip
    for name, values in samples.items():
        print(f"  {name:20} {statistics.median(values) * 1000:8.1f} [{min(values) * 1000:8.1f}]")
    found = figures(samples)
    for figure in found:
        print(f"{figure.name}: {figure.value:.0f} ms ({figure.baseline_name}: {figure.baseline:.0f} ms), "
              f"target {figure.target}: {'met' if figure.met else 'not met'}")  # fmt: skip
    write_summary(summary, "startup", found)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (each launches every lane once)")
    add_summary_argument(parser)
    arguments = parser.parse_args()
    anyio.run(main, max(arguments.rounds, 1), arguments.summary)
