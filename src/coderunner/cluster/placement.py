"""Where a session may live: the Ray resources it asks for, and a clear refusal when no node fits.

A session asks for its CPU share and memory limit, plus one unit of `coderunner-<backend>`: a node
advertises that resource only where the backend works (`coderunner node-resources` prints what
to pass to `ray start --resources` after running the backend's doctor probe). A request that no live
node could ever hold is refused at once, saying what was asked and what the cluster has, instead of
waiting for a node that will never come.

Sessions live in node agents (agent.py), which reserve nothing of Ray's: each agent keeps its own
account of what its sessions asked for against what its node advertises (room_for). A front door asks
two agents that could hold the request, chosen at random among the nodes that fit, and takes the one
whose answer shows the lighter load (best_of: "the power of two choices", as E2B's orchestrator places
by best-of-3); only when neither has room are the others asked.

A front door may also hold its sessions to nodes with some labels (`ray_node_labels`, which nodes
get from `ray start --labels`): only those nodes are asked, and the refusal counts the labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coderunner.cluster.wire import AgentLoad
from coderunner.config import Settings
from coderunner.errors import SessionError
from coderunner.sandbox.registry import readiness
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.vocabulary.backends import ENTRIES

MIB = 1 << 20


class NoRoomNow(SessionError):
    """An agent's refusal of a session its node cannot hold at this moment: creates that started together
    read the same loads and may all choose one agent, so the front door places such a create again."""


#: CPUs a session asks for when it sets no cpus limit: idle kernels are many to a core.
DEFAULT_CPUS = 0.1


def backend_resource(backend: str) -> str:
    return f"coderunner-{backend}"


@dataclass(frozen=True)
class Request:
    """One session's demand on a node."""

    cpus: float
    memory_mb: int | None
    backend: str
    #: Node labels the node must carry (the `ray_node_labels` setting), as sorted pairs.
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, options: SandboxOptions, backend: str, labels: Mapping[str, str] | None = None) -> Request:
        pairs = tuple(sorted((labels or {}).items()))
        return cls(options.limits.cpus or DEFAULT_CPUS, options.limits.memory_mb, backend, pairs)

    def actor_options(self) -> dict[str, Any]:
        """ray.remote options for a one-shot's task (sessions reserve in their agent: room_for)."""
        chosen: dict[str, Any] = {"num_cpus": self.cpus, "resources": {backend_resource(self.backend): 1}}
        if self.memory_mb:
            chosen["memory"] = self.memory_mb * MIB
        if self.labels:
            chosen["label_selector"] = dict(self.labels)
        return chosen

    def describe(self) -> str:
        memory = f"{self.memory_mb:,} MiB of memory" if self.memory_mb else "no memory limit"
        labelled = f" labelled {format_labels(dict(self.labels))}" if self.labels else ""
        return f"{self.cpus:g} CPU, {memory} and a node{labelled} where the {self.backend} backend works"

    def fits(self, node: dict[str, Any]) -> bool:
        """Whether `node` (an entry of ray.nodes()) could ever hold this, with nothing else on it."""
        total: dict[str, float] = node.get("Resources", {})
        labels: dict[str, str] = node.get("Labels") or {}
        return (
            total.get("CPU", 0.0) >= self.cpus
            and total.get("memory", 0.0) >= (self.memory_mb or 0) * MIB
            and total.get(backend_resource(self.backend), 0.0) >= 1
            and all(labels.get(key) == value for key, value in self.labels)
        )

    def labelled(self, node: dict[str, Any]) -> bool:
        """Whether `node` carries the labels asked for (where a front door keeps warm pools)."""
        labels: dict[str, str] = node.get("Labels") or {}
        return all(labels.get(key) == value for key, value in self.labels)


