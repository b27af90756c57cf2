"""What tools/list costs a model on every turn: bytes and tokens (bytes/4) per tool and in total.

    python bench/tool_cost.py                         # this tree, default tool set
    python bench/tool_cost.py --tools python,files    # a narrower `tools` setting
    python bench/tool_cost.py --src /tmp/main/src     # beside another tree (e.g. main) as the baseline

For a baseline from main: `git archive main src | tar -x -C /tmp/main`. Each tree is measured in its own
interpreter (PYTHONPATH=its src), as the JSON the server sends for each tool in tools/list.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE_SRC = Path(__file__).resolve().parent.parent / "src"
#: The same budget tests/test_tool_schemas.py holds the default list to (see its history there).
BUDGET_TOKENS = 2_000

#: Run inside the measured tree: build the server as `serve` does (no sandbox is started) and list tools.
MEASURE = """
import json, sys, types, anyio
from coderunner.config import Settings
from coderunner.server import build_server

overrides = json.loads(sys.argv[1])
manager = types.SimpleNamespace(settings=Settings(**overrides))

async def main():
    tools = await build_server(manager, manager).list_tools()
    return {t.name: len(t.model_dump_json(by_alias=True, exclude_none=True).encode()) for t in tools}

print(json.dumps(anyio.run(main)))
"""


def measure(src: Path, tools: str | None) -> dict[str, int]:
    """Bytes per tool of the tree at `src` (a tree without the `tools` setting is measured whole)."""
    overrides = {"tools": tools} if tools else {}
    env = {**os.environ, "PYTHONPATH": str(src), "CODERUNNER_CONFIG": os.devnull}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(overrides)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"measuring {src} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def tokens(size: int) -> int:
    return round(size / 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, help="src folder of a baseline tree (e.g. main's)")
    parser.add_argument("--tools", help="the `tools` setting to measure this tree with, e.g. python,files")
    args = parser.parse_args()

    here = measure(HERE_SRC, args.tools)
    base = measure(args.src, None) if args.src else {}
    names = list(here) + [name for name in base if name not in here]
    header = f"{'tool':<20}{'bytes':>8}{'tokens':>8}"
    if base:
        header += f"{'base bytes':>12}{'base tokens':>13}"
    print(header)
    for name in names:
        line = f"{name:<20}"
        line += f"{here[name]:>8}{tokens(here[name]):>8}" if name in here else f"{'-':>8}{'-':>8}"
        if base:
            line += f"{base[name]:>12}{tokens(base[name]):>13}" if name in base else f"{'-':>12}{'-':>13}"
        print(line)
    total = sum(here.values())
    line = f"{'TOTAL (' + str(len(here)) + ' tools)':<20}{total:>8}{tokens(total):>8}"
    if base:
        base_total = sum(base.values())
        line += f"{base_total:>12}{tokens(base_total):>13}"
    print(line)
    verdict = "within" if tokens(total) <= BUDGET_TOKENS else "OVER"
    print(f"budget {BUDGET_TOKENS} tokens: {verdict}" + (f" (baseline: {len(base)} tools)" if base else ""))
    return 0 if tokens(total) <= BUDGET_TOKENS else 1


if __name__ == "__main__":
    sys.exit(main())
