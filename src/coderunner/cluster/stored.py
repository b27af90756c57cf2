"""What a cluster keeps on its nodes' disks: snapshots and persistent workspaces, found where they are.

A snapshot is made by its session's node, in that node's store; a persistent workspace (and its
keep_state save, a snapshot of that node's store) lives where its session ran. Nothing is copied
between nodes: a restore, fork or reopen places the new session on the node that holds what it
starts from (Ray's NodeAffinity, strict), unless `snapshot_dir_shared` says every node sees one store.

Where a thing is, is asked of the nodes themselves (a task on each, reading its own store or
workspaces folder) and remembered here, for the client that asked; a listing is the union of every
live node's. Another client's snapshot id gets what an id nobody made gets, after the same calls: what
one client taught this front door is never used for another.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import ray

from coderunner.cluster.node_calls import NodeCalls
from coderunner.cluster.placement import backend_resource
from coderunner.hostfs.workspaces import NamedWorkspace
from coderunner.snapshots.layout import SnapshotNotFound, not_found
from coderunner.snapshots.records import Listing, SnapshotMeta


class StoredOnNodes:
    """Snapshots and named workspaces across the nodes that offer the backend."""

    def __init__(self, calls: NodeCalls, backend: str, shared: bool) -> None:
        self.calls = calls
        self.backend = backend
        #: Every node sees one snapshot store (shared storage): any node may serve any snapshot.
        self.shared = shared
        #: (client, snapshot id) -> the node that holds it (learned from that client's takes and lookups).
        self.snapshot_nodes: dict[tuple[str, str], str] = {}

    async def nodes(self) -> list[str]:
        """The live nodes that offer the backend (the ones that may hold a session's things)."""
        found = await anyio.to_thread.run_sync(ray.nodes)
        name = backend_resource(self.backend)
        return [node["NodeID"] for node in found if node.get("Alive") and node.get("Resources", {}).get(name, 0) >= 1]

    def remember(self, client: str, snapshot_id: str, node_id: str) -> None:
        self.snapshot_nodes[client, snapshot_id] = node_id

    async def snapshot_node(self, client: str, snapshot_id: str) -> tuple[str | None, SnapshotMeta]:
        """(the node that holds it, or None when any node may load it; its record). SnapshotNotFound if none."""
        known = self.snapshot_nodes.get((client, snapshot_id))
        candidates = [known] if known is not None else []
        candidates += [node for node in await self.nodes() if node != known]
        for node_id in candidates[:1] if self.shared else candidates:
            with contextlib.suppress(SnapshotNotFound):
                meta: SnapshotMeta = await self.calls.run_on(node_id, "snapshot", client, snapshot_id)
                self.snapshot_nodes[client, snapshot_id] = node_id
                return (None if self.shared else node_id), meta
        raise not_found(snapshot_id)  # the words a node's store says, of an unknown id and another client's

    async def listing(self, client: str) -> Listing:
        """Every live node's snapshots of `client` (one store's, when it is shared)."""
        snapshots: dict[str, SnapshotMeta] = {}
        damaged: dict[str, Any] = {}
        nodes = await self.nodes()
        for node_id in nodes[:1] if self.shared else nodes:
            found: Listing = await self.calls.run_on(node_id, "snapshot_listing", client)
            for meta in found.snapshots:
                snapshots.setdefault(meta.snapshot_id, meta)
                self.snapshot_nodes.setdefault((client, meta.snapshot_id), node_id)
            for entry in found.damaged:
                damaged.setdefault(entry.snapshot_id, entry)
                self.snapshot_nodes.setdefault((client, entry.snapshot_id), node_id)
        return Listing(list(snapshots.values()), list(damaged.values()))

    async def delete(self, client: str, snapshot_id: str) -> None:
        key = (client, snapshot_id)
        node_id = self.snapshot_nodes.get(key)
        if node_id is None:
            await self.listing(client)  # learns where each of the client's snapshots is, damaged ones too
            node_id = self.snapshot_nodes.get(key)
        if node_id is None:
            raise not_found(snapshot_id)
        await self.calls.run_on(node_id, "delete_snapshot", client, snapshot_id)
        self.snapshot_nodes.pop(key, None)

    async def workspaces(self, client: str) -> list[tuple[str, NamedWorkspace]]:
        """(node, workspace) for every named workspace of `client` on a live node."""
        found: list[tuple[str, NamedWorkspace]] = []
        for node_id in await self.nodes():
            listed: list[NamedWorkspace] = await self.calls.run_on(node_id, "list_workspaces", client)
            found += [(node_id, workspace) for workspace in listed]
        return found

    async def workspace_node(self, client: str, name: str) -> str | None:
        """The node that holds `client`'s workspace `name`, or None (a new one: any node)."""
        return next((node for node, workspace in await self.workspaces(client) if workspace.name == name), None)
