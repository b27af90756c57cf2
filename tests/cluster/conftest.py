"""A real Ray cluster (a head and two workers, three `ray start --block` processes) in a network namespace.

Ray listens on every interface whatever --node-ip-address says, so the whole cluster runs in a network
namespace of the test's own that has only loopback: nothing of it is reachable from the host or the
network, and each cluster can use Ray's default port (two test files on two xdist workers never collide).

The namespace is held by a process of ours (`unshare --net`), never named under /run/netns, as in
tests/netns_servers.py: the first `ip netns add` on a machine bind-mounts /run/netns over itself, which
hides the namespace files of podman containers running at that moment. `exec_prefix` (nsenter) runs any
command inside it, and `netns_pids()` plays `ip netns pids`.

Each node is a `ray start --block` in a session of its own: its pid is its session id, which every
process of that node keeps (Ray's core workers, the actors, lead process groups of their own, so a
process group is not enough), so teardown and `kill_raylet` reach exactly that node's processes. Teardown
stops the workers before the head (a stopping worker still talks to the head's GCS, and waits for it if
it is gone), kills whatever is still in the namespace, releases the namespace and removes the temp dir;
the fixture then asserts that nothing was left in the namespace.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

REPO = Path(__file__).resolve().parents[2]
#: The venv's interpreter and its `ray` script (not resolved: a venv's python is a symlink to the system's).
PYTHON = Path(sys.executable)
RAY = PYTHON.with_name("ray")
#: Ray's default; the namespace is private, so every cluster can have it.
HEAD_PORT = 6379
WORKERS = ("w1", "w2")
#: Every worker advertises it (the head does not): sessions ask for a share, so none lands on the head.
BWRAP_RESOURCE = "coderunner-bwrap"
BWRAP_SLOTS = 100
WORKER_CPUS = 2
WORKER_MEMORY = 4 * 2**30
#: Small (Ray's default is 30% of memory per node): three nodes share one machine's /dev/shm.
OBJECT_STORE_MEMORY = 256 * 2**20
#: Bound on the whole start, head to node ids (about 10 s on an idle machine; a loaded 2-core one is slower).
START_TIMEOUT_S = 180.0
#: How long a node has after SIGTERM to its `ray start` before SIGKILL (it takes about 2 s).
STOP_GRACE_S = 15.0
#: How long SIGKILLed processes have to be gone.
KILL_WAIT_S = 10.0
#: The holder's own bound, should we be killed before teardown (a cluster module takes minutes).
HOLDER_LIFETIME_S = 4 * 3600
STARTED = "Ray runtime started."
#: A driver's ray.init keywords: Ray's logs stay off its stdout, where scripts print their result as the last line.
DRIVER_INIT = 'logging_level="ERROR", log_to_driver=False'

NODES_SCRIPT = f"""
import json, sys, time
import ray
ray.init(address=sys.argv[1], {DRIVER_INIT})
deadline = time.monotonic() + float(sys.argv[2])
while True:
    alive = [node for node in ray.nodes() if node["Alive"]]
    if len(alive) >= int(sys.argv[3]) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({{node["NodeID"]: node["Resources"] for node in alive}}))
"""


@dataclass
class RayNode:
    """One `ray start --block`: its pid is its session id and process group."""

    name: str
    process: subprocess.Popen[bytes]
    #: Where its `ray start` writes (a file, not a pipe: a full pipe would block the node).
    output: Path
    node_id: str = ""
    resources: dict[str, float] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class TeardownReport:
    """What teardown found, for the fixture's final assertion."""

    #: In the namespace once the nodes' process groups were stopped (teardown killed them).
    strays: list[str] = field(default_factory=list)
    #: Still in the namespace after that kill, before the namespace was released: must be empty.
    survivors: list[str] = field(default_factory=list)
    #: Processes still in the namespace after the holder was killed: must be empty.
    after_release: list[str] = field(default_factory=list)
    #: Mounts left on the workers' disks after coderunner's own clean-up of dead sessions: must be empty.
    left_on_disks: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, session id) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[3])


