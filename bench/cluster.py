"""Cluster mode beside one machine, on a real Ray cluster (a head and two workers) made for the run.

    sudo .venv/bin/python bench/cluster.py [--rounds 50] [--colds 10] [--oneshots 30] [--sessions 100]
        [--no-local-burst] [--summary PATH]   (the issue's targets as JSON, for bench/suite.py: bench/summary.py)

The cluster is tests/cluster/conftest.py's: three `ray start --block` nodes in a network namespace of
their own with only loopback. Every front door runs in that namespace too (nsenter), the local ones
included, so all lanes share the same conditions; all are driven by the MCP SDK's client over stdio.
Four front doors: `serve --ray` with pool_size=0 and with pool_size=2 (each worker node's warm pool),
and plain `serve` (bwrap) with pool_size=0 and with its default pool of 2.

a. Warm `run_python('1+1')` round trip into the caller's default session, cluster against local (the
   pool_size=0 front doors): `--rounds` rounds of one call per lane, the lanes in a fresh random order
   each round, after a warm-up, so drift on a shared machine hits both alike. Beside them, the floor:
   a bare Ray actor call (`ping`) to the session's node agent from a driver of our own (a block after the
   rounds, not interleaved), and the same agent call a front door makes for a run (`start_run`), from
   that driver: what a warm run costs on the node's side.
b. create_session to first result (`create_session`, then `run_python('1')` in it; closed untimed),
   `--colds` shuffled rounds of the four lanes: cluster and local, each from its warm pool and cold.
   Before each round the cluster's node pools are full again (waited for, untimed).
c. `--sessions` sessions created at once through the cluster front door without pool (memory_mb=512,
   the least a session may ask for, and the default 0.1 CPU each), each then running `1`: time until
   all answered, and where they landed. If some fail, they are closed and half as many are tried at
   once, down to 5: the largest burst that all started. Then `--sessions` sessions are held at once
   (made in waves of that size): memory with all of them alive (host MemAvailable; PSS of the node
   agents' processes and of the sandboxes), the CPU they spend sitting idle (IDLE_S, after IDLE_SETTLE_S: the
   agents that hold them and their sandboxes and kernels; the rest of the machine beside), then all closed at
   once, and what the cluster still held afterwards (sessions in agents, sandboxes, named actors but the
   agents, mounts on the nodes' disks). Beside it the same burst on the local front door
   (--no-local-burst skips it).
d. `--oneshots` rounds of `execute_code('print(1)')`, back to back, cluster against local (the
   pool_size=0 front doors), shuffled in each round: a node agent's run, served by the sandbox its agent
   started ahead after the last run, against the local server's.

A node's `memory` and `CPU` (Ray's logical resources) are what each session reserves in its agent's
account (its memory_mb, an address space cap, not RAM in use; its cpus). The fixture's workers
advertise 4 GiB and 2 CPUs each: room for 16 sessions of 512 MiB, or two of the default 2048 MiB. This
bench has each worker advertise room for its half of `--sessions` plus the sessions and pools of parts
a and b (printed at the start); what the machine really holds is what part c measures.

No timing assertions: figures only. Every wait is bounded; the sessions, front doors and the cluster
(with everything in its namespace, the node agents included) are gone at the end, also after a
failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters
from summary import Figure, add_summary_argument, write_summary

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster import conftest as fixture  # noqa: E402 - needs the repo root on sys.path
from tests.cluster.conftest import RayCluster, eventually, ray_cluster_running, unavailable  # noqa: E402

#: What part c asks for per session: the least memory_mb a session may have (config.MIN_MEMORY_MB).
BURST_MEMORY_MB = 512
#: The CPU share a session without a cpus limit asks for (cluster/placement.py DEFAULT_CPUS).
SESSION_CPUS = 0.1
#: The smallest burst part c tries when bigger ones fail.
MIN_BURST = 5
#: Each node's warm pool in the pooled lanes (the server's default pool_size).
POOL_SIZE = 2
#: Room each worker keeps beyond its half of part c, at the default memory_mb (2048): part a's default
#: session, a cold create of part b, its node pool (POOL_SIZE) and a claimed pooled session.
SPARE_MEMORY = 10 * 2**30
SPARE_CPUS = 1.0
#: Sessions beside part c's on a worker (its `coderunner-bwrap` units): parts a and b, and its node pool.
SPARE_SESSIONS = 10
#: Bounds: one MCP call; a whole burst; everything closed and gone; the node pools filling.
CALL_TIMEOUT_S = 300.0
BURST_TIMEOUT_S = 1800.0
GONE_TIMEOUT_S = 120.0
POOLS_TIMEOUT_S = 180.0
WARMUP_CALLS = 10
#: How long part c's held sessions sit idle while their CPU is counted.
IDLE_S = 20.0
#: How long the held sessions rest before that (a burst's last kernels finish their first cells).
IDLE_SETTLE_S = 10.0
#: Think time after each create of part b (a pool starts its replacement a moment after a take).
COLD_PAUSE_S = 1.0

PING_SCRIPT = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], namespace="coderunner", logging_level="ERROR", log_to_driver=False)
session_id = sys.argv[2]
_, tag, key = session_id.rsplit("-", 2)
(name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
           if a["name"].startswith("agent-" + tag) and a["name"].endswith("-" + key)]
agent = ray.get_actor(name, namespace="coderunner")
for _ in range(20):
    ray.get(agent.ping.remote(), timeout=30)
samples = []
for _ in range(int(sys.argv[3])):
    began = time.perf_counter()
    ray.get(agent.ping.remote(), timeout=30)
    samples.append(time.perf_counter() - began)
# The node's side of a warm run_python: the same agent call the front door makes, from a bare driver.
from coderunner.edge.callers import LOCAL_CALLER
runs = []
for index in range(20 + int(sys.argv[3])):
    began = time.perf_counter()
    answer = ray.get(agent.call.remote(session_id, "start_run", ["1+1", None, None, LOCAL_CALLER, 1.0]), timeout=60)
    if index >= 20:
        runs.append(time.perf_counter() - began)
    assert answer["update"]["status"] == "done", answer  # a JobUpdate's wire form (sessions/job_updates.py)
print(json.dumps({"ping": samples, "run": runs}))
"""

