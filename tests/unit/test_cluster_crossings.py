"""The cluster's crossings without a cluster: which node agent (and so which warm pool) a front door's
settings may use, an agent no front door visits any more, another client's snapshot ids and session ids
(tests/cluster has the same on a real cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import ray

from coderunner.cluster import agent as agent_module
from coderunner.cluster import host as host_module
from coderunner.cluster.agents import Agents
from coderunner.cluster.host import FRONT_DOOR_ONLY, REFUSAL_S, ClusterHost
from coderunner.cluster.placement import Request
from coderunner.cluster.pool_key import pool_key
from coderunner.cluster.stored import StoredOnNodes
from coderunner.cluster.wire import NodeInfo, SessionInfo, new_session_id
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


# --- an agent nobody visits ------------------------------------------------------------------------


class AgentProbe:
    """A NodeAgent without Ray or sandboxes: its manager is a stand-in that says when it was left, starts a
    session when `release` is set (a slow start when a test holds it) and records what it closed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, warm: int = 1) -> None:
        self.ended = anyio.Event()
        self.manager_left = False
        self.started, self.release = anyio.Event(), anyio.Event()
        self.closed: list[str] = []
        probe = self

        class Manager:
            def __init__(self, settings: Any, backend: Any) -> None:
                self.pool = SimpleNamespace(stats=lambda: SimpleNamespace(ready=warm))

            async def __aenter__(self) -> Any:
                return self

            async def __aexit__(self, *exc_info: object) -> None:
                probe.manager_left = True

            async def create(self, options: Any, owner: str, seed: Any, session_id: str) -> Any:
                probe.started.set()
                await probe.release.wait()
                return SimpleNamespace(session_id=session_id, sandbox_mounts=None, closed=False, close_done=None,
                                       close_note=None)  # fmt: skip

            async def close(self, session_id: str) -> None:
                probe.closed.append(session_id)

        node = NodeInfo("n" * 56, "10.0.0.7")
        monkeypatch.setattr(agent_module, "_this_node", lambda: (node, {"NodeID": node.node_id, "Resources": {}}))
        monkeypatch.setattr(
            agent_module, "node_settings", lambda sent, **fixed: SimpleNamespace(**fixed, agent_handover_s=0.0)
        )
        monkeypatch.setattr(agent_module, "make_backend", lambda settings: None)
        monkeypatch.setattr(agent_module, "SessionManager", Manager)
        monkeypatch.setattr(agent_module, "end_process", self.ended.set)
        monkeypatch.setattr(agent_module, "WATCH_INTERVAL_S", 0.05)


@pytest.mark.anyio
async def test_a_visited_agent_stays_one_holding_a_session_stays_and_one_nobody_needs_ends_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe = AgentProbe(monkeypatch)
    agent = agent_module.NodeAgent({"backend": "bwrap"}, "k" * 16, orphan_s=0.3)
    assert (await agent.visit()).warm == 1  # its manager (and warm pool) started at the first visit
    for _ in range(6):  # visited every 0.1 s for 0.6 s: past orphan_s, and it stays
        await anyio.sleep(0.1)
        await agent.visit()
    assert not probe.ended.is_set()
    held = SimpleNamespace(open=True)
    agent._sides["s1"] = held  # type: ignore[assignment]
    await anyio.sleep(0.8)  # nobody visits, but it holds a session (its idle reaper closes those)
    assert not probe.ended.is_set() and not probe.manager_left
    held.open = False  # closed (a front door's close, or the reaper)
    with anyio.fail_after(5):
        await probe.ended.wait()
    assert probe.manager_left and not agent._sides  # its warm pool went with its manager


@pytest.mark.anyio
async def test_an_open_its_front_door_abandoned_closes_the_session_once_it_is_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A front door that stopped waiting for an open (its bound, a cancel) tells the agent, which closes the
    session when its start ends: no session is left that no front door knows of."""
    probe = AgentProbe(monkeypatch, warm=0)
    agent = agent_module.NodeAgent({"backend": "bwrap"}, "k" * 16)
    agent.settings.transfer_limit_bytes = 2**20
    agent.node_entry = {"Resources": {"CPU": 2.0, "memory": 4.0 * 2**30, "coderunner-bwrap": 4.0}}
    request = Request(0.1, 512, "bwrap")
    async with anyio.create_task_group() as group:
        refused: list[str] = []

        async def opening() -> None:
            with pytest.raises(SessionError, match="abandoned") as caught:
                await agent.open("s-slow", None, "alice/1", None, request)  # type: ignore[arg-type]
            refused.append(str(caught.value))

        group.start_soon(opening)
        await probe.started.wait()
        await agent.abandon("s-slow")  # the front door's bound passed meanwhile
        probe.release.set()
    assert refused and probe.closed == ["s-slow"] and not agent._sides and not agent._reserved


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


class Refused(ray.exceptions.RayTaskError):
    """What an agent's call raises to its caller for a session it does not hold."""

    def __init__(self, session_id: str) -> None:
        Exception.__init__(self, f"unknown or expired session_id {session_id!r}")