def _argv(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    return []


def _describe(pid: int) -> str:
    """pid, state, session and command line: enough to tell which node a leftover came from."""
    state, sid = _stat(pid) or ("gone", 0)
    return f"{pid} {state} sid={sid} {' '.join(_argv(pid))[:200]}"


def _live_pids() -> Iterator[int]:
    """Every process that is not a zombie (a zombie holds no namespace and cannot be killed)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] != "Z":
                yield int(entry)


def _session_pids(sid: int) -> list[int]:
    """The live processes of a node: `ray start` and all it started keep its session (none calls setsid)."""
    return [pid for pid in _live_pids() if (stat := _stat(pid)) is not None and stat[1] == sid]


def _netns_inode(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    return None


def _wait_until(done: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Polls `done` until it holds or `timeout` passes; whether it held."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


async def eventually(predicate: Callable[[], Any], timeout_s: float = 30.0) -> bool:
    """Polls `predicate` (blocking: run in a worker thread) every 0.5 s until it holds or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await anyio.to_thread.run_sync(predicate):
            return True
        await anyio.sleep(0.5)
    return bool(await anyio.to_thread.run_sync(predicate))


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return f"({path} unreadable)"


#: Ray's token authentication: every node, front door and driver of a cluster gets that cluster's token.
RAY_AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def ray_env() -> dict[str, str]:
    """All the Ray processes get: never the host's environment (API keys must not reach the cluster).

    Ray's token authentication is on, with a random token per cluster: a process that reaches Ray's ports
    without it runs nothing (test_cluster_auth.py). The token is in every Ray process's environment, as an
    env-var token is on a real node, so the env-leak tests also show it never reaches a sandbox.
    """
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "PATH": f"{PYTHON.parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "RAY_USAGE_STATS_ENABLED": "0",
        # A SIGTERMed node otherwise drains for up to 30 s first (it waits for its actors: detached ones never go).
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        # So that actors can import coderunner.
        "PYTHONPATH": str(REPO / "src"),
    }