#: What the cluster holds: each session open in a node agent (`session-<id>`) and any named actor but the agents.
ACTORS_SCRIPT = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
found = []
for a in ray.util.list_named_actors(all_namespaces=True):
    if a["namespace"] != "coderunner":
        continue
    if not a["name"].startswith("agent-"):
        found.append(a["name"])
        continue
    try:
        held = ray.get(ray.get_actor(a["name"], namespace="coderunner").holding.remote(), timeout=30)
    except Exception:
        continue  # it ended meanwhile
    found += ["session-" + session_id for session_id in held["sessions"]]
print(json.dumps(found))
"""

#: Each node agent's process and the sessions it holds.
HOLDERS_SCRIPT = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
found = {}
for a in ray.util.list_named_actors(all_namespaces=True):
    if a["namespace"] == "coderunner" and a["name"].startswith("agent-"):
        try:
            held = ray.get(ray.get_actor(a["name"], namespace="coderunner").holding.remote(), timeout=30)
        except Exception:
            continue  # it ended meanwhile
        found[held["pid"]] = held["sessions"]
print(json.dumps(found))
"""

#: Waits (up to argv[3] s) until the agents that keep a pool (argv[4] of them at least) have argv[2] warm
#: sandboxes ready each; prints what they hold.
POOLS_SCRIPT = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], namespace="coderunner", logging_level="ERROR", log_to_driver=False)
size, deadline = int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "coderunner" and a["name"].startswith("agent-")]
    held = [ray.get(ray.get_actor(name).holding.remote(), timeout=30) for name in names]
    stats = [{"ready": h["warm"], "taken": h["taken"], "node": h["node"][:12]} for h in held if h["pool_size"] > 0]
    if (len(stats) >= int(sys.argv[4]) and all(s["ready"] >= size for s in stats)) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps(stats))