class FoundAgent:
    """A node agent as ray.get_actor finds it: `call.remote(session_id, "info")` answers with its SessionInfo."""

    def __init__(self, held: dict[str, SessionInfo]) -> None:
        self.held = held
        self.asked: list[str] = []
        self.call = self

    def remote(self, session_id: str, method: str) -> Any:
        assert method == "info"
        self.asked.append(session_id)

        async def answer() -> SessionInfo:
            await anyio.sleep(0.003)  # an agent call
            if session_id not in self.held:
                raise Refused(session_id)
            return self.held[session_id]

        return answer()


NODE = "0123abcd" * 7


def session_info(session_id: str, owner: str) -> SessionInfo:
    options = SandboxOptions(network="none", limits=Limits(), timeout_s=60, client=owner.partition("/")[0])
    return SessionInfo(session_id, owner, options, NodeInfo(NODE, "10.0.0.7"), generation=0)


@pytest.mark.anyio
async def test_another_clients_session_id_is_refused_as_an_unknown_one_in_the_same_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every id is asked of the agent it names, found by name once (then its handle is kept: no lookup per
    call); an id of no agent is refused as late."""
    settings = load_settings(Path(os.devnull), export_dir="")
    agents = Agents(settings.model_dump(exclude=FRONT_DOOR_ONLY), Request(0.1, None, "bwrap"))
    ids = {label: new_session_id(NODE, agents.key) for label in ("made-here", "made-elsewhere", "nobody")}
    ids["no agent"] = new_session_id(NODE, "0" * 16)  # a key no agent of this node has
    ids["made up"] = "nobody"
    agent = FoundAgent({ids[label]: session_info(ids[label], "alice/1") for label in ("made-here", "made-elsewhere")})
    looked_up: list[str] = []

    def get_actor(name: str, namespace: str) -> Any:
        looked_up.append(name)
        if name != f"agent-{NODE}-{agents.key}":
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return agent

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": NODE, "Alive": True}])
    host = ClusterHost.__new__(ClusterHost)
    host.settings = settings
    host._sessions = {}
    host._agents = agents
    async with anyio.create_task_group() as group:
        host._task_group = group
        here = ids["made-here"]
        host._sessions[here] = host_module.RemoteSession(agent, session_info(here, "alice/1"), settings, group)
        # The same time for every refusal is a fixed deadline from the call's start that every refusal
        # waits for (no measured spread: timing assertions flake on a loaded machine).
        padded_to: list[float] = []
        sleep_until = anyio.sleep_until

        async def recording_sleep_until(deadline: float) -> None:
            padded_to.append(deadline)
            await sleep_until(deadline)

        monkeypatch.setattr(anyio, "sleep_until", recording_sleep_until)
        for _ in range(5):
            for session_id in ids.values():
                began, padded_before = anyio.current_time(), len(padded_to)
                with pytest.raises(SessionError, match="unknown or expired session_id"):
                    await host.resolve(session_id, "bob/1", "bob")
                (deadline,) = padded_to[padded_before:]  # each refusal waited once, for its own deadline
                assert began + REFUSAL_S <= deadline <= anyio.current_time(), (session_id, began, deadline)
        assert ids["made-elsewhere"] not in host._sessions  # nothing kept before its owner passed
        # Each refusal of an id its agent could hold asked that agent, the one made here for another client too.
        routed = sorted(ids[label] for label in ("made-here", "made-elsewhere", "nobody"))
        assert sorted(set(agent.asked)) == routed and all(agent.asked.count(i) == 5 for i in routed)
        # The agent's name was looked up once, then its handle kept; a key no agent has, at each refusal.
        assert looked_up.count(f"agent-{NODE}-{agents.key}") == 1, looked_up
        assert looked_up.count(f"agent-{NODE}-{'0' * 16}") == 5, looked_up
