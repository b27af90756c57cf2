"""What one cluster session costs in CPU on its node, phase by phase, against a bare Ray actor.

    sudo .venv/bin/python bench/actor_cpu.py [--rounds 6] [--burst 1] [--idle 5] [--old DIR]
        [--rows PATH] [--summary PATH]

A real cluster (tests/cluster/conftest.py's head and two workers, in a network namespace with only
loopback) and one driver in that namespace. Each round starts `--burst` actors of each lane at once
(1: one at a time, so a process's CPU is its own work alone; 40: a burst, as part c of bench/cluster.py
makes one), the lanes in a fresh random order each round (interleaved: drift on a shared machine hits
all alike). Every actor is placed as a front door places a session (detached, named, 0.1 CPU, 512 MiB,
one `coderunner-bwrap`, max_concurrency 64), each lane with a `runtime_env` of its own:

- `bare`: an async actor with one method (`ping`): what Ray itself costs per actor process;
- `session`: a SessionActor of this checkout (`src/`): ping (its __init__), open, `start_run('1')`;
- `session (old)`: the same from `--old DIR` (a copy of another checkout's `src/`, say main's), if given.

Per actor: the CPU-seconds (utime+stime, /proc/<pid>/stat) of its Ray worker process from its start to
the moment all of its burst had answered each phase: up (ping: Ray's worker start, the actor class's
import and __init__), opened, first run answered; its threads' share (the main one runs Ray's task loop
and the imports; an async actor's calls run on its event loop thread); its sandbox's processes (bwrap,
kernel); then its CPU per second while idle for `--idle` s (what a session costs while it waits for the
rest of a burst). Medians per lane; the load beside them. No timing assertions: figures only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from summary import Figure, add_summary_argument, write_summary

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster import conftest as fixture  # noqa: E402 - needs the repo root on sys.path
from tests.cluster.conftest import ray_cluster_running, unavailable  # noqa: E402

#: The driver, run in the cluster's namespace: argv = address, lanes (JSON: name -> PYTHONPATH), rounds, idle s.
DRIVER = r"""
import json, os, random, secrets, sys, time
import ray
address, lanes = sys.argv[1], json.loads(sys.argv[2])
rounds, idle_s, burst = int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
ray.init(address=address, namespace="coderunner", logging_level="ERROR", log_to_driver=False)
from coderunner.cluster.actor import SessionActor
from coderunner.config import Settings
from coderunner.edge.callers import LOCAL_CALLER
TICK = os.sysconf("SC_CLK_TCK")

class Bare:
    async def ping(self):
        return "pong"

def cpu(pid):
    try:
        rest = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(rest[11]) + int(rest[12])) / TICK

def children(pid):
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        for task in os.listdir(f"/proc/{current}/task") if os.path.isdir(f"/proc/{current}/task") else []:
            try:
                kids = [int(c) for c in open(f"/proc/{current}/task/{task}/children").read().split()]
            except OSError:
                kids = []
            found += kids
            pending += kids
    return found

settings_obj = Settings(backend="bwrap", pool_size=0)
settings = settings_obj.model_dump(exclude={"token", "token_file", "ray_address"})
from coderunner.sandbox import make_backend
from coderunner.sessions.sandbox_options import sandbox_options
from coderunner.vocabulary.sandbox_request import SandboxRequest
session_options = sandbox_options(settings_obj, make_backend(settings_obj), [], SandboxRequest(memory_mb=512))
options = {"num_cpus": 0.1, "memory": 512 * 2**20, "resources": {"coderunner-bwrap": 1}, "namespace": "coderunner",
           "lifetime": "detached", "max_restarts": 0, "max_concurrency": 64}
