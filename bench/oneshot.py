"""execute_code round trip per language beside the same program as a plain host subprocess.

    .venv/bin/python bench/oneshot.py [--runs 20]

Both sides run a trivial program (print one line) from nothing: CodeRunner through the official
MCP client over stdio (a fresh throwaway sandbox per call: dirs, bwrap, seccomp, cgroups, the
interpreter, teardown); the baseline as an unsandboxed subprocess of the same interpreter, timed
in the same run. The ratio is the price of the sandbox for a one-shot run.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import anyio
from latency import _passable, server_params, summarize, timed
from mcp import Client

from coderunner.config import load_settings

PROGRAMS = {
    "python": "print('hi')",
    "javascript": "console.log('hi')",
    "bash": "echo hi",
}


def baseline_argv(language: str, python: Path) -> list[str]:
    if language == "python":
        return [str(python), "-c", PROGRAMS[language]]
    if language == "javascript":
        return ["/usr/bin/node", "-e", PROGRAMS[language]]
    return ["/bin/bash", "-c", PROGRAMS[language]]


async def main(runs: int) -> None:
    settings = load_settings()
    root = _passable(Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp")))
    rows = []
    try:
        async with Client(server_params(root), read_timeout_seconds=120) as client:

            async def one(language: str) -> None:
                result = await client.call_tool("execute_code", {"language": language, "code": PROGRAMS[language]})
                if result.is_error:
                    raise RuntimeError(result.content)

            for language in PROGRAMS:
                await one(language)  # warm the page cache, as the baseline's first run does too
                ours = await timed(runs, lambda language=language: one(language))
                argv = baseline_argv(language, settings.sandbox_env / "bin" / "python")
                subprocess.run(argv, check=True, capture_output=True)

                async def plain(argv: list[str] = argv) -> None:
                    await anyio.run_process(argv, check=True)

                raw = await timed(runs, plain)
                rows.append((language, summarize(raw), summarize(ours)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'language':12} {'plain subprocess ms':>20} {'execute_code ms':>16} {'p90 ms':>8} {'ratio':>7}")
    for language, raw, ours in rows:
        ratio = ours["median_ms"] / raw["median_ms"]
        print(f"{language:12} {raw['median_ms']:20.1f} {ours['median_ms']:16.1f} {ours['p90_ms']:8.1f} {ratio:6.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="calls per language and side (at least 10)")
    anyio.run(main, max(parser.parse_args().runs, 10))