"""


# --- figures ------------------------------------------------------------------------------------------


def pct(samples: list[float], q: float) -> float:
    """The q-quantile in ms (nearest rank, as bench/latency.py's p90)."""
    ordered = sorted(samples)
    return ordered[max(math.ceil(len(ordered) * q) - 1, 0)] * 1000


def line(name: str, samples: list[float]) -> str:
    if not samples:
        return f"{name:46} (no samples)"
    return (
        f"{name:46} median {pct(samples, 0.5):8.2f} ms  p90 {pct(samples, 0.9):8.2f}  "
        f"min {min(samples) * 1000:8.2f}  n {len(samples)}"
    )


def mem_available_mb() -> float:
    with open("/proc/meminfo") as handle:
        for row in handle:
            if row.startswith("MemAvailable:"):
                return int(row.split()[1]) / 1024
    return 0.0


def free_m() -> str:
    done = subprocess.run(["free", "-m"], capture_output=True, text=True, timeout=10)
    return next((row for row in done.stdout.splitlines() if row.startswith("Mem:")), done.stdout.strip())


TICK = os.sysconf("SC_CLK_TCK")
#: What part c's CPU accounting calls each process, by its command line (the first that matches).
CPU_PARTS = (
    ("node agents (Ray workers), main thread", ("ray::NodeAgent", "default_worker.py")),
    ("sandboxes (kernels)", ("bwrap", "ipykernel", "coderunner_guest")),
    ("front doors", ("coderunner.cli serve", "coderunner serve")),
    ("Ray's daemons", ("raylet", "gcs_server", "log_monitor", "dashboard", "monitor.py", "runtime_env", "ray::")),
)


def busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (every core; /proc/stat)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / TICK


def cpu_by_process() -> dict[tuple[int, str], tuple[str, float]]:
    """(pid, start time) -> (part, CPU-seconds so far) for every live process."""
    found: dict[tuple[int, str], tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        part = next((name for name, keys in CPU_PARTS if any(key in argv for key in keys)), "other")
        seconds = (int(rest[11]) + int(rest[12])) / TICK
        if part == CPU_PARTS[0][0]:  # its main thread (Ray's task loop, the imports) apart from the others
            others = _other_threads_cpu(entry)
            found[(int(entry.name), rest[19] + "/threads")] = (ACTOR_THREADS, others)
            seconds -= others
        found[(int(entry.name), rest[19])] = (part, seconds)
    return found


#: A node agent's threads but its main one: its asyncio loop, where its sessions' calls run.
ACTOR_THREADS = "node agents' other threads"


def _other_threads_cpu(process: Path) -> float:
    """CPU-seconds of the live threads of `process` but its main one (ended threads count as the main one's)."""
    total = 0.0
    with contextlib.suppress(OSError):
        for task in os.listdir(process / "task"):
            if task == process.name:
                continue
            with contextlib.suppress(OSError, IndexError):
                rest = (process / "task" / task / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(rest[11]) + int(rest[12])) / TICK
    return total


def cpu_spent(before: dict[tuple[int, str], tuple[str, float]]) -> dict[str, float]:
    """CPU-seconds each part spent since `before` (processes that ended in between are not counted)."""
    spent: Counter[str] = Counter()
    for key, (part, seconds) in cpu_by_process().items():
        spent[part] += seconds - before.get(key, (part, 0.0))[1]
    return dict(spent)


def pss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as handle:
            total += next((int(row.split()[1]) for row in handle if row.startswith("Pss:")), 0)
    return total / 1024


def _argv0(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    return ""


def _descendants(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    pending += [int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
    return found


def agent_pids(cluster: RayCluster) -> list[int]:
    """The processes of live node agents (Ray titles them after the class)."""
    return [pid for pid in cluster.netns_pids() if _argv0(pid).startswith("ray::NodeAgent")]


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


def _parent(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return 0


def sandbox_pids(cluster: RayCluster) -> list[int]:
    """Each sandbox's outermost bwrap in the namespace (what runs inside is in namespaces of its own); not a node
    agent's kernel template, which is its agent's helper and ends with it."""
    return [
        pid for pid in cluster.netns_pids()
        if _comm(pid) == "bwrap" and _comm(_parent(pid)) != "bwrap" and TEMPLATE_MODULE not in _cmdline(pid)
    ]  # fmt: skip


#: What a node agent's kernel template runs (its bwrap's command line holds it).
TEMPLATE_MODULE = b"coderunner_guest.kernel_template"


def template_tree(cluster: RayCluster) -> set[int]:
    """The kernel templates' processes and their children: every kernel forked from a template is the
    template's child, not its sandbox's (guest/kernel_template.py), so its memory is counted from here."""
    return {
        pid for root in cluster.netns_pids()
        if _comm(root) == "bwrap" and TEMPLATE_MODULE in _cmdline(root) for pid in _descendants(root)
    }  # fmt: skip


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def named_actors(cluster: RayCluster) -> list[str] | str:
    done = cluster.run_python(ACTORS_SCRIPT, cluster.address, timeout=120)
    if done.returncode != 0:
        return f"(could not list: {done.stderr.strip()[-300:]})"
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


# --- front doors ----------------------------------------------------------------------------------------


def door_env(cluster: RayCluster, root: Path, **extra: str) -> dict[str, str]:
    """A front door's whole environment: dirs of its own under `root`, no pool, no config file, no export."""
    root.mkdir(mode=0o711)
    root.chmod(0o711)  # a root server's sandbox users must pass through
    env = {
        "PATH": cluster.env["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "CODERUNNER_CONFIG": os.devnull,  # no config file: never the user's own
        "CODERUNNER_RUNTIME_DIR": str(root / "r"),
        "CODERUNNER_TOOLS": "all",
        "CODERUNNER_WORKSPACES_DIR": str(root / "w"),
        "CODERUNNER_TOKEN_FILE": str(root / "token"),
        "CODERUNNER_BACKEND": "bwrap",
        "CODERUNNER_POOL_SIZE": "0",
        "CODERUNNER_EXPORT_DIR": "",
        "CODERUNNER_LOG_LEVEL": "WARNING",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(REPO / "src"),
        **cluster.auth_env,  # the cluster's Ray token (tests/cluster/conftest.py: token authentication is on)
    }
    if "CODERUNNER_SANDBOX_ENV" in os.environ:
        env["CODERUNNER_SANDBOX_ENV"] = os.environ["CODERUNNER_SANDBOX_ENV"]
    env.update(extra)
    return env


@contextlib.asynccontextmanager
async def front_door(cluster: RayCluster, env: dict[str, str], ray: bool) -> AsyncIterator[Client]:
    """A stdio front door inside the cluster's namespace: `serve --ray` (ray) or plain `serve`."""
    argv = [*cluster.exec_prefix, sys.executable, "-m", "coderunner.cli", "serve"]
    if ray:
        argv += ["--ray", cluster.address]
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=str(REPO))
    async with Client(params, read_timeout_seconds=CALL_TIMEOUT_S) as client:
        yield client


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    text = "".join(getattr(block, "text", "") for block in result.content)
    if result.is_error:
        raise RuntimeError(f"{tool}: {text[:800]}")
    try:
        parsed = json.loads(text)  # replies carry their JSON once, as text
    except ValueError:
        return {"text": text}
    return parsed if isinstance(parsed, dict) else {"text": text}


# --- a. warm round trip ---------------------------------------------------------------------------------


async def warm(lanes: dict[str, Client], rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in lanes}
    for client in lanes.values():
        for _ in range(WARMUP_CALLS):  # the first makes the default session (on a node, for the cluster)
            await call(client, "run_python", code="1+1")
    for _ in range(rounds):
        for name in random.sample(list(lanes), len(lanes)):
            began = time.perf_counter()
            await call(lanes[name], "run_python", code="1+1")
            samples[name].append(time.perf_counter() - began)
    return samples


async def oneshots(lanes: dict[str, Client], rounds: int) -> dict[str, list[float]]:
    """d. execute_code print(1) round trips, back to back, the lanes shuffled in each round: a node agent's
    run (its sandbox started ahead after the last run) against the local server's."""
    samples: dict[str, list[float]] = {name: [] for name in lanes}
    for client in lanes.values():
        for _ in range(WARMUP_CALLS):
            await call(client, "execute_code", language="python", code="print(1)")
    for _ in range(rounds):
        for name in random.sample(list(lanes), len(lanes)):
            began = time.perf_counter()
            await call(lanes[name], "execute_code", language="python", code="print(1)")
            samples[name].append(time.perf_counter() - began)
    return samples


def actor_floor(cluster: RayCluster, session_id: str, calls: int) -> dict[str, list[float]]:
    """Bare actor calls to the session's agent from a driver of our own, in the namespace: `ping`, and
    `start_run('1+1')` as the front door calls it (the node's side of a warm run_python)."""
    done = cluster.run_python(PING_SCRIPT, cluster.address, session_id, str(calls), timeout=300)
    if done.returncode != 0:
        print(f"   (the actor-call floor failed: {done.stderr.strip()[-500:]})")
        return {}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# --- b. create to first result --------------------------------------------------------------------------


def pools_full(cluster: RayCluster) -> list[dict[str, Any]]:
    """Waits (bounded) until every worker's agent that keeps a pool has POOL_SIZE ready; what they hold."""
    workers = len(cluster.nodes) - 1
    done = cluster.run_python(
        POOLS_SCRIPT, cluster.address, str(POOL_SIZE), str(POOLS_TIMEOUT_S), str(workers),
        timeout=POOLS_TIMEOUT_S + 120,
    )  # fmt: skip
    if done.returncode != 0:
        return [{"error": done.stderr.strip()[-300:]}]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


async def first_results(cluster: RayCluster, lanes: dict[str, Client], rounds: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {name: [] for name in lanes}
    short: list[str] = []  # rounds that began with a node pool not full
    for index in range(rounds):
        stats = await anyio.to_thread.run_sync(pools_full, cluster)
        if any(entry.get("ready", 0) < POOL_SIZE for entry in stats):
            short.append(f"round {index}: {stats}")
        for name in random.Random(index).sample(list(lanes), len(lanes)):
            client = lanes[name]
            began = time.perf_counter()
            session_id = (await call(client, "create_session"))["session_id"]
            await call(client, "run_python", code="1", session_id=session_id)
            samples[name].append(time.perf_counter() - began)
            await call(client, "manage_sessions", action="close", session_id=session_id)
            await anyio.sleep(COLD_PAUSE_S)
    return {"samples": samples, "short": short}


# --- c. many at once ------------------------------------------------------------------------------------


class Burst:
    """`count` sessions made at once through one front door (each then runs `1`), and closed at once."""

    def __init__(self, client: Client, count: int) -> None:
        self.client = client
        self.count = count
        self.ready: list[float] = []  # seconds from the start to each session's first result
        self.made: dict[str, str] = {}  # session id -> node id ('' on one machine)
        self.errors: list[str] = []
        self.all_ready_s = 0.0
        self.close_s = 0.0
        self.close_errors: list[str] = []
        self.busy_s = 0.0  # the machine's busy CPU-seconds during open()
        self.cpu_parts: dict[str, float] = {}

    @property
    def complete(self) -> bool:
        return len(self.ready) == self.count

    async def open(self) -> Burst:
        processes, busy = cpu_by_process(), busy_s()
        began = time.perf_counter()

        async def one() -> None:
            try:
                made = await call(self.client, "create_session", memory_mb=BURST_MEMORY_MB)
                self.made[made["session_id"]] = made.get("node", "")
                await call(self.client, "run_python", code="1", session_id=made["session_id"])
                self.ready.append(time.perf_counter() - began)
            except Exception as exc:  # counted and shown: a refusal is a finding, not a crash
                self.errors.append(str(exc))

        with anyio.move_on_after(BURST_TIMEOUT_S) as scope:
            async with anyio.create_task_group() as group:
                for _ in range(self.count):
                    group.start_soon(one)
        if scope.cancelled_caught:
            self.errors.append(f"the burst did not finish within {BURST_TIMEOUT_S:.0f} s")
        self.all_ready_s = time.perf_counter() - began
        self.busy_s = busy_s() - busy
        self.cpu_parts = cpu_spent(processes)
        return self

    def cpu_line(self) -> str:
        """Where the machine's CPU went while the burst started: a session's cost, to size a cluster by."""
        cores = os.cpu_count() or 1
        used = self.busy_s / max(self.all_ready_s * cores, 1e-9)
        ranked = sorted(self.cpu_parts.items(), key=lambda item: -item[1])
        parts = ", ".join(f"{part} {seconds / self.count:.2f}" for part, seconds in ranked)
        return (
            f"CPU: the machine was {used:.0%} busy ({cores} cores), {self.busy_s / self.count:.2f} CPU-s per session "
            f"in all; by part, per session: {parts} (processes that ended during the burst not counted)"
        )

    async def close(self) -> None:
        began = time.perf_counter()

        async def one(session_id: str) -> None:
            try:
                await call(self.client, "manage_sessions", action="close", session_id=session_id)
            except Exception as exc:
                self.close_errors.append(str(exc))

        with anyio.move_on_after(BURST_TIMEOUT_S):
            async with anyio.create_task_group() as group:
                for session_id in list(self.made):
                    group.start_soon(one, session_id)
        self.close_s = time.perf_counter() - began


def error_summary(errors: list[str]) -> list[str]:
    return [f"{count} x {text[:400]}" for text, count in Counter(errors).most_common(5)]


class Baseline:
    """What the cluster holds before part c (part a's default session, the pools): part c counts the rest."""

    def __init__(self, cluster: RayCluster) -> None:
        self.cluster = cluster
        self.actors = len(agent_pids(cluster))
        self.sandbox_roots = set(sandbox_pids(cluster))
        self.sandboxes = len(self.sandbox_roots)
        self.template_tree = template_tree(cluster)
        self.names = named_actors(cluster)
        self.mounts = set(self.mounted())

    def mounted(self) -> list[str]:
        """Mounts on the nodes' disks (each session's workspace, and what is staged for its sandbox)."""
        inside = f" {self.cluster.temp_dir}/"
        return [row.split()[1] for row in Path("/proc/mounts").read_text().splitlines() if inside in row]

    def extra(self) -> tuple[int, int]:
        return len(agent_pids(self.cluster)) - self.actors, len(sandbox_pids(self.cluster)) - self.sandboxes

    def left_mounts(self) -> list[str]:
        return sorted(set(self.mounted()) - self.mounts)

    async def settled(self) -> tuple[bool, float]:
        """Whether every session part c made is gone (bounded), and how long that took: no sandbox beyond those
        before, and no more mounts than before beyond one per agent part c started (an agent keeps a workspace made
        ready for its next session; it and the agent itself end once no front door visited it for agent.ORPHAN_S).
        Counted, not compared by path: the burst takes each agent's ready workspace, and the agent makes a new one."""
        began = time.monotonic()

        def gone() -> bool:
            agents, sandboxes = self.extra()
            return sandboxes <= 0 and len(self.mounted()) <= len(self.mounts) + max(agents, 0)

        done = await eventually(gone, GONE_TIMEOUT_S)
        return done, time.monotonic() - began


async def burst_cluster(cluster: RayCluster, client: Client, count: int) -> dict[str, Any]:
    base = await anyio.to_thread.run_sync(Baseline, cluster)
    found: dict[str, Any] = {"tries": []}
    before_mb = mem_available_mb()
    size = count
    while True:  # the largest burst that all started, halving from `count`
        burst = await Burst(client, size).open()
        found["tries"].append(burst)
        if burst.complete or size // 2 < MIN_BURST:
            break
        await burst.close()
        found.setdefault("cleanup", []).append(await base.settled())
        size //= 2
    held = [burst] if burst.complete else []
    if held:  # hold `count` at once, made in waves of the largest burst that all started
        while sum(len(wave.made) for wave in held) < count:
            wave = await Burst(client, min(size, count - sum(len(w.made) for w in held))).open()
            held.append(wave)
            if not wave.complete:
                break
        found["waves"] = held
        await anyio.sleep(3)  # settle: the sessions' first allocations
        alive = sum(len(wave.made) for wave in held)
        found["held"] = alive
        found["mem"] = (before_mb, mem_available_mb())
        found["free_peak"] = free_m()
        actors, sandboxes = agent_pids(cluster), sandbox_pids(cluster)
        new_actors, new_sandboxes = base.extra()
        found["actors"] = (new_actors, pss_mb(actors) / max(len(actors), 1), len(actors))
        kernels = template_tree(cluster) - base.template_tree  # the forked kernels (their sandboxes' programs)
        mine = {session_id for wave in held for session_id in wave.made}
        holders = await anyio.to_thread.run_sync(holding_agents, cluster, mine)
        theirs = {pid for root in set(sandboxes) - base.sandbox_roots for pid in _descendants(root)} | kernels
        found["idle"] = await idle_cpu(alive, holders, theirs)
        sandbox_pss = pss_mb([pid for root in sandboxes for pid in _descendants(root)] + sorted(kernels))
        found["sandboxes"] = (new_sandboxes, sandbox_pss / max(len(sandboxes), 1))
        names = {node.node_id: name for name, node in cluster.nodes.items()}
        placed = Counter(names.get(node, node[:12] or "?") for wave in held for node in wave.made.values())
        found["placed"] = dict(placed)
    closing = held or [burst]
    began = time.perf_counter()
    async with anyio.create_task_group() as group:
        for wave in closing:
            group.start_soon(wave.close)
    found["close_s"] = time.perf_counter() - began
    found["close_errors"] = [text for wave in closing for text in wave.close_errors]
    found["gone"] = await base.settled()
    names_now = await anyio.to_thread.run_sync(named_actors, cluster)
    if isinstance(names_now, str) or isinstance(base.names, str):
        found["left_names"] = names_now
    else:
        found["left_names"] = sorted(set(names_now) - set(base.names))
    found["left"] = base.extra()
    found["left_mounts"] = base.left_mounts()
    found["free_after"] = free_m()
    return found


def holding_agents(cluster: RayCluster, sessions: set[str]) -> set[int]:
    """The processes of the node agents that hold any of `sessions`."""
    done = cluster.run_python(HOLDERS_SCRIPT, cluster.address, timeout=120)
    if done.returncode != 0:
        return set()
    found: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(pid) for pid, held in found.items() if sessions & set(held)}


def process_cpu_s(pids: set[int]) -> dict[int, float]:
    """CPU-seconds so far of each of `pids` (all its threads) that still runs."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            found[pid] = (int(rest[11]) + int(rest[12])) / TICK
    return found


async def idle_cpu(held: int, agents: set[int], sandboxes: set[int]) -> dict[str, float]:
    """CPU the held sessions spend sitting idle for IDLE_S, once IDLE_SETTLE_S passed, as % of a core per
    session: the agents that hold them (all their threads), their sandboxes and kernels, and the rest of the
    machine (other agents, Ray's idle workers and daemons, the front doors) beside."""
    await anyio.sleep(IDLE_SETTLE_S)
    before, busy_before = process_cpu_s(agents | sandboxes), busy_s()
    await anyio.sleep(IDLE_S)
    after, busy = process_cpu_s(agents | sandboxes), busy_s() - busy_before
    spent = {pid: after[pid] - before[pid] for pid in after if pid in before}
    own_agents = sum(spent.get(pid, 0.0) for pid in agents)
    own_sandboxes = sum(spent.get(pid, 0.0) for pid in sandboxes)
    per = 100.0 / IDLE_S / max(held, 1)
    return {"percent": (own_agents + own_sandboxes) * per, "agents": own_agents * per,
            "sandboxes": own_sandboxes * per, "holders": len(agents),
            "rest": (busy - own_agents - own_sandboxes) * 100.0 / IDLE_S}  # fmt: skip


async def burst_local(cluster: RayCluster, client: Client, count: int) -> dict[str, Any]:
    had = set(sandbox_pids(cluster))  # the cluster's sessions and pools, the local pool's
    had_tree = template_tree(cluster)
    burst = await Burst(client, count).open()
    await anyio.sleep(3)
    mine = [pid for pid in sandbox_pids(cluster) if pid not in had]
    kernels = template_tree(cluster) - had_tree  # the forked kernels (their sandboxes' programs)
    sandboxes_pss = pss_mb([pid for root in mine for pid in _descendants(root)] + sorted(kernels))
    await burst.close()
    await eventually(lambda: len(sandbox_pids(cluster)) <= len(had), GONE_TIMEOUT_S)
    return {"burst": burst, "sandboxes": len(mine), "sandboxes_pss": sandboxes_pss}


# --- the run --------------------------------------------------------------------------------------------


def size_workers(sessions: int) -> tuple[int, int, int]:
    """What each worker advertises: room for its half of part c plus parts a and b (at least the fixture's;
    `ray start --num-cpus` takes whole CPUs): memory, CPUs and sessions (its `coderunner-bwrap` units)."""
    half = math.ceil(sessions / 2)
    memory = max(fixture.WORKER_MEMORY, half * BURST_MEMORY_MB * 2**20 + SPARE_MEMORY)
    cpus = max(fixture.WORKER_CPUS, math.ceil(half * SESSION_CPUS + SPARE_CPUS))
    slots = max(fixture.BWRAP_SLOTS, half + SPARE_SESSIONS)
    return memory, cpus, slots


async def run(cluster: RayCluster, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    limit = str(args.sessions + 10)
    limits = {"CODERUNNER_MAX_SESSIONS": limit, "CODERUNNER_MAX_SESSIONS_PER_CLIENT": limit}
    doors = {  # lane: (serve --ray?, pool_size)
        "cluster": (True, 0),
        "local": (False, 0),
        "cluster, node pool": (True, POOL_SIZE),
        "local, pool": (False, POOL_SIZE),
    }
    figures: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        # Not under a cancel scope: the clients' task groups must be left in the scope they were entered in
        # (the SDK bounds its own start and stop; the namespace's teardown ends whatever is left).
        lanes: dict[str, Client] = {}
        for index, (lane, (ray, pool)) in enumerate(doors.items()):
            env = door_env(cluster, root / f"d{index}", CODERUNNER_POOL_SIZE=str(pool), **limits)
            lanes[lane] = await stack.enter_async_context(front_door(cluster, env, ray=ray))
        for client in lanes.values():
            await call(client, "manage_sessions", action="list")  # up and answering (the pools start filling)
        await anyio.to_thread.run_sync(pools_full, cluster)  # none of the warm calls shares the CPU with them
        await anyio.sleep(3)  # nor with the local pool's
        if args.rounds > 0:  # 0: skip part a
            figures["warm"] = await warm({lane: lanes[lane] for lane in ("cluster", "local")}, args.rounds)
            status = await call(lanes["cluster"], "manage_sessions", action="status")
            nodes = {node.node_id: name for name, node in cluster.nodes.items()}
            figures["home"] = nodes.get(status.get("node", ""), "?")
            figures["floor"] = await anyio.to_thread.run_sync(actor_floor, cluster, status["session_id"], args.rounds)
            print_warm(figures)
        if args.oneshots > 0:  # 0: skip part d
            figures["oneshot"] = await oneshots({lane: lanes[lane] for lane in ("cluster", "local")}, args.oneshots)
            print_oneshots(figures["oneshot"])
        if args.colds > 0:  # 0: skip part b
            figures["first"] = await first_results(cluster, lanes, args.colds)
            print_first(figures["first"])
        if args.sessions > 0:
            figures["burst"] = await burst_cluster(cluster, lanes["cluster"], args.sessions)
            print_burst(figures["burst"], args.sessions)
            if args.local_burst:
                figures["local_burst"] = await burst_local(cluster, lanes["local"], args.sessions)
                print_local_burst(figures["local_burst"], args.sessions)
        await stack.aclose()  # the front doors go: each closes its default session
    print_table(figures, args)
    return figures


def print_warm(figures: dict[str, Any]) -> None:
    warm_samples = figures["warm"]
    cl, lo = warm_samples["cluster"], warm_samples["local"]
    paired = [c - loc for c, loc in zip(cl, lo, strict=True)]
    print(
        f"\na. warm run_python('1+1'), {len(cl)} rounds, one call per lane each, shuffled "
        f"(the cluster session on {figures['home']})"
    )
    print(line("cluster front door (serve --ray)", cl))
    print(line("local front door (serve, bwrap)", lo))
    print(
        f"   cluster - local: medians {pct(cl, 0.5) - pct(lo, 0.5):+.2f} ms, p90s {pct(cl, 0.9) - pct(lo, 0.9):+.2f} "
        f"ms, median of round-by-round differences {statistics.median(paired) * 1000:+.2f} ms  "
        "(the issue's target: <= +1 ms)"
    )
    floor = figures["floor"]
    if floor:
        print("   from a driver of our own (blocks after the rounds, not interleaved):")
        print(line("bare Ray actor call (ping)", floor["ping"]))
        print(line("actor start_run('1+1'), as a front door", floor["run"]))


def print_oneshots(samples: dict[str, list[float]]) -> None:
    print(f"\nd. execute_code('print(1)'), {len(samples['cluster'])} rounds back to back, shuffled")
    print(line("cluster front door (a node agent's run)", samples["cluster"]))
    print(line("local front door (serve, bwrap)", samples["local"]))


def print_first(found: dict[str, Any]) -> None:
    samples = found["samples"]
    print(
        f"\nb. create_session + run_python('1'), {len(samples['cluster'])} shuffled rounds "
        f"(pools: {POOL_SIZE} per worker node / {POOL_SIZE} on the local server, full at each round's start)"
    )
    for lane, label in (
        ("cluster, node pool", "cluster, from a node's warm pool"),
        ("local, pool", "local, from the server's warm pool"),
        ("cluster", "cluster, cold (a sandbox by a node agent)"),
        ("local", "local, cold (a sandbox)"),
    ):
        print(line(label, samples[lane]))
    pooled, cold = pct(samples["cluster, node pool"], 0.5), pct(samples["cluster"], 0.5)
    print(
        f"   cluster - local: pooled {pooled - pct(samples['local, pool'], 0.5):+.1f} ms, cold "
        f"{cold - pct(samples['local'], 0.5):+.1f} ms (medians). The issue's target: 15 ms from a node's pool"
    )
    for text in found["short"]:
        print(f"   a node pool was not full: {text}")


def print_burst(found: dict[str, Any], count: int) -> None:
    print(
        f"\nc. sessions at once through one cluster front door (memory_mb={BURST_MEMORY_MB}, cpus {SESSION_CPUS}, "
        "no pool)"
    )
    for index, burst in enumerate(found["tries"]):
        print(f"   {burst.count} at once: first result in {len(burst.ready)}/{burst.count}, {burst.all_ready_s:.1f} s")
        if burst.ready:
            print(line("      each session's start to first result", burst.ready))
            print(f"      {burst.cpu_line()}")
        for text in error_summary(burst.errors):
            print(f"      refused/failed: {text}")
        cleanup = found.get("cleanup", [])
        if index < len(cleanup):
            gone, seconds = cleanup[index]
            print(f"      closed; its sandboxes gone: {gone} ({seconds:.1f} s)")
    if "held" in found:
        waves = found["waves"]
        before_mb, peak_mb = found["mem"]
        print(
            f"   held at once: {found['held']} sessions (in {len(waves)} wave(s) of up to {waves[0].count}: "
            + ", ".join(f"{len(w.ready)}/{w.count} in {w.all_ready_s:.1f} s" for w in waves)
            + f"); placed: {found['placed']}"
        )
        for wave in waves[1:]:
            for text in error_summary(wave.errors):
                print(f"      refused/failed: {text}")
        actors, actor_pss, agents = found["actors"]
        sandboxes, sandbox_pss = found["sandboxes"]
        print(
            f"   alive: {agents} node agent processes ({actors:+d} for part c; PSS {actor_pss:.1f} MiB each, "
            f"{actor_pss * agents / max(found['held'], 1):.1f} MiB per held session), "
            f"{sandboxes} more sandboxes (PSS {sandbox_pss:.1f} MiB each)"
        )
        if found["held"]:
            print(
                f"   host MemAvailable {before_mb:.0f} MiB before part c -> {peak_mb:.0f} MiB with them alive: "
                f"{(before_mb - peak_mb) / found['held']:.1f} MiB per session (its sandbox and its share of an agent)"
            )
            idle = found["idle"]
            print(
                f"   idle for {IDLE_S:g} s with them alive ({IDLE_SETTLE_S:g} s after they were): "
                f"{idle['percent']:.3f}% of a core per held session (the {idle['holders']} agents holding them "
                f"{idle['agents']:.3f}%, their sandboxes {idle['sandboxes']:.3f}%); the rest of the machine "
                f"meanwhile {idle['rest']:.1f}% of a core (other agents, Ray's idle workers and daemons, front doors)"
            )
        print(f"   free -m with them alive: {found['free_peak']}")
    else:
        print(f"   no burst of {MIN_BURST} or more started completely: nothing held")
    print(f"   closed at once in {found['close_s']:.1f} s; close errors: {len(found['close_errors'])}")
    for text in error_summary(found["close_errors"]):
        print(f"      close failed: {text}")
    gone, seconds = found["gone"]
    left_actors, left_sandboxes = found["left"]
    print(
        f"   afterwards: all sessions gone: {gone} ({seconds:.1f} s after the last close answered); sessions or "
        f"named actors left: {found['left_names'] or 'none'}; sandboxes left {left_sandboxes}; agents part c started "
        f"{left_actors} (each stays, with its kernel template and a workspace made ready, until no front door "
        "visited it for 300 s)"
    )
    left_mounts = found["left_mounts"]
    print(
        f"   mounts on the nodes' disks not there before part c: {len(left_mounts)}"
        + (
            f" (each agent's workspace made ready anew, the old one taken; and one per agent part c started), e.g. "
            f"{left_mounts[:2]}"
            if left_mounts
            else ""
        )
    )
    print(f"   free -m afterwards:    {found['free_after']}")


def print_local_burst(found: dict[str, Any], count: int) -> None:
    burst: Burst = found["burst"]
    print(f"\nc'. the same {count} at once through the local front door (baseline, after the cluster's)")
    print(f"   first result in {len(burst.ready)}/{count}, {burst.all_ready_s:.1f} s; closed in {burst.close_s:.1f} s")
    if burst.ready:
        print(line("      each session's start to first result", burst.ready))
        print(f"      {burst.cpu_line()}")
    print(
        f"   {found['sandboxes']} sandboxes alive, PSS {found['sandboxes_pss'] / (found['sandboxes'] or 1):.1f} MiB "
        "each (one server process for all of them here)"
    )
    for text in error_summary(burst.errors):
        print(f"      refused/failed: {text}")


def print_table(figures: dict[str, Any], args: argparse.Namespace) -> None:
    print("\nsummary (ms unless said)            cluster     local   cluster-local")
    rows = []
    if "warm" in figures:
        warm_samples = figures["warm"]
        rows += [
            ("warm 1+1, median", pct(warm_samples["cluster"], 0.5), pct(warm_samples["local"], 0.5)),
            ("warm 1+1, p90", pct(warm_samples["cluster"], 0.9), pct(warm_samples["local"], 0.9)),
        ]
    if "first" in figures:
        first = figures["first"]["samples"]
        rows += [
            ("create to first result, pool", pct(first["cluster, node pool"], 0.5), pct(first["local, pool"], 0.5)),
            ("create to first result, cold", pct(first["cluster"], 0.5), pct(first["local"], 0.5)),
        ]
    if "oneshot" in figures:
        runs = figures["oneshot"]
        rows.append(("execute_code print(1), median", pct(runs["cluster"], 0.5), pct(runs["local"], 0.5)))
    for name, ours, theirs in rows:
        print(f"{name:34} {ours:9.1f} {theirs:9.1f} {ours - theirs:+15.1f}")
    if "burst" in figures:
        found = figures["burst"]
        complete = [burst for burst in found["tries"] if burst.complete]
        cluster_text = f"{complete[0].count} in {complete[0].all_ready_s:.1f} s" if complete else "none"
        local = figures.get("local_burst")
        local_burst = local["burst"] if local else None
        local_text = (
            f"{len(local_burst.ready)}/{local_burst.count} answered in {local_burst.all_ready_s:.1f} s"
            if local_burst is not None
            else "-"
        )
        print(f"largest burst that all started: cluster {cluster_text} (asked: {args.sessions}); local: {local_text}")
        if "held" in found:
            print(f"sessions held at once through the cluster: {found['held']}")


def warm_figure(warm_samples: dict[str, list[float]]) -> Figure:
    cl, lo = pct(warm_samples["cluster"], 0.5), pct(warm_samples["local"], 0.5)
    paired = statistics.median(c - loc for c, loc in zip(warm_samples["cluster"], warm_samples["local"], strict=True))
    return Figure("warm run_python('1+1') through a cluster front door, median", round(cl, 2), "ms",
                  baseline=round(lo, 2), baseline_name="local front door (serve, bwrap), same rounds",
                  target="<= local + 1 ms", met=cl - lo <= 1.0,
                  notes=f"median of round-by-round differences {paired * 1000:+.2f} ms")  # fmt: skip


def first_figures(first: dict[str, list[float]]) -> list[Figure]:
    pooled, local_pooled = pct(first["cluster, node pool"], 0.5), pct(first["local, pool"], 0.5)
    return [
        Figure("create_session to first result from a node's warm pool, median", round(pooled, 1), "ms",
               baseline=round(local_pooled, 1), baseline_name="local server's warm pool", target="<= 15 ms",
               met=pooled <= 15.0),
        Figure("create_session to first result, cold, median", round(pct(first["cluster"], 0.5), 1), "ms",
               baseline=round(pct(first["local"], 0.5), 1), baseline_name="local, cold"),
    ]  # fmt: skip


def summary_figures(figures: dict[str, Any], args: argparse.Namespace) -> list[Figure]:
    """The issue's three targets (and the memory a held session costs), each beside its local baseline."""
    found: list[Figure] = []
    if "warm" in figures:
        found.append(warm_figure(figures["warm"]))
    if "first" in figures:
        found += first_figures(figures["first"]["samples"])
    burst = figures.get("burst")
    if burst is not None:
        whole = burst["tries"][0]
        local = figures.get("local_burst")
        local_s = round(local["burst"].all_ready_s, 1) if local and local["burst"].complete else None
        found.append(Figure(
            f"{args.sessions} sessions at once through one cluster front door, all answered",
            round(whole.all_ready_s, 1), "s", baseline=local_s, baseline_name="the same burst, local front door",
            target="100 in <= 20 s" if args.sessions == 100 else "100 in <= 20 s (this run asked another count)",
            met=(whole.complete and whole.all_ready_s <= 20.0) if args.sessions == 100 else None,
            notes=f"{len(whole.ready)}/{whole.count} answered",
        ))  # fmt: skip
        if burst.get("held"):
            before_mb, peak_mb = burst["mem"]
            _, actor_pss, agents = burst["actors"]
            _, sandbox_pss = burst["sandboxes"]
            per_session = round((before_mb - peak_mb) / burst["held"], 1)
            found.append(Figure(
                "host memory per held cluster session (MemAvailable drop)", per_session, "MiB",
                target="<= 40 MiB", met=per_session <= 40.0,
                notes=f"{burst['held']} held; PSS: {agents} agents, {actor_pss:.0f} MiB each; "
                f"sandbox {sandbox_pss:.0f} MiB",
            ))  # fmt: skip
            found.append(Figure(
                "idle CPU per held cluster session", round(burst["idle"]["percent"], 3), "% of a core",
                target="<= 0.05%", met=burst["idle"]["percent"] <= 0.05,
            ))  # fmt: skip
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=50, help="warm rounds (one call per lane each)")
    parser.add_argument("--colds", type=int, default=10, help="create-to-first-result rounds (four lanes each)")
    parser.add_argument("--oneshots", type=int, default=30, help="execute_code rounds (one call per lane each)")
    parser.add_argument("--sessions", type=int, default=100, help="sessions at once in part c (0: skip it)")
    parser.add_argument("--no-local-burst", dest="local_burst", action="store_false", help="skip part c's baseline")
    add_summary_argument(parser)
    args = parser.parse_args()
    if reason := unavailable():
        print(f"bench/cluster.py {reason}", file=sys.stderr)
        return 2
    fixture.WORKER_MEMORY, fixture.WORKER_CPUS, fixture.BWRAP_SLOTS = size_workers(args.sessions)
    print(
        f"cluster: a head and two workers in a private network namespace; each worker advertises "
        f"{fixture.WORKER_CPUS:g} CPU, {fixture.WORKER_MEMORY / 2**30:.1f} GiB memory, "
        f"{fixture.BWRAP_RESOURCE}: {fixture.BWRAP_SLOTS} (logical; this machine: {os.cpu_count()} cores, "
        f"{mem_available_mb():,.0f} MiB available)"
    )
    root = Path(tempfile.mkdtemp(prefix="crr-", dir="/tmp"))  # short: ipc socket paths stay under 107 bytes
    root.chmod(0o711)
    began = time.monotonic()
    cluster: RayCluster | None = None
    try:
        with ray_cluster_running() as cluster:
            print(
                f"cluster up in {time.monotonic() - began:.0f} s; nodes: "
                + ", ".join(f"{name} {node.node_id[:12]}" for name, node in cluster.nodes.items())
            )
            figures = anyio.run(run, cluster, root, args)
        write_summary(args.summary, "cluster", summary_figures(figures, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if cluster is not None and cluster.teardown is not None:
            report = cluster.teardown
            print(
                f"\nteardown: {report.seconds:.1f} s; killed at teardown (still in the namespace once the nodes "
                f"stopped): {len(report.strays)} {report.strays[:3] or ''}; survivors: {report.survivors or 'none'}; "
                f"after release: {report.after_release or 'none'}; mounts left on the nodes' disks after "
                f"coderunner's clean-up: {getattr(report, 'left_on_disks', '(not checked)') or 'none'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
