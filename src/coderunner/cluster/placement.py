"""Where a session may live: the Ray resources it asks for, and a clear refusal when no node fits.

A session asks for its CPU share and memory limit, plus one unit of `coderunner-<backend>`: a node
advertises that resource only where the backend works (`coderunner node-resources` prints what
to pass to `ray start --resources` after running the backend's doctor probe). Ray's scheduler
then picks the node; a request that no live node could ever hold is refused at once, saying what
was asked and what the cluster has, instead of waiting for a node that will never come.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coderunner.config import Settings
from coderunner.errors import SessionError
from coderunner.sandbox.registry import ENTRIES
from coderunner.sessions.sandbox_options import SandboxOptions

MIB = 1 << 20
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

    @classmethod
    def of(cls, options: SandboxOptions, backend: str) -> Request:
        return cls(options.limits.cpus or DEFAULT_CPUS, options.limits.memory_mb, backend)

    def actor_options(self) -> dict[str, Any]:
        """ray.remote options for the session's actor."""
        chosen: dict[str, Any] = {"num_cpus": self.cpus, "resources": {backend_resource(self.backend): 1}}
        if self.memory_mb:
            chosen["memory"] = self.memory_mb * MIB
        return chosen

    def describe(self) -> str:
        memory = f"{self.memory_mb:,} MiB of memory" if self.memory_mb else "no memory limit"
        return f"{self.cpus:g} CPU, {memory} and a node where the {self.backend} backend works"

    def fits(self, total: dict[str, float]) -> bool:
        return (
            total.get("CPU", 0.0) >= self.cpus
            and total.get("memory", 0.0) >= (self.memory_mb or 0) * MIB
            and total.get(backend_resource(self.backend), 0.0) >= 1
        )


def describe_node(node: dict[str, Any]) -> str:
    total = node.get("Resources", {})
    backends = sorted(name.removeprefix("coderunner-") for name in total if name.startswith("coderunner-"))
    return (
        f"{node.get('NodeID', '?')[:12]} ({node.get('NodeManagerAddress', '?')}): {total.get('CPU', 0):g} CPU, "
        f"{total.get('memory', 0) / MIB:,.0f} MiB, backends: {', '.join(backends) or 'none'}"
    )


def check_fits(request: Request, nodes: list[dict[str, Any]]) -> None:
    """Refuse at once a request no live node could ever hold (Ray would leave it pending forever)."""
    alive = [node for node in nodes if node.get("Alive")]
    if any(request.fits(node.get("Resources", {})) for node in alive):
        return
    have = "; ".join(describe_node(node) for node in alive) or "no live node"
    raise SessionError(
        f"no node of the cluster can hold this session: it asks for {request.describe()}. The cluster has: "
        f"{have}. Ask for less (memory_mb, cpus), or add a node (README: 'Beyond one machine')."
    )


def node_resources(settings: Settings) -> dict[str, float]:
    """What this node should advertise to Ray: `coderunner-<backend>` for each backend whose doctor
    readiness finds nothing missing here, as many units as sessions it may hold (max_sessions)."""
    found: dict[str, float] = {}
    for backend in ENTRIES:
        missing, _ = backend.readiness(settings)
        if missing is None:
            found[backend_resource(backend.name)] = float(settings.max_sessions)
    return found