def format_labels(labels: Mapping[str, str]) -> str:
    """Labels as `ray start --labels` takes them, Ray's own (ray.io/...) left out."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()) if not key.startswith("ray.io/"))


def describe_node(node: dict[str, Any]) -> str:
    total = node.get("Resources", {})
    backends = sorted(name.removeprefix("coderunner-") for name in total if name.startswith("coderunner-"))
    labels = format_labels(node.get("Labels") or {})
    return (
        f"{node.get('NodeID', '?')[:12]} ({node.get('NodeManagerAddress', '?')}): {total.get('CPU', 0):g} CPU, "
        f"{total.get('memory', 0) / MIB:,.0f} MiB, backends: {', '.join(backends) or 'none'}"
        + (f", labels: {labels}" if labels else "")
    )


def check_fits(request: Request, nodes: list[dict[str, Any]]) -> None:
    """Refuse at once a request no live node could ever hold (Ray would leave it pending forever)."""
    alive = [node for node in nodes if node.get("Alive")]
    if any(request.fits(node) for node in alive):
        return
    have = "; ".join(describe_node(node) for node in alive) or "no live node"
    labelled = " with those labels (ray start --labels; the setting ray_node_labels)" if request.labels else ""
    raise SessionError(
        f"no node of the cluster can hold this session: it asks for {request.describe()}. The cluster has: "
        f"{have}. Ask for less (memory_mb, cpus), or add a node{labelled} (README: 'Beyond one machine')."
    )


def check_home(request: Request, node_id: str, nodes: list[dict[str, Any]]) -> None:
    """A session that must start on `node_id` (its snapshot or workspace is there) needs that node to
    carry the front door's labels: refuse it, saying so, rather than start it where it may not run."""
    home = next((node for node in nodes if node.get("NodeID") == node_id and node.get("Alive")), None)
    if home is not None and not request.labelled(home):
        raise SessionError(
            f"what this session starts from is kept on node {describe_node(home)}, which lacks the labels "
            f"this server holds its sessions to ({format_labels(dict(request.labels))}; the setting "
            "ray_node_labels); start it from a front door without them, or set snapshots_shared."
        )


def node_resources(settings: Settings) -> dict[str, float]:
    """What this node should advertise to Ray: `coderunner-<backend>` for each backend whose doctor
    readiness finds nothing missing here, as many units as sessions it may hold (max_sessions)."""
    found: dict[str, float] = {}
    for backend in ENTRIES:
        missing, _ = readiness(backend, settings)
        if missing is None:
            found[backend_resource(backend.name)] = float(settings.max_sessions)
    return found


def room_for(request: Request, node: dict[str, Any], load: AgentLoad) -> bool:
    """Whether the agent whose answer is `load` has room beside its sessions for `request` on `node`."""
    total: dict[str, float] = node.get("Resources", {})
    return (
        load.cpus + request.cpus <= total.get("CPU", 0.0) + 1e-9
        and (load.memory_mb + (request.memory_mb or 0)) * MIB <= total.get("memory", 0.0)
        and load.sessions + 1 <= total.get(backend_resource(request.backend), 0.0)
    )


def share(request: Request, node: dict[str, Any], load: AgentLoad) -> float:
    """How full an agent's node is, by the scarcest of what sessions reserve there (0 empty, 1 full)."""
    total: dict[str, float] = node.get("Resources", {})
    return max(
        load.cpus / max(total.get("CPU", 0.0), 1e-9),
        load.memory_mb * MIB / max(total.get("memory", 0.0), 1.0),
        load.sessions / max(total.get(backend_resource(request.backend), 0.0), 1.0),
    )


def best_of(
    request: Request, answers: list[tuple[dict[str, Any], AgentLoad]], warm_wanted: bool, run: bool = False
) -> str | None:
    """The node id of the agent to hold `request` among those asked: one with room, a warm sandbox first
    when the create could take one (`warm_wanted`), or for a one-shot `run` one with a sandbox started
    ahead (most runs repeat the options of the last), then the lightest; None when none has room."""
    fitting = [(node, load) for node, load in answers if room_for(request, node, load)]
    if not fitting:
        return None

    def warm(load: AgentLoad) -> bool:
        return load.ready_runs > 0 if run else warm_wanted and load.warm > 0

    node, _ = min(fitting, key=lambda pair: (not warm(pair[1]), share(request, *pair)))
    return str(node["NodeID"])


def no_room(request: Request, answers: list[tuple[dict[str, Any], AgentLoad]]) -> SessionError:
    """The refusal when every node that could hold `request` is full now: what each holds."""
    held = "; ".join(
        f"{describe_node(node)}, of which its sessions hold {load.cpus:g} CPU and {load.memory_mb:,} MiB "
        f"({load.sessions} sessions)"
        for node, load in answers
    )
    return SessionError(
        f"no node has room for this session now (it asks for {request.describe()}): {held or 'no node answered'}. "
        "Close a session, ask for less (memory_mb, cpus), add a node, or try again."
    )
