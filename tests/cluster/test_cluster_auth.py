"""Ray's token authentication on a real three-node cluster, and what of Ray a sandbox on a node can reach.

The cluster (conftest.py) runs with RAY_AUTH_MODE=token and a random token of its own. Here: a process
that reaches Ray's ports without that token runs nothing (a driver, Ray's GCS client, a node that tries to
join, a call to a node's runtime-env agent); a front door without the token, or with another, refuses to
start saying which; and a sandbox in every network mode a cluster front door allows reaches none of the
ports Ray listens on, directly or through its node's policy proxy, while the server and a bystander
session go on unharmed.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ServerDirs, json_of, text_of
from .conftest import DRIVER_INIT, HEAD_PORT, RAY, REPO, RayCluster, _session_pids, _wait_until, eventually
from .test_cluster_mode import agents_held, cluster_env, described, front_door, named_actors, ok, sandboxes_on

pytestmark = pytest.mark.anyio

#: Ray's C++ clients log each refused call with this (Ray 2.60).
REFUSED_TOKEN = "InvalidAuthToken"
#: The sandbox-side end of an allowlist sandbox's path to its node's proxy (sandbox/common.py: EGRESS_PORT):
#: a Ray port with that number would be reached as the forwarder, not as Ray.
FORWARDER_PORT = 3128

#: A driver that runs one task, which writes the file it is given: whether it ran is whether the file exists.
TASK_DRIVER = f"""
import sys
from pathlib import Path
import ray
ray.init(address=sys.argv[1], {DRIVER_INIT})

@ray.remote(num_cpus=0)
def mark(path):
    Path(path).write_text("ran")

ray.get(mark.remote(sys.argv[2]), timeout=120)
print("RAN")
"""

#: Ray's own GCS client, once: the node list, or the kind of error the GCS answered with.
GCS_CLIENT = """
import json, sys
from ray._raylet import InnerGcsClient
try:
    nodes = InnerGcsClient.standalone(sys.argv[1], None, 5000).get_all_node_info(5)
    print(json.dumps({"nodes": len(nodes)}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__}))
"""

#: Each node's address and the ports Ray says it listens on (asked with the token).
NODE_PORTS = f"""
import json, sys
import ray
ray.init(address=sys.argv[1], {DRIVER_INIT})
keys = ("NodeManagerPort", "ObjectManagerPort", "RuntimeEnvAgentPort", "MetricsExportPort", "MetricsAgentPort",
        "DashboardAgentListenPort", "DashboardAgentGrpcPort")
print(json.dumps([{{"address": node["NodeManagerAddress"], "ports": {{key: node[key] for key in keys
                   if isinstance(node.get(key), int) and node[key] > 0}}}} for node in ray.nodes() if node["Alive"]]))
"""

#: A POST to each node's runtime-env agent (HTTP) without a token and with a wrong one: the status codes.
AGENT_CALLS = """
import json, sys, urllib.error, urllib.request
codes = []
for port in json.loads(sys.argv[1]):
    for headers in ({}, {"Authorization": "Bearer " + sys.argv[2]}):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/get_or_create_runtime_env", data=b"x",
                                         headers=headers, method="POST")
        try:
            urllib.request.urlopen(request, timeout=10)
            codes.append(200)
        except urllib.error.HTTPError as error:
            codes.append(error.code)
print(json.dumps(codes))
"""

#: In a session: a TCP connect to each target, and (network 'allowlist') a CONNECT and a GET for each through
#: the node's proxy. What connected, and what the proxy answered.
PROBE = """
import json, os, socket
targets = {targets!r}
reached, failed, proxied = [], {{}}, {{}}
for host, port in targets:
    try:
        with socket.create_connection((host, port), timeout=3):
            reached.append(f"{{host}}:{{port}}")
    except OSError as exc:
        failed[type(exc).__name__] = failed.get(type(exc).__name__, 0) + 1
proxy = os.environ.get("CODERUNNER_EGRESS_PROXY")
if proxy:
    proxy_host, proxy_port = proxy.removeprefix("http://").rstrip("/").rsplit(":", 1)
    for host, port in targets:
        for request in (f"CONNECT {{host}}:{{port}} HTTP/1.1\\r\\nHost: {{host}}:{{port}}\\r\\n\\r\\n",
                        f"GET http://{{host}}:{{port}}/ HTTP/1.1\\r\\nHost: {{host}}:{{port}}\\r\\n\\r\\n"):
            with socket.create_connection((proxy_host, int(proxy_port)), timeout=10) as conn:
                conn.settimeout(10)
                conn.sendall(request.encode())
                status = conn.recv(4096).split(b"\\r\\n", 1)[0].decode(errors="replace")
            proxied[status] = proxied.get(status, 0) + 1
