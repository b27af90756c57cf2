"""The cluster fixture itself: three nodes in a loopback-only namespace, actors pinned per worker, found
by name from another driver, a killed raylet taking only its own node's actors, and sandboxes starting
inside actors. Each step is a separate driver script run in the namespace; each prints one JSON line.
The fixture's teardown then asserts that nothing was left in the namespace.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from .conftest import BWRAP_RESOURCE, DRIVER_INIT, RayCluster

NAMESPACE = "coderunner-test"
#: A driver's own bound (import ray and connect take seconds on a loaded 2-core machine).
DRIVER_TIMEOUT_S = 150

PLACE_SCRIPT = """
import json, subprocess, sys
import ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], {init})

@ray.remote
class Probe:
    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    def bwrap(self):
        argv = ["/usr/bin/bwrap", "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return [done.returncode, done.stderr[-500:]]

result = {{}}
for worker in ("w1", "w2"):
    probe = Probe.options(
        name=f"probe-{{worker}}", lifetime="detached", resources={{f"coderunner-node-{{worker}}": 0.01}}
    ).remote()
    result[worker] = ray.get(probe.node_id.remote(), timeout=60)
    result[f"bwrap-{{worker}}"] = ray.get(probe.bwrap.remote(), timeout=90)
print(json.dumps(result))
"""

CALL_SCRIPT = """
import json, sys
import ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], {init})
result = {{}}
for worker in sys.argv[3:]:
    try:
        probe = ray.get_actor(f"probe-{{worker}}", namespace=sys.argv[2])
        result[worker] = {{"node_id": ray.get(probe.node_id.remote(), timeout=30)}}
    except Exception as error:
        result[worker] = {{"error": type(error).__name__, "message": str(error)[:300]}}
print(json.dumps(result))
"""


def _driver(cluster: RayCluster, template: str, *args: str) -> dict[str, Any]:
    """Runs one driver script in the namespace and returns the JSON it printed last."""
    code = template.format(init=DRIVER_INIT)
    done = cluster.run_python(code, cluster.address, NAMESPACE, *args, timeout=DRIVER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_nodes_are_three_with_the_promised_resources(ray_cluster: RayCluster) -> None:
    nodes = ray_cluster.nodes
    assert list(nodes) == ["head", "w1", "w2"]
    assert len({node.node_id for node in nodes.values()}) == 3
    assert len({node.pid for node in nodes.values()}) == 3
    assert BWRAP_RESOURCE not in nodes["head"].resources
    assert nodes["head"].resources["CPU"] == 1
    for name in ("w1", "w2"):
        assert nodes[name].resources[BWRAP_RESOURCE] == 100
        assert nodes[name].resources[f"coderunner-node-{name}"] == 1
        assert nodes[name].resources["CPU"] == 2
        assert nodes[name].resources["memory"] == 4 * 2**30


def test_namespace_has_only_loopback(ray_cluster: RayCluster) -> None:
    links = subprocess.run(
        [*ray_cluster.exec_prefix, "ip", "-o", "link"], capture_output=True, text=True, check=True, timeout=10
    ).stdout.splitlines()
    assert [line.split(":")[1].strip() for line in links] == ["lo"]


def test_actors_land_on_their_worker_and_start_sandboxes(ray_cluster: RayCluster) -> None:
    result = _driver(ray_cluster, PLACE_SCRIPT)
    assert result["w1"] == ray_cluster.nodes["w1"].node_id
    assert result["w2"] == ray_cluster.nodes["w2"].node_id
    assert result["w1"] != result["w2"]
    assert result["bwrap-w1"] == [0, ""], result["bwrap-w1"]
    assert result["bwrap-w2"] == [0, ""], result["bwrap-w2"]


def test_another_driver_finds_the_actors_by_name(ray_cluster: RayCluster) -> None:
    result = _driver(ray_cluster, CALL_SCRIPT, "w1", "w2")
    assert result == {
        "w1": {"node_id": ray_cluster.nodes["w1"].node_id},
        "w2": {"node_id": ray_cluster.nodes["w2"].node_id},
    }


def test_a_killed_raylet_takes_only_its_own_nodes_actors(ray_cluster: RayCluster) -> None:
    raylet = ray_cluster.kill_raylet("w2")
    assert raylet not in ray_cluster.node_pids("w1")
    ray_cluster.wait_node_down("w2")
    result = _driver(ray_cluster, CALL_SCRIPT, "w1", "w2")
    assert result["w1"] == {"node_id": ray_cluster.nodes["w1"].node_id}
    assert "error" in result["w2"], result["w2"]
    assert result["w2"]["error"] != "GetTimeoutError", result["w2"]
