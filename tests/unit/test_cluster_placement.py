"""Cluster placement, without a cluster: what a session asks for, the refusal when nothing fits, and the
best of two agents asked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from coderunner.cluster.placement import MIB, Request, best_of, check_fits, check_home, describe_node, no_room, room_for
from coderunner.cluster.wire import AgentLoad
from coderunner.config import ConfigError, load_settings
from coderunner.errors import SessionError
from coderunner.sandbox.base import Limits
from coderunner.sessions.sandbox_options import SandboxOptions


def node(
    node_id: str, cpus: float, memory_mb: int, *backends: str, alive: bool = True, labels: dict[str, str] | None = None
) -> dict[str, object]:
    resources: dict[str, float] = {"CPU": cpus, "memory": memory_mb * MIB}
    resources.update({f"coderunner-{name}": 16.0 for name in backends})
    return {
        "NodeID": node_id, "NodeManagerAddress": "10.0.0.7", "Alive": alive, "Resources": resources,
        "Labels": {"ray.io/node-id": node_id, **(labels or {})},
    }  # fmt: skip


def options(memory_mb: int | None = 1024, cpus: float | None = None) -> SandboxOptions:
    return SandboxOptions(network="none", limits=Limits(memory_mb=memory_mb, cpus=cpus), timeout_s=60)


def test_a_session_asks_for_its_limits_and_one_unit_of_its_backend() -> None:
    asked = Request.of(options(2048, 1.5), "bwrap").actor_options()
    assert asked == {"num_cpus": 1.5, "memory": 2048 * MIB, "resources": {"coderunner-bwrap": 1}}
    # No cpus limit: a small share (idle kernels are many to a core); no memory limit: none asked.
    assert Request.of(options(None, None), "gvisor").actor_options() == {
        "num_cpus": 0.1,
        "resources": {"coderunner-gvisor": 1},
    }


def test_a_request_some_live_node_could_hold_is_let_through() -> None:
    check_fits(Request.of(options(2048), "bwrap"), [node("a" * 56, 2, 4096, "bwrap")])


@pytest.mark.parametrize(
    ("nodes", "why"),
    [
        ([node("a" * 56, 2, 1024, "bwrap")], "1,024 MiB"),  # too little memory anywhere
        ([node("a" * 56, 8, 65536, "podman")], "backends: podman"),  # no node runs bwrap
        ([node("a" * 56, 8, 65536, "bwrap", alive=False)], "no live node"),  # the only fit is dead
    ],
)
def test_a_request_no_live_node_could_hold_is_refused_saying_what_there_is(
    nodes: list[dict[str, object]], why: str
) -> None:
    with pytest.raises(SessionError) as refused:
        check_fits(Request.of(options(2048), "bwrap"), nodes)
    text = str(refused.value)
    assert "no node of the cluster can hold this session" in text
    assert "2,048 MiB of memory" in text and "bwrap backend" in text and why in text


def test_a_node_is_described_by_its_id_address_and_what_it_offers() -> None:
    described = describe_node(node("0123456789abcdef" * 3, 2, 4096, "bwrap", "gvisor"))
    assert described == "0123456789ab (10.0.0.7): 2 CPU, 4,096 MiB, backends: bwrap, gvisor"


def test_cluster_mode_refuses_a_network_ceiling_of_internet() -> None:
    """An internet sandbox reaches its node's own addresses, Ray's ports among them: never in a cluster."""
    import os
    from pathlib import Path

    from coderunner.cluster.host import ClusterHost
    from coderunner.config import ConfigError, load_settings

    settings = load_settings(Path(os.devnull), network="internet", ray_address="127.0.0.1:6379")
    with pytest.raises(ConfigError, match=r"refuses max_network 'internet'.*Ray's ports"):
        ClusterHost(settings)


@pytest.mark.parametrize("field", ["mounts", "allowed_mount_roots"])
def test_cluster_mode_refuses_mounts_not_declared_on_shared_storage(field: str, tmp_path: Path) -> None:
    """A node binds a mount from its own disk: the user must say the folders are the same on every node."""
    from coderunner.cluster.host import ClusterHost  # imports ray, which the rest of this file does not need

    (tmp_path / "data").mkdir()
    value = [f"{tmp_path / 'data'}:/data"] if field == "mounts" else [str(tmp_path)]
    common = {"ray_address": "127.0.0.1:6379", "export_dir": str(tmp_path / "out"), field: value}
    with pytest.raises(ConfigError, match=r"refuses mounts.*node that holds it.*set mounts_shared = true"):
        ClusterHost(load_settings(Path(os.devnull), **common))
    ClusterHost(load_settings(Path(os.devnull), mounts_shared=True, **common))  # declared shared: it starts


POOL = {"pool": "agents"}


def test_labels_go_to_rays_label_selector_and_only_labelled_nodes_fit() -> None:
    request = Request.of(options(2048), "bwrap", POOL)
    assert request.actor_options()["label_selector"] == {"pool": "agents"}
    check_fits(request, [node("a" * 56, 2, 4096, "bwrap"), node("b" * 56, 2, 4096, "bwrap", labels=POOL)])
    with pytest.raises(SessionError) as refused:
        check_fits(request, [node("a" * 56, 2, 4096, "bwrap", labels={"pool": "batch"})])
    text = str(refused.value)
    # What was asked, what the nodes carry (Ray's own ray.io labels left out), and how to add one.
    assert "a node labelled pool=agents where the bwrap backend works" in text
    assert "labels: pool=batch" in text and "ray.io" not in text
    assert "ray start --labels" in text and "ray_node_labels" in text


def test_a_session_pinned_to_a_node_without_the_labels_is_refused_saying_where_it_is() -> None:
    request = Request.of(options(2048), "bwrap", POOL)
    plain, labelled = node("a" * 56, 2, 4096, "bwrap"), node("b" * 56, 2, 4096, "bwrap", labels=POOL)
    check_home(request, "b" * 56, [plain, labelled])
    with pytest.raises(SessionError, match=r"kept on node aaaaaaaaaaaa .*lacks the labels .*pool=agents"):
        check_home(request, "a" * 56, [plain, labelled])


@pytest.mark.parametrize("labels", [{"pool": "!agents"}, {"pool": "in(a,b)"}, {"": "x"}, {"pool": ""}])
def test_node_labels_are_plain_names_and_values(labels: dict[str, str]) -> None:
    """Ray reads '!' and 'in(...)' as operators, which the refusal above would misread: refused at start."""
    import os
    from pathlib import Path

    from coderunner.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="ray_node_labels"):
        load_settings(Path(os.devnull), ray_node_labels=labels)


# --- best of two: each agent's own account of its sessions against what its node advertises ----------


def load(
    node_id: str, sessions: int = 0, cpus: float = 0.0, memory_mb: int = 0, warm: int = 0, ready_runs: int = 0
) -> AgentLoad:
    return AgentLoad(node_id, sessions, cpus, memory_mb, warm, ready_runs)


def test_an_agent_has_room_while_its_sessions_leave_enough_cpu_memory_and_units() -> None:
    request = Request.of(options(1024, 1.5), "bwrap")
    worker = node("a" * 56, 2, 4096, "bwrap")  # 16 bwrap units
    assert room_for(request, worker, load("a" * 56))
    assert not room_for(request, worker, load("a" * 56, 1, cpus=1.5, memory_mb=1024))  # 3 CPU > 2
    assert not room_for(Request.of(options(2048), "bwrap"), worker, load("a" * 56, 1, 0.1, 3072))  # 5 GiB > 4
    assert not room_for(Request.of(options(512), "bwrap"), worker, load("a" * 56, 16, 0.1, 512))  # units


def test_the_lighter_of_the_agents_asked_with_room_is_chosen() -> None:
    request = Request.of(options(512), "bwrap")
    a, b = node("a" * 56, 2, 4096, "bwrap"), node("b" * 56, 2, 4096, "bwrap")
    assert best_of(request, [(a, load("a" * 56, 4, 0.4, 2048)), (b, load("b" * 56, 1, 0.1, 512))], False) == "b" * 56
    assert best_of(request, [(a, load("a" * 56, 1, 0.1, 512)), (b, load("b" * 56, 4, 0.4, 2048))], False) == "a" * 56
    # A create with the default options goes where a warm sandbox waits, even to the fuller node.
    warm = [(a, load("a" * 56, 4, 0.4, 2048, warm=1)), (b, load("b" * 56, 1, 0.1, 512))]
    assert best_of(request, warm, True) == "a" * 56
    assert best_of(request, warm, False) == "b" * 56
    # The lighter one full: the other, however loaded, if it has room.
    full = [(a, load("a" * 56, 2, 0.2, 3800)), (b, load("b" * 56, 6, 1.8, 1024))]
    assert best_of(request, full, False) == "b" * 56
    # A one-shot run goes where a sandbox started ahead waits (the session pool's warm ones do not count).
    ahead = [(a, load("a" * 56, 4, 0.4, 2048, ready_runs=1)), (b, load("b" * 56, 1, 0.1, 512, warm=2))]
    assert best_of(request, ahead, False, run=True) == "a" * 56
    assert best_of(request, ahead, True) == "b" * 56
    # ... if it has room: a full one is passed over, sandbox ahead or not.
    ahead_full = [(a, load("a" * 56, 2, 0.2, 3800, ready_runs=1)), (b, load("b" * 56, 6, 1.8, 1024))]
    assert best_of(request, ahead_full, False, run=True) == "b" * 56


def test_when_no_agent_asked_has_room_the_refusal_says_what_each_node_holds() -> None:
    request = Request.of(options(2048), "bwrap")
    a = node("a" * 56, 2, 4096, "bwrap")
    answers = [(a, load("a" * 56, 2, 0.2, 4096))]
    assert best_of(request, answers, False) is None
    text = str(no_room(request, answers))
    assert "no node has room for this session now" in text and "2,048 MiB of memory" in text
    assert "aaaaaaaaaaaa (10.0.0.7): 2 CPU, 4,096 MiB" in text and "0.2 CPU and 4,096 MiB (2 sessions)" in text


@pytest.mark.anyio
async def test_a_placement_asks_two_agents_and_the_others_only_when_neither_has_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from coderunner.cluster import agents as agents_module

    nodes = [node(letter * 56, 2, 4096, "bwrap") for letter in "abcd"]
    loads = {"a" * 56: load("a" * 56, 4, 2.0, 0), "b" * 56: load("b" * 56, 4, 2.0, 0),
             "c" * 56: load("c" * 56, 4, 2.0, 0), "d" * 56: load("d" * 56, 1, 0.1, 512)}  # fmt: skip
    asked: list[list[str]] = []

    async def visit(self: Any, entry: dict[str, Any]) -> AgentLoad:
        asked[-1].append(entry["NodeID"])
        self._handles[(entry["NodeID"], self.key)] = f"agent of {entry['NodeID'][0]}"
        return loads[entry["NodeID"]]

    monkeypatch.setattr(agents_module.Agents, "_load", visit)
    agents = agents_module.Agents({}, Request.of(options(), "bwrap"))
    request = Request.of(options(512, 0.5), "bwrap")
    for _ in range(20):
        asked.append([])
        agents._known.clear()  # each placement asks (answers kept are the next test's)
        chosen, handle = await agents.place(request, nodes, warm_wanted=False)
        assert chosen == "d" * 56 and handle == "agent of d"  # the one node with room
        # The first two asked at once; the next two only because those had no room.
        assert len(asked[-1]) == (2 if "d" * 56 in asked[-1][:2] else 4), asked[-1]
    assert {tuple(sorted(pair[:2])) for pair in asked} != {("a" * 56, "b" * 56)}  # chosen at random
    loads["d" * 56] = load("d" * 56, 16, 0.1, 512)
    agents._known.clear()
    with pytest.raises(SessionError, match="no node has room for this session now"):
        await agents.place(request, nodes, warm_wanted=False)


class VisitedAgent:
    """An agent handle whose visits answer a load set by the test, counted."""

    def __init__(self, answer: AgentLoad) -> None:
        self.answer = answer
        self.visits = 0
        self.visit = self  # handle.visit.remote()

    async def remote(self) -> AgentLoad:
        self.visits += 1
        return self.answer


@pytest.mark.anyio
async def test_placements_choose_by_the_agents_last_answers_and_ask_again_behind_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No placement waits for a round trip while the agents' answers are under USABLE_LOAD_S old: they choose
    with what this front door placed since (so a burst spreads, and a warm sandbox is taken once), and an
    answer older than KNOWN_LOAD_S that placed something is asked again once that placement settles. A
    placement asked `fresh` (after a NoRoomNow), or one with an answer older than USABLE_LOAD_S, asks first."""
    from coderunner.cluster import agents as agents_module

    now = [1000.0]
    monkeypatch.setattr(agents_module.time, "monotonic", lambda: now[0])
    a, b = "a" * 56, "b" * 56
    nodes = [node(a, 2, 4096, "bwrap"), node(b, 2, 4096, "bwrap")]
    agents = agents_module.Agents({}, Request.of(options(), "bwrap"))
    handles = {a: VisitedAgent(load(a, warm=1)), b: VisitedAgent(load(b, sessions=1, cpus=0.25, memory_mb=256))}
    for node_id, handle in handles.items():
        agents._handles[(node_id, agents.key)] = handle
    request = Request.of(options(512, 0.5), "bwrap")

    async def place(warm_wanted: bool = False, fresh: bool = False) -> str:
        async with anyio.create_task_group() as group:  # left once the asks behind it are answered
            chosen = (await agents.place(request, nodes, warm_wanted, fresh=fresh))[0]
            agents.settle(chosen, group)  # its create is over
        return chosen

    def visits() -> list[int]:
        return [handle.visits for handle in handles.values()]

    placed = [await place(warm_wanted=True) for _ in range(3)]
    assert visits() == [1, 1]  # one visit each, for three placements
    # a's warm sandbox first; then b, the lighter once a's is counted; then a again (both hold one more).
    assert placed == [a, b, a], placed
    assert agents._known[a][1] == load(a, sessions=2, cpus=1.0, memory_mb=1024, warm=0)

    now[0] += agents_module.KNOWN_LOAD_S / 2
    assert await place() == b  # 0.75 of 2 CPUs against 1.0
    assert visits() == [1, 1]  # answers this young are not asked again
    assert await place(fresh=True) in (a, b)
    assert visits() == [2, 2]  # asked first: the agents' own answers

    now[0] += agents_module.KNOWN_LOAD_S + 0.1  # the fresh placement went to a, the lighter: b is now
    handles[b].answer = load(b, sessions=4, cpus=2.0, memory_mb=2048)  # full now, by another front door
    assert await place() == b  # placed by the aging answers, at once (b's agent would refuse: NoRoomNow)...
    assert visits() == [3, 3]  # ...and both asked again once it settled
    assert await place() == a  # the next placement sees b full
    assert visits() == [3, 3]

    now[0] += agents_module.USABLE_LOAD_S + 0.1
    handles[a].answer, handles[b].answer = load(a, sessions=2, cpus=1.0, memory_mb=1024), load(b)
    assert await place() == b  # answers this old are not used: both asked first
    assert visits() == [4, 4]

    # An open's answer carries its agent's load: the next placement's, unless another placed there is under way.
    now[0] += 1.0
    handles[a].answer, handles[b].answer = load(a, sessions=3, cpus=1.5, memory_mb=1536), load(b)
    agents.heard(a, load(a, sessions=3, cpus=1.5, memory_mb=1536))  # no placement under way on a: taken
    assert agents._known[a] == (now[0], load(a, sessions=3, cpus=1.5, memory_mb=1536))
    first = await agents.place(request, nodes, warm_wanted=False)
    second = await agents.place(request, nodes, warm_wanted=False)
    assert (first[0], second[0]) == (b, b)  # b, then b again (1.0 of 2 CPUs against a's 1.5)
    spent = agents._known[b]
    agents.heard(b, load(b, sessions=1, cpus=0.5, memory_mb=512))  # the first's open: the second still opens
    assert agents._known[b] == spent  # its spend kept
    async with anyio.create_task_group() as group:
        agents.settle(b, group)
        agents.heard(b, load(b, sessions=2, cpus=1.0, memory_mb=1024))  # the second's open, the last under way
        agents.settle(b, group)
    assert agents._known[b] == (now[0], load(b, sessions=2, cpus=1.0, memory_mb=1024))
    assert visits() == [4, 4] and not agents._placing  # fresh answers: nobody asked again

    agents.forget(b, handles[b])
    assert b not in agents._known  # a lost agent's answer is dropped with its handle


def test_an_agent_forgotten_is_told_to_the_front_door_with_its_handle_only() -> None:
    """Its link (long poll, session channel) goes with it; another node's agent keeps its own."""
    from coderunner.cluster import agents as agents_module

    agents = agents_module.Agents({}, Request.of(options(), "bwrap"))
    told: list[Any] = []
    agents.forgotten = told.append
    dead, alive = object(), object()
    agents._handles[("a" * 56, agents.key)] = dead
    agents._handles[("b" * 56, agents.key)] = alive
    agents.forget("a" * 56, dead)
    assert told == [dead]
    assert agents._handles == {("b" * 56, agents.key): alive}
