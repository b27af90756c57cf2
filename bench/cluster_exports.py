"""What copying /mnt/outputs out costs in cluster mode, beside one machine, on a real Ray cluster.

    sudo .venv/bin/python bench/cluster_exports.py [--rounds 5] [--sizes 100K,8M,64M] [--summary PATH]

The cluster is tests/cluster/conftest.py's (a head and two workers in a loopback-only network
namespace). Two front doors run in that namespace, each with an export folder of its own: `serve --ray`
(the session on a worker node; its files are listed there and pulled to the front door in 1 MiB pieces,
small ones inline) and plain `serve` (bwrap; the host copies the outbox itself). Each round, for each
size, the lanes go in a fresh random order, each running two cells in its default session: one writes
the file to /workspace (not exported: the baseline), one writes the same bytes to /mnt/outputs (copied
out before the reply). The difference is the export's cost; the size over it, its throughput.

No timing assertions: figures only. The cluster, the front doors and their folders are gone at the end.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from cluster import call, door_env, front_door
from mcp import Client
from summary import Figure, add_summary_argument, write_summary

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.conftest import RayCluster, ray_cluster_running, unavailable  # noqa: E402

UNITS = {"K": 2**10, "M": 2**20}
WRITE = "open({path!r}, 'wb').write(b'x' * {size})"


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


async def lane_times(client: Client, size: int, tag: str) -> tuple[float, float]:
    """(seconds to write `size` bytes to the workspace, seconds to write them to the outbox and export)."""
    times = []
    for path in (f"/workspace/plain-{tag}.bin", f"/mnt/outputs/out-{tag}.bin"):
        began = time.perf_counter()
        reply = await call(client, "run_python", code=WRITE.format(path=path, size=size))
        times.append(time.perf_counter() - began)
        if path.startswith("/mnt") and "copied 1 file(s)" not in reply.get("text", ""):
            raise RuntimeError(f"not exported: {reply}")
    return times[0], times[1]


async def run(cluster: RayCluster, root: Path, rounds: int, sizes: list[int]) -> dict[tuple[str, int], list[float]]:
    limit = str(2 * rounds * sum(sizes) // 2**20 + 64)
    envs = {
        name: door_env(cluster, root / name, CODERUNNER_EXPORT_DIR=str(root / name / "out"),
                       CODERUNNER_EXPORT_LIMIT_MB=limit)
        for name in ("cluster", "local")
    }  # fmt: skip
    extra: dict[tuple[str, int], list[float]] = {}
    async with (
        front_door(cluster, envs["cluster"], ray=True) as remote,
        front_door(cluster, envs["local"], ray=False) as local,
    ):
        lanes = {"cluster": remote, "local": local}
        for client in lanes.values():
            await lane_times(client, 1024, "warm-up")
        for round_ in range(rounds):
            for size in sizes:
                for name in random.sample(list(lanes), len(lanes)):
                    plain, exported = await lane_times(lanes[name], size, f"{round_}-{size}")
                    extra.setdefault((name, size), []).append(exported - plain)
    return extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="100K,8M,64M", help="file sizes, comma-separated (K, M)")
    add_summary_argument(parser)
    args = parser.parse_args()
    if reason := unavailable():
        print(f"bench/cluster_exports.py {reason}", file=sys.stderr)
        return 2
    sizes = [parse_size(text) for text in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="cre-", dir="/tmp"))  # short: ipc socket paths stay under 107 bytes
    root.chmod(0o711)
    figures: list[Figure] = []
    try:
        with ray_cluster_running() as cluster:
            extra = anyio.run(run, cluster, root, args.rounds, sizes)
        print(f"export cost per call (outbox write minus workspace write), median of {args.rounds}, lanes interleaved:")
        for size in sizes:
            medians: dict[str, Any] = {name: statistics.median(extra[(name, size)]) for name in ("cluster", "local")}
            rate = {name: size / 2**20 / value if value > 0 else float("inf") for name, value in medians.items()}
            shown = [f"{name} {medians[name] * 1000:8.1f} ms ({rate[name]:7.1f} MiB/s)" for name in medians]
            print(f"  {size / 2**20:8.2f} MiB: " + "   ".join(shown))
            figures.append(Figure(f"export of {size / 2**20:.2f} MiB, median", medians["cluster"] * 1000, "ms",
                                  baseline=medians["local"] * 1000, baseline_name="local serve"))  # fmt: skip
        write_summary(args.summary, "cluster_exports", figures)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