print("PROBE " + json.dumps({{"reached": reached, "failed": failed, "proxied": proxied}}))
"""


def without_auth(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if not key.startswith("RAY_AUTH")}


def in_namespace(cluster: RayCluster, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """A process beside the cluster (its own session, so that what it leaves can be found)."""
    return subprocess.Popen(
        [*cluster.exec_prefix, *argv], env=env, cwd=cluster.temp_dir, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def beside(cluster: RayCluster, env: dict[str, str], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -c code args...` in the cluster's namespace with `env` (cluster.run_python, another env)."""
    return subprocess.run([*cluster.exec_prefix, cluster.python, "-c", code, *args], env=env, cwd=cluster.temp_dir,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def finished(process: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def last_json(text: str) -> Any:
    return json.loads(text.strip().splitlines()[-1])


def alive_nodes(cluster: RayCluster) -> int:
    done = cluster.run_python(NODE_PORTS, cluster.address)
    assert done.returncode == 0, done.stderr[-2000:]
    return len(last_json(done.stdout))


def test_a_process_without_the_token_runs_nothing(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """Drivers, Ray's own GCS client, a would-be node and the runtime-env agents' HTTP: without the token (or
    with another) each is refused and nothing runs; with it, the same driver runs its task (the control)."""
    tmp_path.chmod(0o755)  # the task runs as the node's user (root here), in the node's processes
    wrong = secrets.token_hex(32)
    plain = without_auth(ray_cluster.env)
    envs = {"token": ray_cluster.env, "none": plain, "wrong": {**plain, "RAY_AUTH_MODE": "token",
                                                               "RAY_AUTH_TOKEN": wrong}}  # fmt: skip
    python = ray_cluster.python
    drivers = {name: in_namespace(ray_cluster, [python, "-c", TASK_DRIVER, ray_cluster.address,
                                                str(tmp_path / f"ran-{name}")], env)
               for name, env in envs.items()}  # fmt: skip
    rogue_dir = ray_cluster.temp_dir / "rogue"  # short: Ray's socket paths must stay under 107 bytes
    rogue_argv = [str(RAY), "start", f"--address={ray_cluster.address}", "--node-ip-address=127.0.0.1",
                  f"--temp-dir={rogue_dir}", "--num-cpus=1", "--disable-usage-stats",
                  '--resources={"coderunner-bwrap": 100}']  # fmt: skip
    rogue = in_namespace(ray_cluster, rogue_argv, plain)
    results = {name: finished(process) for name, process in drivers.items()}
    code, out, err = results["token"]
    assert code == 0 and "RAN" in out and (tmp_path / "ran-token").exists(), err[-3000:]
    for name in ("none", "wrong"):
        code, out, err = results[name]
        assert code != 0 and "RAN" not in out, (name, out, err[-3000:])
        assert REFUSED_TOKEN in err and "Failed to connect to Ray cluster" in err, (name, err[-3000:])
        assert not (tmp_path / f"ran-{name}").exists(), name
    # Ray's own GCS client: refused at once without the token; the node list with it.
    gcs = {name: beside(ray_cluster, env, GCS_CLIENT, ray_cluster.address) for name, env in envs.items()}
    assert last_json(gcs["token"].stdout) == {"nodes": 3}, gcs["token"].stderr[-2000:]
    for name in ("none", "wrong"):
        assert last_json(gcs[name].stdout) == {"error": "AuthenticationError"}, (name, gcs[name].stderr[-2000:])
    # A node without the token cannot join (it would be given sessions' work): it stops, and leaves nothing.
    code, out, err = finished(rogue)
    assert code != 0 and "AuthenticationError" in err, (out, err[-3000:])
    assert _wait_until(lambda: not _session_pids(rogue.pid), 30), _session_pids(rogue.pid)
    assert alive_nodes(ray_cluster) == 3
    # Each node's runtime-env agent (HTTP): 401 without a token, 403 with a wrong one.
    nodes = last_json(ray_cluster.run_python(NODE_PORTS, ray_cluster.address).stdout)
    agents = [node["ports"]["RuntimeEnvAgentPort"] for node in nodes]
    assert len(agents) == 3, nodes
    done = beside(ray_cluster, plain, AGENT_CALLS, json.dumps(agents), wrong)
    assert done.returncode == 0, done.stderr[-2000:]
    assert last_json(done.stdout) == [401, 403] * 3, done.stdout


def serve_argv(cluster: RayCluster) -> list[str]:
    return [*cluster.exec_prefix, sys.executable, "-m", "coderunner.cli", "serve", "--ray", cluster.address]


def test_a_front_door_without_the_clusters_token_refuses_to_start_saying_so(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """No token, a wrong token, or token mode with no token at all: each front door stops at start with a
    message that names the cause and what to set, and never prints the cluster's token."""
    base = without_auth(cluster_env(ray_cluster, dirs))
    envs = {
        "none": dict(base),
        "wrong": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)},
        "mode only": {**base, "RAY_AUTH_MODE": "token", "HOME": str(dirs.root)},  # no ~/.ray/auth_token there
    }
    for number, env in enumerate(envs.values()):  # dirs of its own each: the three start at once
        env.update(CODERUNNER_RUNTIME_DIR=str(dirs.root / f"run-{number}"),
                   CODERUNNER_WORKSPACES_DIR=str(dirs.root / f"ws-{number}"))  # fmt: skip
    doors = {name: subprocess.Popen(serve_argv(ray_cluster), env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, env in envs.items()}  # fmt: skip
    results = {name: finished(door) for name, door in doors.items()}
    expected = {
        "none": f"the Ray cluster at {ray_cluster.address} requires Ray's token authentication, and this front "
        "door has no token",
        "wrong": f"the Ray cluster at {ray_cluster.address} refused this front door's Ray token",
        "mode only": "this front door has RAY_AUTH_MODE=token but no Ray token was found",
    }
    for name, (code, _, err) in results.items():
        assert code != 0, (name, err[-3000:])
        assert expected[name] in err and "RAY_AUTH_TOKEN_PATH" in err, (name, err[-3000:])
        assert ray_cluster.env["RAY_AUTH_TOKEN"] not in err, name


def ray_targets(cluster: RayCluster) -> list[tuple[str, int]]:
    """Every (address, port) Ray listens on in the cluster's namespace, on each node's address and loopback:
    what Ray reports for each node (GCS, raylet, object manager, agents) and every TCP listener there
    (those and the core workers of its actors: the namespace holds nothing else that listens). The test's
    nodes share one loopback, so a node's own address is 127.0.0.1 here; Ray binds each port to it."""
    nodes = last_json(cluster.run_python(NODE_PORTS, cluster.address).stdout)
    reported = {HEAD_PORT} | {port for node in nodes for port in node["ports"].values()}
    listing = subprocess.run([*cluster.exec_prefix, "ss", "-ltnH"], capture_output=True, text=True, timeout=30)
    assert listing.returncode == 0, listing.stderr
    listening: set[tuple[str, int]] = set()
    for line in listing.stdout.splitlines():
        host, _, port = line.split()[3].rpartition(":")
        listening.add((host.strip("[]").removeprefix("::ffff:"), int(port)))
    ports = {port for _, port in listening}
    assert reported <= ports, (reported - ports, listening)  # what Ray says matches what the kernel has
    hosts = (
        {"127.0.0.1"}
        | {node["address"] for node in nodes}
        | {h for h, _ in listening if h not in ("*", "0.0.0.0", "::")}
    )
    return sorted((host, port) for host in hosts for port in ports if port != FORWARDER_PORT)


async def test_no_sandbox_reaches_rays_ports_in_any_network_mode_a_front_door_allows(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """Network 'none' and 'allowlist' (directly, and through the node's proxy by CONNECT and by GET): no
    connection to any of Ray's ports on the node's loopback or its own address. 'internet' a cluster front
    door refuses outright (its user-mode network connects from the node itself). Meanwhile the front door
    serves on and a bystander session keeps its state."""
    internet = cluster_env(ray_cluster, dirs, CODERUNNER_MAX_NETWORK="internet")
    refused = subprocess.run(serve_argv(ray_cluster), env=internet, cwd=REPO, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode != 0 and "refuses max_network 'internet'" in refused.stderr, refused.stderr[-3000:]
    env = cluster_env(ray_cluster, dirs, CODERUNNER_ALLOWED_DOMAINS='["a.example.org"]')
    async with front_door(ray_cluster, env) as client:
        bystander = json_of(await ok(client, "create_session"))["session_id"]  # type: ignore[index]
        await ok(client, "run_python", code="x = 41", session_id=bystander)
        probes = {}
        for mode in ("none", "allowlist"):
            probes[mode] = json_of(await ok(client, "create_session", network=mode))["session_id"]  # type: ignore[index]
        targets = ray_targets(ray_cluster)  # with the node agents up: their core workers' ports too
        assert len(targets) >= 8, targets
        channels = [held["channel"] for held in agents_held(ray_cluster).values() if held is not None]
        assert channels and all(port in {port for _, port in targets} for port in channels), (channels, targets)
        for mode, session_id in probes.items():
            reply = text_of(await ok(client, "run_python", code=PROBE.format(targets=targets), session_id=session_id,
                                     detach_after_s=240))  # fmt: skip
            found = json.loads(reply.split("PROBE ", 1)[1].splitlines()[0])
            assert found["reached"] == [], (mode, found, targets)
            assert sum(found["failed"].values()) == len(targets), (mode, found)
            if mode == "allowlist":  # the proxy refuses every one of them, by CONNECT and by GET
                assert sum(found["proxied"].values()) == 2 * len(targets), found
                assert all(" 403" in status for status in found["proxied"]), found
            else:  # no proxy at all
                assert found["proxied"] == {}, found
            assert "2" in text_of(await ok(client, "run_python", code="1 + 1", session_id=session_id))
        assert "42" in text_of(await ok(client, "run_python", code="x + 1", session_id=bystander))
        assert alive_nodes(ray_cluster) == 3
        for session_id in (bystander, *probes.values()):
            await ok(client, "manage_sessions", action="close", session_id=session_id)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster)), described(sandboxes_on(ray_cluster))
