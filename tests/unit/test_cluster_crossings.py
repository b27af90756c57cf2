"""The cluster's crossings without a cluster: which warm pool a front door's settings may take from, a
pool no front door visits any more, another client's snapshot ids and session ids (tests/cluster has
the same on a real cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from coderunner.cluster import host as host_module
from coderunner.cluster import node_pool
from coderunner.cluster.host import FRONT_DOOR_ONLY, REFUSAL_S, ClusterHost
from coderunner.cluster.pool_key import pool_key
from coderunner.cluster.stored import StoredOnNodes
from coderunner.cluster.wire import NodeInfo, SessionInfo
from coderunner.config import load_settings
from coderunner.errors import SessionError
from coderunner.sandbox.base import Limits
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.snapshots.layout import SnapshotNotFound, not_found
from coderunner.snapshots.records import Listing

SRC = Path(__file__).resolve().parents[2] / "src"


def sent(**overrides: Any) -> dict[str, Any]:
    """What a front door with these settings sends its nodes (ClusterHost._settings_sent)."""
    return load_settings(Path(os.devnull), **overrides).model_dump(exclude=FRONT_DOOR_ONLY)


BASE = {"allowed_domains": ["example.net"], "allowed_ports": [80, 443], "idle_timeout_s": 600.0, "export_dir": ""}


@pytest.mark.parametrize(
    "changed",
    [
        {"allowed_domains": ["example.org"]},
        {"allowed_ports": [443]},
        {"idle_timeout_s": 10.0},
        {"network": "allowlist"},
        {"max_network": "none"},
        {"memory_mb": 1024},
        {"timeout_s": 30.0},
        {"pids": 64},
        {"output_limit_chars": 5000},
        {"sandbox_user": "nobody"},
        {"export_dir": "/srv/exports"},  # no export folder at all, or one: sessions differ (an outbox or not)
        {"egress_audit_log": "/srv/audit.jsonl"},
    ],
)
def test_a_setting_a_session_is_built_with_changes_the_pool_key(changed: dict[str, Any]) -> None:
    assert pool_key(sent(**{**BASE, **changed})) != pool_key(sent(**BASE))


@pytest.mark.parametrize(
    "changed",
    [
        {"transport": "streamable-http", "port": 18761, "host": "10.0.0.7"},
        {"log_level": "DEBUG"},
        {"runtime_dir": "/srv/run", "workspaces_dir": "/srv/ws"},  # each node takes its own
        {"ray_node_labels": {"pool": "agents"}},
    ],
)
def test_a_front_door_only_setting_leaves_the_pool_key(changed: dict[str, Any]) -> None:
    """Front doors that differ only in how they are reached share the nodes' pools."""
    assert pool_key(sent(**{**BASE, **changed})) == pool_key(sent(**BASE))


def test_the_pool_key_is_the_same_in_every_process() -> None:
    """A front door and a pooled session's actor compute it apart: no hash seed, no dict order may change it."""
    settings = sent(**BASE, ray_node_labels={"b": "2", "a": "1"}, tools=["python", "jobs"])
    code = "import json, sys; from coderunner.cluster.pool_key import pool_key as k; print(k(json.loads(sys.argv[1])))"
    wire = json.dumps(settings, default=str)
    keys = set()
    # Both interpreters at once (each spends its second starting up, not computing the key).
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code, wire], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(SRC), "PYTHONHASHSEED": seed},
        )
        for seed in ("1", "2")
    ]  # fmt: skip
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, stderr[-2000:]
            keys.add(stdout.strip())
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert keys == {pool_key(json.loads(wire))}


# --- a pool nobody visits -------------------------------------------------------------------------


class PoolProbe:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.killed: list[str] = []
        self.ended = anyio.Event()
        self.started = 0
        monkeypatch.setattr(node_pool, "kill", lambda actor: self.killed.append(actor))
        monkeypatch.setattr(node_pool, "end_process", self.ended.set)
        monkeypatch.setattr(node_pool, "RETIRE_GRACE_S", 0.0)
        monkeypatch.setattr(node_pool.NodePool, "_start_one", self.start_one)

    async def start_one(self) -> tuple[str, Any]:  # set on the class as a bound method: no pool argument
        self.started += 1
        return f"s{self.started}", f"actor-{self.started}"


