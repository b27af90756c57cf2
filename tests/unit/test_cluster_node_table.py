"""The front door's copy of Ray's node table (cluster/node_table.py): no GCS call in a create's way while it
is fresh, asked again behind the creates as it ages, and at once after a failure."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from coderunner.cluster import node_table
from coderunner.cluster.node_table import FRESH_S, REFRESH_S, NodeTable

pytestmark = pytest.mark.anyio


class Cluster:
    """ray.nodes() of a cluster whose table changes with each answer; a clock the test moves."""

    def __init__(self) -> None:
        self.asked = 0
        self.now = 1000.0

    def nodes(self) -> list[dict[str, Any]]:
        self.asked += 1
        return [{"NodeID": f"n{self.asked}", "Alive": True}]


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Cluster:
    found = Cluster()
    monkeypatch.setattr(node_table.ray, "nodes", found.nodes)
    return found


async def test_a_fresh_copy_is_used_as_it_is_and_an_aging_one_is_asked_again_behind_the_create(
    cluster: Cluster,
) -> None:
    table = NodeTable(clock=lambda: cluster.now)
    async with anyio.create_task_group() as group:
        assert (await table.current(group))[0]["NodeID"] == "n1" and cluster.asked == 1  # none yet: asked now
        cluster.now += REFRESH_S / 2
        assert (await table.current(group))[0]["NodeID"] == "n1" and cluster.asked == 1  # fresh: no call
        cluster.now += REFRESH_S
        assert (await table.current(group))[0]["NodeID"] == "n1"  # aging: this create does not wait...
        with anyio.fail_after(10):
            while (await table.current(group))[0]["NodeID"] != "n2":  # ...a later one has the newer copy
                await anyio.sleep(0.01)
        assert cluster.asked == 2  # asked once behind the creates, however many came meanwhile


async def test_a_copy_too_old_or_one_found_wrong_is_asked_again_before_it_is_used(cluster: Cluster) -> None:
    table = NodeTable(clock=lambda: cluster.now)
    async with anyio.create_task_group() as group:
        await table.current(group)
        cluster.now += FRESH_S + 1
        assert (await table.current(group))[0]["NodeID"] == "n2" and cluster.asked == 2
        table.stale()  # a placement found an agent gone
        assert (await table.current(group))[0]["NodeID"] == "n3" and cluster.asked == 3