@dataclass
class RayCluster:
    """A head and two workers in a namespace of their own; `exec_prefix` runs a command beside them."""

    netns: str
    temp_dir: Path
    holder: subprocess.Popen[bytes]
    netns_inode: int
    env: dict[str, str] = field(default_factory=ray_env)
    nodes: dict[str, RayNode] = field(default_factory=dict)
    address: str = f"127.0.0.1:{HEAD_PORT}"
    python: str = str(PYTHON)
    #: Filled in by teardown.
    teardown: TeardownReport | None = None

    @property
    def auth_env(self) -> dict[str, str]:
        """What a front door or driver needs to be let in: Ray's auth mode and this cluster's token."""
        return {key: self.env[key] for key in RAY_AUTH}

    @property
    def exec_prefix(self) -> list[str]:
        """argv prefix that runs a command in the cluster's namespace (add `env=cluster.env` to Popen/run)."""
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--"]

    def run_python(self, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Runs `python -c code args...` inside the namespace with the cluster's env (a Ray driver, say)."""
        return subprocess.run(
            [*self.exec_prefix, self.python, "-c", code, *args],
            env=self.env, cwd=self.temp_dir, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def netns_pids(self) -> list[int]:
        """The live processes in the namespace, the holder left out (what `ip netns pids` would list)."""
        return [pid for pid in _live_pids() if pid != self.holder.pid and _netns_inode(pid) == self.netns_inode]

    def node_pids(self, name: str) -> list[int]:
        """The live processes of one node (its `ray start`, raylet, GCS, agents, core workers)."""
        return _session_pids(self.nodes[name].pid)

    def kill_raylet(self, name: str) -> int:
        """SIGKILLs that node's raylet only (its actors become unavailable; its `ray start` then stops the rest)."""
        raylets = [pid for pid in self.node_pids(name) if Path((_argv(pid) or [""])[0]).name == "raylet"]
        if len(raylets) != 1:
            raise RuntimeError(f"node {name}: expected one raylet, found {raylets}")
        os.kill(raylets[0], signal.SIGKILL)
        return raylets[0]

    def wait_node_down(self, name: str, timeout: float = 60) -> None:
        """Until none of the node's processes is left (after `kill_raylet` its `ray start` stops them in ~1 s).

        Its actors' core workers outlive the raylet for a moment and still answer calls meanwhile.
        """
        if not _wait_until(lambda: not self.node_pids(name), timeout, interval=0.2):
            left = [_describe(pid) for pid in self.node_pids(name)]
            raise RuntimeError(f"node {name} still has processes after {timeout:.0f} s: {left}")


def _start_holder(label: str) -> subprocess.Popen[bytes]:
    """A process in a new network namespace that keeps it alive (argv[0] is the label, to find leaks by)."""
    return subprocess.Popen(
        ["unshare", "--net", "--", "bash", "-c", 'exec -a "$0" sleep "$1"', label, str(HOLDER_LIFETIME_S)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C of pytest must not take the namespace from under the nodes
    )  # fmt: skip


def _make_namespace(label: str, temp_dir: Path) -> RayCluster:
    holder = _start_holder(label)
    own = _netns_inode(os.getpid())
    if not _wait_until(lambda: _netns_inode(holder.pid) not in (own, None), timeout=10):
        holder.kill()
        raise RuntimeError("unshare --net did not make a namespace")
    inode = _netns_inode(holder.pid)
    assert inode is not None
    cluster = RayCluster(netns=label, temp_dir=temp_dir, holder=holder, netns_inode=inode)
    try:
        lo_up = [*cluster.exec_prefix, "ip", "link", "set", "lo", "up"]
        subprocess.run(lo_up, check=True, capture_output=True, timeout=10)
    except BaseException:
        holder.kill()
        holder.wait(timeout=KILL_WAIT_S)
        raise
    return cluster


#: Each worker carries this label, its name as the value (for `ray_node_labels`).
NODE_LABEL = "coderunner-test-node"


def _node_argv(cluster: RayCluster, name: str) -> list[str]:
    common = [
        "--block", "--node-ip-address=127.0.0.1", f"--temp-dir={cluster.temp_dir}", "--disable-usage-stats",
        f"--object-store-memory={OBJECT_STORE_MEMORY}",
    ]  # fmt: skip
    if name == "head":
        role = ["--head", f"--port={HEAD_PORT}", "--num-cpus=1", "--include-dashboard=false"]
    else:
        resources = {f"coderunner-node-{name}": 1, BWRAP_RESOURCE: BWRAP_SLOTS}
        role = [
            f"--address={cluster.address}", f"--num-cpus={WORKER_CPUS}", f"--memory={WORKER_MEMORY}",
            f"--resources={json.dumps(resources)}", f"--labels={NODE_LABEL}={name}",
        ]  # fmt: skip
    return [*cluster.exec_prefix, str(RAY), "start", *role, *common]


def node_disks(cluster: RayCluster, name: str) -> dict[str, str]:
    """A node's own disks, as on a machine of its own: its session dirs, workspaces, snapshot store and export
    folder. Its sandboxes' uids must pass through (o+x), as /var/lib/coderunner lets them on a real node."""
    root = cluster.temp_dir / name
    root.mkdir(mode=0o711, exist_ok=True)
    os.chmod(cluster.temp_dir, 0o711)
    return {"CODERUNNER_RUNTIME_DIR": str(root / "run"), "CODERUNNER_WORKSPACES_DIR": str(root / "ws"),
            "CODERUNNER_EXPORT_DIR": str(root / "out")}  # fmt: skip


def _start_node(cluster: RayCluster, name: str) -> RayNode:
    output = cluster.temp_dir / f"{name}.out"
    env = {**cluster.env, **(node_disks(cluster, name) if name != "head" else {})}
    with output.open("wb") as sink:
        process = subprocess.Popen(
            _node_argv(cluster, name),
            env=env, cwd=cluster.temp_dir, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    node = RayNode(name=name, process=process, output=output)
    cluster.nodes[name] = node
    return node


def _failure(cluster: RayCluster, node: RayNode, why: str) -> str:
    """A start failure with the node's output and the tails of Ray's error logs (the raylet's reason is there)."""
    logs = cluster.temp_dir / "session_latest" / "logs"
    errors = [path for path in sorted(logs.glob("*.err")) if path.stat().st_size > 0] if logs.is_dir() else []
    parts = [f"ray node {node.name} {why}", f"--- {node.output.name}:\n{_tail(node.output)}"]
    parts += [f"--- {path.name}:\n{_tail(path, 8)}" for path in errors]
    return "\n".join(parts)


def _wait_started(cluster: RayCluster, node: RayNode, deadline: float) -> None:
    """Until its `ray start` says the node is up (registered with the GCS), or it exits, or the deadline."""
    while STARTED not in node.output.read_text(errors="replace"):
        if node.process.poll() is not None:
            raise RuntimeError(_failure(cluster, node, f"exited with {node.process.returncode} during start"))
        if time.monotonic() > deadline:
            raise RuntimeError(_failure(cluster, node, f"not up after {START_TIMEOUT_S:.0f} s"))
        time.sleep(0.2)


def _find_node_ids(cluster: RayCluster, deadline: float) -> None:
    """Node ids from Ray itself: the head by Ray's head marker, each worker by its own resource."""
    left = max(deadline - time.monotonic(), 1.0)
    done = cluster.run_python(NODES_SCRIPT, cluster.address, str(left), str(len(cluster.nodes)), timeout=left + 30)
    if done.returncode != 0:
        raise RuntimeError(f"listing the cluster's nodes failed ({done.returncode}):\n{done.stderr[-3000:]}")
    found: dict[str, dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    for node in cluster.nodes.values():
        marker = "node:__internal_head__" if node.name == "head" else f"coderunner-node-{node.name}"
        matches = [node_id for node_id, resources in found.items() if marker in resources]
        if len(matches) != 1:
            raise RuntimeError(f"node {node.name}: {len(matches)} alive nodes with {marker!r} in {found}")
        node.node_id, node.resources = matches[0], found[matches[0]]


def start_cluster(cluster: RayCluster) -> None:
    """The head, then each worker in turn: two nodes starting at once on one host take the same socket names."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for name in ("head", *WORKERS):
        _wait_started(cluster, _start_node(cluster, name), deadline)
    _find_node_ids(cluster, deadline)


def _stop_nodes(nodes: list[RayNode]) -> None:
    """SIGTERM each node's `ray start`, up to STOP_GRACE_S for its session to empty, then SIGKILL what is left.

    The `ray start` alone, not its group: it then stops its processes in order (about 2 s), while a SIGTERM
    to the whole group left the head's GCS and `ray start` up for over 30 s. What is left is killed by
    session, not only by group: Ray's core workers (the actors) are process group leaders of their own.
    """
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGTERM)
    _wait_until(lambda: not any(_session_pids(node.pid) for node in nodes), STOP_GRACE_S, interval=0.2)
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        for pid in _session_pids(node.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _wait_until(lambda: not any(_session_pids(node.pid) for node in nodes), KILL_WAIT_S)
    for node in nodes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.process.wait(timeout=KILL_WAIT_S)


def stop_cluster(cluster: RayCluster) -> TeardownReport:
    """Workers first (they still talk to the head's GCS), then the head, then anything else in the namespace."""
    began, report = time.monotonic(), TeardownReport()
    _stop_nodes([node for node in cluster.nodes.values() if node.name != "head"])
    _stop_nodes([node for node in cluster.nodes.values() if node.name == "head"])
    strays = cluster.netns_pids()
    report.strays = [_describe(pid) for pid in strays]
    for pid in strays:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_until(lambda: not cluster.netns_pids(), KILL_WAIT_S)
    report.survivors = [_describe(pid) for pid in cluster.netns_pids()]
    cluster.holder.kill()  # the namespace goes with its last process
    with contextlib.suppress(subprocess.TimeoutExpired):
        cluster.holder.wait(timeout=KILL_WAIT_S)
    report.after_release = [_describe(pid) for pid in _live_pids() if _netns_inode(pid) == cluster.netns_inode]
    report.left_on_disks = _clean_node_disks(cluster)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    report.seconds = time.monotonic() - began
    return report


def _clean_node_disks(cluster: RayCluster) -> list[str]:
    """What a node's next start does with what a lost one left (a session on a killed raylet's node
    keeps its workspace mounted): coderunner's own clean-up of dead session dirs, on each worker's
    disks. Returns what even that left behind."""
    from coderunner.config import load_settings
    from coderunner.hostfs.session_dirs import remove_stale_dirs
    from coderunner.sandbox import make_backend

    for name in WORKERS:
        disks = {key.removeprefix("CODERUNNER_").lower(): value for key, value in node_disks(cluster, name).items()}
        if not Path(disks["runtime_dir"]).is_dir():
            continue
        settings = load_settings(Path(os.devnull), **disks)
        remove_stale_dirs(settings.runtime_dir, settings.workspaces_dir, make_backend(settings).remove_stale, 0.0)
    mounts = Path("/proc/mounts").read_text().splitlines()
    return [line.split()[1] for line in mounts if f" {cluster.temp_dir}/" in line]


def unavailable() -> str | None:
    """Why a cluster cannot be made on this machine (skip), or None. A missing Ray is a failure, not this."""
    if os.getuid() != 0:
        return "needs root (a network namespace per cluster)"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None or shutil.which("ip") is None:
        return "needs util-linux (unshare, nsenter) and iproute2 (ip)"
    return None


@contextlib.contextmanager
def ray_cluster_running() -> Iterator[RayCluster]:
    """A started cluster; on exit it is torn down and `cluster.teardown` says what teardown found."""
    if importlib.util.find_spec("ray") is None or not RAY.exists():
        pytest.fail(f"ray is not installed in {PYTHON.parent.parent} (install.sh installs the `ray` extra)")
    temp_dir = Path(f"/tmp/rt-{secrets.token_hex(3)}")  # short: Ray's socket paths must stay under 107 bytes
    temp_dir.mkdir(mode=0o700)
    try:
        cluster = _make_namespace(f"crray-{temp_dir.name[3:]}", temp_dir)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    try:
        start_cluster(cluster)
        yield cluster
    finally:
        cluster.teardown = stop_cluster(cluster)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A real three-node Ray cluster for the module; afterwards, nothing of it may be left in its namespace."""
    if reason := unavailable():
        pytest.skip(reason)
    with ray_cluster_running() as cluster:
        yield cluster
    report = cluster.teardown
    assert report is not None
    assert not report.survivors, f"processes outlived teardown in {cluster.netns}: {report.survivors}"
    assert not report.after_release, f"namespace {cluster.netns} still has processes: {report.after_release}"
    assert not report.left_on_disks, f"mounts left on the nodes' disks: {report.left_on_disks}"
    assert not cluster.temp_dir.exists(), f"{cluster.temp_dir} was not removed"