def threads(pid):
    # CPU-s of each of the process's threads, by thread name (Ray names its threads; Python's main is the title).
    found = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            name = open(f"/proc/{pid}/task/{task}/comm").read().strip()
            rest = open(f"/proc/{pid}/task/{task}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if name.startswith("ray::") or name.startswith("python"):  # Python's own threads keep the process's name
            name = "main" if task == str(pid) else "python threads"
        found[name] = found.get(name, 0.0) + (int(rest[11]) + int(rest[12])) / TICK
    return found

rows = []
for index in range(rounds):
    for lane in random.Random(index).sample(sorted(lanes), len(lanes)):
        session = lane != "bare"
        klass = ray.remote(SessionActor if session else Bare)
        # Every lane has a runtime_env of its own (its own workers), so all pay the same for one.
        env = {"env_vars": {"PYTHONPATH": lanes[lane], "CODERUNNER_BENCH_LANE": lane}}
        began = time.perf_counter()
        actors = []
        for _ in range(burst):
            sid = secrets.token_urlsafe(18)
            actors.append(klass.options(name=f"bench-{sid}", runtime_env=env, **options).remote(
                *((settings, sid) if session else ())))
        ray.get([actor.ping.remote() for actor in actors], timeout=120 + 10 * burst)
        up_s = time.perf_counter() - began
        pids = ray.get([actor.__ray_call__.remote(lambda self: os.getpid()) for actor in actors], timeout=60)
        up = {pid: cpu(pid) for pid in pids}
        opened, ran, sandbox = {}, {}, {}
        if session:
            ray.get([actor.open.remote(session_options, LOCAL_CALLER) for actor in actors], timeout=120 + 10 * burst)
            opened = {pid: cpu(pid) for pid in pids}
            deltas = ray.get([actor.start_run.remote("1", None, None, LOCAL_CALLER, 60.0) for actor in actors],
                             timeout=120 + 10 * burst)
            assert all(delta.ended and delta.failure is None for delta in deltas), deltas
            ran = {pid: cpu(pid) for pid in pids}
            sandbox = {pid: sum(cpu(kid) for kid in children(pid)) for pid in pids}
        all_s = time.perf_counter() - began
        by_thread = {pid: threads(pid) for pid in pids}
        marks = {pid: cpu(pid) for pid in pids}
        time.sleep(idle_s)
        idle = {pid: (cpu(pid) - marks[pid]) / idle_s for pid in pids}
        idle_threads = {}
        for pid in pids:
            after = threads(pid)
            idle_threads[pid] = {name: (after[name] - by_thread[pid].get(name, 0.0)) / idle_s for name in after}
        if session:
            for actor in actors:
                try:
                    ray.get(actor.close.remote(), timeout=60)
                except Exception:
                    pass
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for pid in pids:
            row = {"lane": lane, "burst": burst, "up_s": up_s, "all_s": all_s, "up": up[pid],
                   "idle_per_s": idle[pid], "threads": by_thread[pid], "idle_threads": idle_threads[pid]}
            if session:
                row.update(opened=opened[pid], ran=ran[pid], sandbox=sandbox[pid])
            rows.append(row)
        print(lane, len(pids), round(all_s, 2), file=sys.stderr, flush=True)
        time.sleep(2)  # the killed actors' processes go
print(json.dumps(rows))
"""

PHASES = ("up", "opened", "ran")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def uptime() -> str:
    """The load averages (1, 5, 15 min), to print beside the figures."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def report(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Medians per lane and phase (CPU-s of the actor's process from its start), printed."""
    found: dict[str, dict[str, float]] = {}
    for lane in sorted({row["lane"] for row in rows}):
        mine = [row for row in rows if row["lane"] == lane]
        figures = found[lane] = {
            key: median([row[key] for row in mine if key in row])
            for key in (*PHASES, "sandbox", "idle_per_s", "up_s", "all_s")
        }
        phases = f"up {figures['up']:.3f}"
        if any("ran" in row for row in mine):
            phases += (
                f", opened {figures['opened']:.3f} (+{figures['opened'] - figures['up']:.3f}), first run answered "
                f"{figures['ran']:.3f} (+{figures['ran'] - figures['opened']:.3f}); "
                f"its sandbox {figures['sandbox']:.3f}"
            )
        print(
            f"{lane:14} n {len(mine):3}  CPU-s of its process: {phases}; then idle {figures['idle_per_s'] * 1000:.1f} "
            f"ms of CPU per s; all up in {figures['up_s']:.2f} s, all answered in {figures['all_s']:.2f} s (medians)"
        )
        names = sorted({name for row in mine for name in row["threads"]})
        spent = {name: statistics.mean(row["threads"].get(name, 0.0) for row in mine) for name in names}
        ranked = sorted(spent.items(), key=lambda item: -item[1])
        print("   by thread (mean CPU-s): " + ", ".join(f"{name} {seconds:.3f}" for name, seconds in ranked if seconds))
        idle = {name: statistics.mean(row["idle_threads"].get(name, 0.0) for row in mine) for name in names}
        ranked = sorted(idle.items(), key=lambda item: -item[1])
        print(
            "   idle, by thread (mean ms of CPU per s): "
            + ", ".join(f"{name} {rate * 1000:.1f}" for name, rate in ranked if rate)
        )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds (one actor per lane each)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds each actor idles after its first run")
    parser.add_argument("--burst", type=int, default=1, help="actors started at once per lane and round")
    parser.add_argument("--old", type=Path, help="another checkout's src/ (a copy), as the lane 'session (old)'")
    parser.add_argument("--rows", type=Path, help="also write every actor's figures here (JSON)")
    add_summary_argument(parser)
    args = parser.parse_args()
    if reason := unavailable():
        print(f"bench/actor_cpu.py {reason}", file=sys.stderr)
        return 2
    lanes = {"bare": str(REPO / "src"), "session": str(REPO / "src")}
    if args.old is not None:
        lanes["session (old)"] = str(args.old.resolve())
    # Room on either worker for a whole burst (Ray's logical memory and CPUs; what the machine holds is real).
    fixture.WORKER_MEMORY = max(fixture.WORKER_MEMORY, args.burst * 512 * 2**20 + 2 * 2**30)
    fixture.WORKER_CPUS = max(fixture.WORKER_CPUS, math.ceil(args.burst * 0.1 + 1))
    print(f"load before: {uptime()}")
    with ray_cluster_running() as cluster:
        done = subprocess.run(
            [*cluster.exec_prefix, cluster.python, "-c", DRIVER, cluster.address, json.dumps(lanes),
             str(args.rounds), str(args.idle), str(args.burst)],
            env={**cluster.env, "CODERUNNER_CONFIG": os.devnull}, cwd=cluster.temp_dir, capture_output=True,
            text=True, timeout=600 + args.rounds * len(lanes) * (60 + 10 * args.burst + args.idle),
        )  # fmt: skip
    if done.returncode != 0:
        print(f"the driver failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return 1
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    if args.rows is not None:
        args.rows.write_text(json.dumps(rows))
    print(f"load after: {uptime()}")
    found = report(rows)
    bare, ours = found["bare"]["up"], found["session"]["ran"]
    old = found.get("session (old)", {}).get("ran")
    write_summary(args.summary, "actor_cpu", [
        Figure("CPU-s of a session actor's process, start to first run answered (median)", round(ours, 3), "s",
               baseline=None if old is None else round(old, 3), baseline_name="the --old checkout, same run",
               notes=f"a bare Ray actor's process: {bare:.3f} CPU-s"),
    ])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
