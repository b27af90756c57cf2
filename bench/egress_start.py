"""What network 'allowlist' adds to starting a sandbox, beside network 'none' in the same run.

    .venv/bin/python bench/egress_start.py [--runs 15]

Allowlist sandboxes get a proxy socket made by the host and a forwarder started before the
program (one more interpreter start inside the sandbox). Measured through the official MCP client
over stdio, lanes interleaved: create_session plus a first `1+1` (a cold session), and an
execute_code of `print('hi')` (a one-shot run), each with network 'none' and 'allowlist'.
(The proxy's own per-connection cost and throughput are bench/egress.py's.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from latency import _passable, bench_env, summarize, timed
from mcp import Client, StdioServerParameters

MODES = ("none", "allowlist")


async def main(runs: int) -> None:
    root = _passable(Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp")))
    env = {**bench_env(root), "CODERUNNER_ALLOWED_DOMAINS": '["python-packages"]'}
    params = StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)
    samples: dict[str, list[float]] = {}
    try:
        async with Client(params, read_timeout_seconds=120) as client:

            async def session(network: str) -> None:
                created = await client.call_tool("create_session", {"network": network})
                if created.is_error:
                    raise RuntimeError(created.content)
                session_id = json.loads(created.content[0].text)["session_id"]  # type: ignore[union-attr]
                ran = await client.call_tool("run_python", {"code": "1+1", "session_id": session_id})
                if ran.is_error:
                    raise RuntimeError(ran.content)
                await client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})

            async def oneshot(network: str) -> None:
                ran = await client.call_tool(
                    "execute_code", {"language": "python", "code": "print('hi')", "network": network}
                )
                if ran.is_error:
                    raise RuntimeError(ran.content)

            lanes: dict[str, Callable[[], Awaitable[None]]] = {}
            for mode in MODES:
                lanes[f"cold session, {mode}"] = lambda mode=mode: session(mode)
                lanes[f"one-shot python, {mode}"] = lambda mode=mode: oneshot(mode)
            for call in lanes.values():
                await call()  # warm the page cache for every lane alike
            for _ in range(runs):  # interleaved: the machine's noise falls on every lane alike
                for name, call in lanes.items():
                    samples.setdefault(name, []).extend(await timed(1, call))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'lane':32} {'median ms':>10} {'p90 ms':>8} {'min ms':>8}")
    for name, values in samples.items():
        summary = summarize(values)
        print(f"{name:32} {summary['median_ms']:10.1f} {summary['p90_ms']:8.1f} {summary['min_ms']:8.1f}")
    for kind in ("cold session", "one-shot python"):
        none = summarize(samples[f"{kind}, none"])["median_ms"]
        allow = summarize(samples[f"{kind}, allowlist"])["median_ms"]
        print(f"{kind}: allowlist adds {allow - none:+.1f} ms to the median ({allow / none:.2f}x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    os.chdir(Path(__file__).resolve().parent)
    anyio.run(main, parser.parse_args().runs)
