"""The cluster's crossings without a cluster: another client's snapshot ids (tests/cluster has the same on a
real cluster)."""

from __future__ import annotations

from typing import Any

import pytest

from coderunner.cluster.stored import StoredOnNodes
from coderunner.snapshots.layout import SnapshotNotFound, not_found
from coderunner.snapshots.records import Listing

# --- snapshots: what one client taught the front door is not used for another ----------------------


class NodeStores:
    """Two nodes' snapshot stores, as the nodes' tasks answer (NodeCalls.run_on), with the calls made."""

    def __init__(self) -> None:
        self.stores: dict[str, dict[str, set[str]]] = {"n1": {}, "n2": {"alice": {"s-alicesnap01"}}}
        self.calls: list[tuple[str, str]] = []

    async def run_on(self, node_id: str, method: str, client: str, *args: Any) -> Any:
        self.calls.append((node_id, method))
        held = self.stores[node_id].get(client, set())
        if method == "snapshot_listing":
            return Listing([], [])  # what a client's listing shows does not matter here: where ids are does
        (snapshot_id,) = args
        if snapshot_id not in held:
            raise not_found(snapshot_id)
        if method == "delete_snapshot":
            held.discard(snapshot_id)
        return object()


async def answered(call: Any, *args: Any) -> str:
    try:
        await call(*args)
    except SnapshotNotFound as exc:
        return str(exc)
    return "served"


@pytest.mark.anyio
async def test_another_clients_snapshot_id_gets_an_unknown_ids_answer_after_the_same_calls() -> None:
    nodes = NodeStores()
    stored = StoredOnNodes(nodes, "bwrap", shared=False)  # type: ignore[arg-type]

    async def live() -> list[str]:
        return ["n1", "n2"]

    stored.nodes = live  # type: ignore[method-assign]
    stored.remember("alice", "s-alicesnap01", "n2")  # alice took it through this front door
    seen: dict[str, list[Any]] = {}
    for label, snapshot_id in (("theirs", "s-alicesnap01"), ("unknown", "s-madeupsnap1")):
        nodes.calls.clear()
        said = [await answered(call, "bob", snapshot_id) for call in (stored.snapshot_node, stored.delete)]
        seen[label] = [[text.replace(snapshot_id, "<id>") for text in said], list(nodes.calls)]
    assert seen["theirs"] == seen["unknown"], seen
    assert seen["unknown"][0][0] == str(not_found("<id>"))  # the words of one machine's store
    assert nodes.stores["n2"]["alice"] == {"s-alicesnap01"}  # and alice's is still there
    assert await answered(stored.delete, "alice", "s-alicesnap01") == "served"
