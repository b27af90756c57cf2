"""Cost of the after-cell figure hook (coderunner_guest.figures) on a `1+1` round trip.

    .venv/bin/python bench/figure_hook.py [--calls 200]

One stdio server, one session, pyplot imported under Agg (the hook's most expensive path when no
figure is open: a backend check and a figure listing). Lanes alternate call by call: the hook
registered (as shipped) and unregistered (the baseline), toggled inside the same kernel, so both
lanes see the same machine load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

HOOK = "__import__('coderunner_guest.figures', fromlist=['_after_cell'])._after_cell"
TOGGLE = {
    True: f"get_ipython().events.register('post_run_cell', {HOOK})",
    False: f"get_ipython().events.unregister('post_run_cell', {HOOK})",
}


async def main(calls: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp"))
    root.chmod(0o711)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_TOOLS": "all",
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
    }
    params = StdioServerParameters(command=sys.executable, args=["-m", "coderunner.cli", "serve"], env=env)
    samples: dict[bool, list[float]] = {True: [], False: []}
    try:
        await measure(params, calls, samples)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # this run's own folder only
    for lane, name in ((False, "baseline (no hook)"), (True, "with the figure hook")):
        ordered = sorted(samples[lane])
        print(f"{name:22} median {statistics.median(ordered) * 1000:6.2f} ms  "
              f"p90 {ordered[int(len(ordered) * 0.9) - 1] * 1000:6.2f} ms  n={len(ordered)}")  # fmt: skip


async def measure(params: StdioServerParameters, calls: int, samples: dict[bool, list[float]]) -> None:
    async with Client(params, read_timeout_seconds=120) as client:
        setup = "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt"
        await client.call_tool("run_python", {"code": setup})
        hooked = True  # the shipped state
        for index in range(2 * calls):
            want = index % 2 == 0
            if want != hooked:
                toggled = await client.call_tool("run_python", {"code": TOGGLE[want]})
                assert not toggled.is_error, toggled.content
                hooked = want
            began = time.perf_counter()
            await client.call_tool("run_python", {"code": "1+1"})
            samples[want].append(time.perf_counter() - began)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    anyio.run(main, parser.parse_args().calls)
