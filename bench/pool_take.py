"""The share of creates served warm in a mixed burst: options given at take (pool_take_apply) beside the old path.

    .venv/bin/python bench/pool_take.py [--creates 20] [--settle 1.5] [--network allowlist] [--summary PATH]

Two `coderunner serve` over stdio (the official MCP client), from this checkout, alike but for one setting:
- take: pool_take_apply=true (a pooled sandbox is given lower limits, an allowlist, a run limit as it is taken);
- old: pool_take_apply=false (only creates with the default options take a pooled sandbox, and a default
  network 'allowlist' has no pool at all: the path before it).
Both have network `--network` by default (allowlist: its ceiling two names no test reaches), pool_size 2.
Each lane makes `--creates` sessions, kinds in turn (default; less memory; its own allowlist; mixed: less
memory and CPU, its own allowlist, another run limit), shuffled once and the same order in both lanes; the
lanes alternate create by create, `--settle` seconds apart (an agent's think time: the pool refills in it).
Each create is timed to its first `1+1` result, its status read (warm pool or cold start, and why), and
closed. Printed: the share served warm per lane and per kind, create-to-first-result p50 per lane, and the
reasons the cold ones gave.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
from latency import bench_env
from mcp import Client, StdioServerParameters
from summary import Figure, add_summary_argument, write_summary

CEILING = ["example.org", "example.net"]
#: What each kind of create asks for (network 'allowlist' kinds only where the server's network is).
KINDS: dict[str, dict[str, Any]] = {
    "default": {},
    "less memory": {"memory_mb": 1024},
    "own allowlist": {"allow": ["example.org"]},
    "mixed": {"memory_mb": 768, "cpus": 0.5, "allow": ["example.net"], "timeout_s": 30},
}


def server(root: Path, network: str, take_apply: bool) -> StdioServerParameters:
    env = {
        **bench_env(root),
        "CODERUNNER_POOL_SIZE": "2",
        "CODERUNNER_NETWORK": network,
        "CODERUNNER_ALLOWED_DOMAINS": json.dumps(CEILING),
        "CODERUNNER_EGRESS_AUDIT_LOG": str(root / "egress.jsonl"),
        "CODERUNNER_POOL_TAKE_APPLY": "true" if take_apply else "false",
    }
    return StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)


@contextlib.asynccontextmanager
async def open_server(network: str, take_apply: bool) -> AsyncIterator[Client]:
    root = Path(tempfile.mkdtemp(prefix="bpt-", dir="/tmp"))
    root.chmod(0o711)
    try:
        async with Client(server(root, network, take_apply), read_timeout_seconds=300) as client:
            yield client
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    text = "\n".join(block.text for block in result.content if block.type == "text")
    if result.is_error:
        raise RuntimeError(f"{tool}: {text}")
    return json.loads(text)  # type: ignore[no-any-return]


async def one_create(client: Client, options: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Create with `options` to the first `1+1` result (ms), and how its sandbox started; then close it."""
    began = time.perf_counter()
    session = (await call(client, "create_session", **options))["session_id"]
    result = await client.call_tool("run_python", {"code": "1+1", "session_id": session})
    elapsed = (time.perf_counter() - began) * 1000
    if result.is_error:
        raise RuntimeError(f"run_python: {result.content}")
    started = (await call(client, "manage_sessions", action="status", session_id=session))["started"]
    await call(client, "manage_sessions", action="close", session_id=session)
    return elapsed, started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--creates", type=int, default=20, help="creates per lane")
    parser.add_argument("--settle", type=float, default=1.5, help="seconds between creates")
    parser.add_argument("--network", default="allowlist", choices=["allowlist", "none"])
    parser.add_argument("--seed", type=int, default=40)
    add_summary_argument(parser)
    args = parser.parse_args()
    kinds = [kind for kind in KINDS if args.network == "allowlist" or "allow" not in KINDS[kind]]
    order = [kinds[i % len(kinds)] for i in range(args.creates)]
    random.Random(args.seed).shuffle(order)
    results: dict[str, list[tuple[str, float, dict[str, Any]]]] = defaultdict(list)

    async def run() -> None:
        async with open_server(args.network, True) as take, open_server(args.network, False) as old:
            lanes = {"take": take, "old": old}
            await anyio.sleep(8.0)  # both pools fill (the old lane's, where it has one)
            for kind in order:
                for lane, client in lanes.items():
                    elapsed, started = await one_create(client, KINDS[kind])
                    results[lane].append((kind, elapsed, started))
                    await anyio.sleep(args.settle)

    anyio.run(run)
    print(f"{args.creates} creates per lane, network {args.network}, kinds {', '.join(kinds)}; lanes interleaved")
    figures = []
    shares: dict[str, float] = {}
    for lane, rows in results.items():
        warm = [row for row in rows if row[2]["sandbox"] == "warm pool"]
        shares[lane] = 100 * len(warm) / len(rows)
        p50 = statistics.median(elapsed for _, elapsed, _ in rows)
        served = f"{len(warm)}/{len(rows)} served warm ({shares[lane]:.0f}%)"
        print(f"\n{lane}: {served}, create to first result p50 {p50:.0f} ms")
        for kind in kinds:
            of_kind = [row for row in rows if row[0] == kind]
            served = sum(row[2]["sandbox"] == "warm pool" for row in of_kind)
            kind_p50 = statistics.median(elapsed for _, elapsed, _ in of_kind)
            print(f"  {kind:14} {served}/{len(of_kind)} warm, p50 {kind_p50:.0f} ms")
        reasons = Counter(row[2]["why"] for row in rows if row[2]["sandbox"] != "warm pool")
        for why, count in reasons.most_common():
            print(f"  cold x{count}: {why}")
    figures.append(
        Figure(
            "mixed burst served warm",
            shares["take"],
            "%",
            baseline=shares["old"],
            baseline_name="pool_take_apply=false",
        )
    )
    write_summary(args.summary, "pool_take", figures)


if __name__ == "__main__":
    main()
