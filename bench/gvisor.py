"""gvisor against bwrap in one run, lanes interleaved: cold start, warm `1+1`, and runsc checkpoint/restore.

    .venv/bin/python bench/gvisor.py [--rounds 3] [--warm 30] [--size-mb 100]

Per round, in turn:
- bwrap / gvisor, through a SessionManager of each: cold = create a session and answer `1+1`;
  warm = the median of `--warm` further `1+1` round trips in it.
- checkpoint: a live kernel's checkpoint is tried (`runsc checkpoint --leave-running`); it fails
  today because the kernel's ZMQ sockets are host sockets bound from inside (the Sentry's reason is
  printed: "Cannot save endpoint with bound host socket", or at times "endpoint still has waiters
  upon save"), and the failed save stops the sandbox, so the kernel dies. Then what the mechanism
  costs where no host socket is bound: a gVisor container holding `--size-mb` MB in a Python
  process is checkpointed (`runsc checkpoint`) and restored (`runsc restore` from podman's
  bundle); the restored sandbox must be running.
bwrap has no checkpoint; its lane reports none.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from coderunner.config import Settings
from coderunner.sandbox import make_backend
from coderunner.sandbox.container import server_tag
from coderunner.sandbox.gvisor import RUNTIME_FLAGS
from coderunner.sessions import SessionManager

RUNSC_ROOT = "/var/run/runsc"  # where podman's runsc keeps its state (its default)
TIMEOUT_S = 300


def settings(backend: str, root: Path) -> Settings:
    return Settings(
        runtime_dir=root / "r",
        workspaces_dir=root / "w",
        token_file=root / "token",
        export_dir=None,
        workspace_quota=False,
        backend=backend,
    )


def runsc(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    flags = [f"--{flag}" for flag in RUNTIME_FLAGS]
    return subprocess.run(
        ["runsc", f"--root={RUNSC_ROOT}", *flags, *args], capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs
    )


async def kernel_lane(backend: str, warm: int) -> dict[str, float | str]:
    root = Path(tempfile.mkdtemp(prefix="crb-", dir="/tmp"))
    root.chmod(0o711)
    try:
        config = settings(backend, root)
        async with SessionManager(config, make_backend(config)) as manager:
            began = time.perf_counter()
            session = await manager.create()
            await session.run("1+1", None, None)
            cold = time.perf_counter() - began
            trips = []
            for _ in range(warm):
                began = time.perf_counter()
                await session.run("1+1", None, None)
                trips.append(time.perf_counter() - began)
            figures: dict[str, float | str] = {"cold_s": cold, "warm_ms": statistics.median(trips) * 1000}
            if backend == "gvisor":
                figures["live_checkpoint"] = live_checkpoint(config.runtime_dir, root)
                after = await session.run("1+1", None, None)  # --leave-running: does the kernel still answer?
                figures["kernel_after"] = after.outcome.status.value
            return figures
    finally:
        shutil.rmtree(root, ignore_errors=True)


def live_checkpoint(runtime_dir: Path, root: Path) -> str:
    """Try runsc checkpoint on the session's container; its verdict in a few words."""
    listed = subprocess.run(
        ["podman", "ps", "--no-trunc", "--format", "{{.ID}}",
         "--filter", f"label=coderunner.server={server_tag(runtime_dir)}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    image = root / "image"
    image.mkdir()
    done = runsc("checkpoint", "--leave-running", f"--image-path={image}", listed[0])
    if done.returncode == 0:
        return "ok"
    said = done.stderr.strip()
    return (said.rsplit("}: ", 1)[-1].splitlines()[0] if "}: " in said else said)[:120].rstrip(": ")


HOLDER = """
import os, sys, time
blob = bytearray(os.urandom({size_mb} << 20))  # incompressible: runsc compresses its image
print('ready', flush=True)
while True:
    time.sleep(0.05)
"""


def checkpoint_lane(image: str, size_mb: int) -> dict[str, float | str]:
    """A gVisor container holding size_mb MB: checkpoint, then restore from podman's bundle."""
    work = Path(tempfile.mkdtemp(prefix="crk-", dir="/tmp"))
    name = f"crbench-{work.name}"
    restored = f"{name}-r"
    flags = [arg for flag in RUNTIME_FLAGS for arg in ("--runtime-flag", flag)]
    podman = ["podman", "--runtime", shutil.which("runsc") or "runsc", *flags]
    try:
        subprocess.run(
            [*podman, "run", "-d", "--name", name, "--network", "none", image, "/opt/coderunner/env/bin/python",
             "-c", HOLDER.format(size_mb=size_mb)],
            capture_output=True, text=True, timeout=TIMEOUT_S, check=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while (
            "ready" not in subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=60).stdout
        ):
            if time.monotonic() > deadline:
                return {"error": "the holder did not start"}
            time.sleep(0.1)
        cid = subprocess.run(["podman", "inspect", "--format", "{{.Id}}", name], capture_output=True, text=True,
                             timeout=60, check=True).stdout.strip()  # fmt: skip
        userdata = Path(f"/var/lib/containers/storage/overlay-containers/{cid}/userdata")
        rootfs = subprocess.run(["podman", "mount", name], capture_output=True, text=True, timeout=60, check=True)
        bundle = work / "bundle"
        bundle.mkdir()
        config = json.loads((userdata / "config.json").read_text())
        config["root"]["path"] = rootfs.stdout.strip()
        (bundle / "config.json").write_text(json.dumps(config))
        began = time.perf_counter()
        done = runsc("checkpoint", f"--image-path={work / 'image'}", cid)
        checkpoint_s = time.perf_counter() - began
        if done.returncode != 0:
            return {"error": done.stderr.strip()[:200]}
        image_mb = sum(path.stat().st_size for path in (work / "image").iterdir()) / 2**20
        began = time.perf_counter()
        # The restored sandbox inherits runsc's stdio: no pipes, or waiting for their end never ends.
        with open(work / "restore.err", "w+") as err:
            flags = [f"--{flag}" for flag in RUNTIME_FLAGS]
            code = subprocess.run(
                ["runsc", f"--root={RUNSC_ROOT}", *flags, "restore", "--detach", f"--image-path={work / 'image'}",
                 f"--bundle={bundle}", restored],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, timeout=TIMEOUT_S,
            ).returncode  # fmt: skip
            restore_s = time.perf_counter() - began
            if code != 0:
                err.seek(0)
                return {"error": err.read().strip()[:200]}
        state = json.loads(runsc("state", restored).stdout)
        return {"checkpoint_s": checkpoint_s, "restore_s": restore_s, "image_mb": image_mb, "state": state["status"]}
    finally:
        runsc("kill", restored, "KILL")
        runsc("delete", "--force", restored)
        subprocess.run(["podman", "unmount", name], capture_output=True, timeout=60)
        subprocess.run(["podman", "rm", "--force", "--time", "0", name], capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=30)
    parser.add_argument("--size-mb", type=int, default=100)
    args = parser.parse_args()
    image = Settings.model_fields["image"].default
    rows: dict[str, list[dict[str, float | str]]] = {"bwrap": [], "gvisor": [], "checkpoint": []}
    for number in range(1, args.rounds + 1):
        for lane in ("bwrap", "gvisor"):
            rows[lane].append(anyio.run(kernel_lane, lane, args.warm))
        rows["checkpoint"].append(checkpoint_lane(image, args.size_mb))
        print(f"round {number}: " + json.dumps({lane: found[-1] for lane, found in rows.items()}, default=str),
              file=sys.stderr)  # fmt: skip

    def median(lane: str, key: str) -> str:
        values = [row[key] for row in rows[lane] if isinstance(row.get(key), float)]
        return f"{statistics.median(values):.3f}" if values else "-"

    print(f"{'lane':8} {'cold s':>8} {'warm ms':>8}   (median of {args.rounds} rounds, {args.warm} warm trips each)")
    for lane in ("bwrap", "gvisor"):
        print(f"{lane:8} {median(lane, 'cold_s'):>8} {median(lane, 'warm_ms'):>8}")
    last = rows["gvisor"][-1]
    print(
        f"gvisor live kernel checkpoint: {last.get('live_checkpoint')}; the kernel after it: {last.get('kernel_after')}"
    )
    print("bwrap checkpoint: none (no such mechanism)")
    print(
        f"runsc checkpoint / restore of a process holding {args.size_mb} MB (no host socket bound): "
        f"{median('checkpoint', 'checkpoint_s')} s / {median('checkpoint', 'restore_s')} s, "
        f"image {median('checkpoint', 'image_mb')} MB; errors: "
        f"{[row['error'] for row in rows['checkpoint'] if 'error' in row] or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