@pytest.mark.anyio
async def test_a_visited_pool_stays_and_one_nobody_visits_ends_its_sessions_and_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe = PoolProbe(monkeypatch)
    pool = node_pool.NodePool({}, "n" * 56, 2, {}, orphan_s=0.3)
    await pool.start()
    with anyio.fail_after(5):
        while len(pool.ready) < 2:
            await anyio.sleep(0.01)
    for _ in range(6):  # visited every 0.1 s for 0.6 s: past orphan_s, and it stays
        await anyio.sleep(0.1)
        await pool.start()
    assert not pool.retiring and not probe.ended.is_set()
    assert await pool.claim() == ("s1", "actor-1")
    with anyio.fail_after(5):
        await probe.ended.wait()  # nobody came back
    assert pool.retiring and not pool.ready
    assert sorted(probe.killed) == ["actor-2", "actor-3"]  # the ready ones (the claimed one is its taker's)
    assert await pool.claim() is None


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


# --- session ids: the owner check costs the same whether or not the id exists --------------------


class FoundActor:
    """A session actor as ray.get_actor finds it: `info` answers with its SessionInfo."""

    def __init__(self, info: SessionInfo) -> None:
        self._info = info
        self.info = self

    def remote(self) -> Any:
        async def answer() -> SessionInfo:
            await anyio.sleep(0.003)  # an actor call
            return self._info

        return answer()


def session_info(session_id: str, owner: str) -> SessionInfo:
    options = SandboxOptions(network="none", limits=Limits(), timeout_s=60, client=owner.partition("/")[0])
    return SessionInfo(session_id, owner, options, NodeInfo("n" * 56, "10.0.0.7"), generation=0)


@pytest.mark.anyio
async def test_another_clients_session_id_is_refused_as_an_unknown_one_in_the_same_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    elsewhere = {"session-made-elsewhere": FoundActor(session_info("made-elsewhere", "alice/1"))}

    looked_up: list[str] = []

    def get_actor(name: str, namespace: str) -> Any:
        looked_up.append(name)
        if name not in elsewhere:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return elsewhere[name]

    monkeypatch.setattr(host_module.ray, "get_actor", get_actor)
    host = ClusterHost.__new__(ClusterHost)
    host.settings = load_settings(Path(os.devnull), export_dir="")
    host._sessions = {}
    async with anyio.create_task_group() as group:
        host._task_group = group
        made_here = host_module.RemoteSession(FoundActor(session_info("made-here", "alice/1")),
                                              session_info("made-here", "alice/1"), host.settings, group)  # fmt: skip
        host._sessions["made-here"] = made_here
        # The same time for every refusal is a fixed deadline from the call's start that every refusal
        # waits for (no measured spread: timing assertions flake on a loaded machine).
        padded_to: list[float] = []
        sleep_until = anyio.sleep_until

        async def recording_sleep_until(deadline: float) -> None:
            padded_to.append(deadline)
            await sleep_until(deadline)

        monkeypatch.setattr(anyio, "sleep_until", recording_sleep_until)
        for _ in range(5):
            for session_id in ("made-here", "made-elsewhere", "nobody"):
                began, padded_before = anyio.current_time(), len(padded_to)
                with pytest.raises(SessionError, match="unknown or expired session_id"):
                    await host.resolve(session_id, "bob/1", "bob")
                (deadline,) = padded_to[padded_before:]  # each refusal waited once, for its own deadline
                assert began + REFUSAL_S <= deadline <= anyio.current_time(), (session_id, began, deadline)
        assert "made-elsewhere" not in host._sessions  # nothing kept before its owner passed
        # Each refusal looked the id up by name, the one made here for another client too.
        assert sorted(set(looked_up)) == ["session-made-elsewhere", "session-made-here", "session-nobody"]
        assert all(looked_up.count(name) == 5 for name in set(looked_up))
        # Its owner's client reaches it, with no wait, and then it is kept.
        padded_before = len(padded_to)
        assert (await host.resolve("made-elsewhere", "alice/2", "alice")).session_id == "made-elsewhere"
        assert len(padded_to) == padded_before and "made-elsewhere" in host._sessions
        group.cancel_scope.cancel()
