"""What crosses between a front door and a node agent: plain, picklable data, never a live object; and
the names both sides agree on (the agents' names, the session ids that carry their agent).

A session's kernel, sandbox, dirs and jobs stay on its node; the front door gets copies of what the
tools read (a JobUpdate, sessions/job_updates.py, with an ExecutionResult that holds no file descriptor).

What every run answers (a JobUpdate, its result within; a one-shot's result) crosses in its wire form
(`JobUpdate.wire`, `oneshot_answer`):
dicts and lists of strings and numbers, which Ray packs as they are (msgpack) where a dataclass would
be pickled and unpickled on each answer (about 0.5 ms of a warm run's round trip, measured). A value
msgpack cannot hold (an egress log, an export listing, a string with a lone surrogate) still crosses,
pickled by Ray: the wire form is only faster, never lossy.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from coderunner.egress.audit import Decision
from coderunner.oneshot.runs import OneShotResult
from coderunner.policy.egress import EgressPolicy
from coderunner.sessions.sandbox_options import SandboxOptions

if TYPE_CHECKING:
    from coderunner.cluster.oneshot_exports import OneShotExports

#: Ray namespace every node agent is named in (found by name from any front door).
NAMESPACE = "coderunner"
#: Agent name prefix: `agent-<node id>-<settings key>` (agent.py says why the key).
AGENT_PREFIX = "agent-"
#: Hex digits of a node id a session id carries (Ray's node ids are 56; 12 tell a cluster's nodes apart).
NODE_TAG_CHARS = 12
#: Bytes per piece of a file moved between a front door and a node (through Ray's object store).
PIECE_BYTES = 1 << 20


#: Settings that describe a node, not the front door: where it keeps its disks and its sandbox
#: environment. Each node takes them from its own configuration (config file, CODERUNNER_* of the
#: `ray start` that started it), whatever the front door's say.
NODE_LOCAL = ("runtime_dir", "workspaces_dir", "snapshots_dir", "sandbox_env", "export_dir")


def agent_name(node_id: str, key: str) -> str:
    """The agent of `node_id` for front doors whose settings have `key` (pool_key.py)."""
    return f"{AGENT_PREFIX}{node_id}-{key}"


def new_session_id(node_id: str, key: str) -> str:
    """A session id that names its agent: random first (logs and snapshot records show an id's first
    characters), then the node's tag and the settings key, so any front door reaches its agent in one call."""
    return f"{secrets.token_urlsafe(18)}-{node_id[:NODE_TAG_CHARS]}-{key}"


def route_of(session_id: str) -> tuple[str, str] | None:
    """(node tag, settings key) of a session id made by new_session_id; None for any other string."""
    parts = session_id.rsplit("-", 2)
    if len(parts) != 3 or len(parts[1]) != NODE_TAG_CHARS or not parts[2]:
        return None
    _, tag, key = parts
    return (tag, key) if set(tag + key) <= HEX else None


HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class AgentLoad:
    """What an agent holds, as it answers a front door choosing where a session goes (placement.py)."""

    node_id: str
    sessions: int
    #: CPUs and MiB of memory its sessions reserved (each its cpus and memory_mb limits, placement.Request).
    cpus: float
    memory_mb: int
    #: Warm sandboxes its manager's pool holds for a create with the default options.
    warm: int
    #: One-shot sandboxes its runs started ahead, ready (for the options of the last runs: oneshot/ready.py).
    ready_runs: int = 0


@dataclass(frozen=True)
class NodeInfo:
    """Where a session lives: Ray's node id and the node's address."""

    node_id: str
    address: str

    @property
    def label(self) -> str:
        return f"{self.node_id[:12]} ({self.address})"


@dataclass
class EgressDelta:
    """An allowlist session's proxy on its node, as of one answer: the decisions after the asker's
    mark (the last of them, if more came), the new mark, totals, open connections and the policy."""

    decisions: list[Decision]
    mark: int
    totals: dict[str, int]
    open_now: list[Decision]
    policy: EgressPolicy


@dataclass
class SessionInfo:
    """A session as its agent describes it on creation and on each lookup."""

    session_id: str
    owner: str
    options: SandboxOptions
    node: NodeInfo
    generation: int
    startup: dict[str, Any] | None = None
    seeded: Any = None
    workspace_path: str = "/workspace"
    #: Its allowlist proxy from the start (network 'allowlist' only).
    egress: EgressDelta | None = None
    #: Its status when it opened (SessionSide.status), for the create's reply.
    status: dict[str, Any] | None = None
    #: Its agent's load with it counted, as a visit would answer (placement's next choice, no visit).
    load: AgentLoad | None = None


@dataclass(frozen=True)
class Question:
    """A host a node's proxy would put to the user (cluster/relay_asker.py)."""

    question_id: str
    host: str
    port: int


@dataclass(frozen=True)
class ExportItem:
    """A file new or changed in a session's outbox on its node: its first bytes (`head`) come along
    when they fit the listing's budget; the rest is read in pieces (read_export_piece)."""

    rel: str
    size: int
    ino: int
    head: bytes = b""


@dataclass
class ExportListing:
    """What a node's outbox holds that its front door has not copied yet (cluster/node_exports.py)."""

    items: list[ExportItem] = field(default_factory=list)
    #: What the node's scan would not copy (links, FIFOs, too deep, too many entries), as the report says.
    skipped: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.items or self.skipped)


@dataclass(frozen=True)
class SessionNews:
    """A session's value in its agent's long poll (sessions/changes.py; the key is its id): what a front
    door following it waits for, so that it calls only when there is something to answer."""

    #: Hosts its proxy asks the user about, not answered yet (answer with answer_egress).
    questions: tuple[Question, ...] = ()


def oneshot_answer(result: OneShotResult, egress: EgressDelta | None, exports: OneShotExports | None) -> dict[str, Any]:
    """A one-shot run's answer as plain data (the module says why): its result's fields, which are strings,
    numbers and a dict of them; its proxy's decisions and its exported files as they are (Ray pickles those,
    when a run has any). `of_oneshot_answer` makes the three again."""
    return {"result": {item.name: getattr(result, item.name) for item in fields(result)}, "egress": egress,
            "exports": exports}  # fmt: skip


def of_oneshot_answer(data: dict[str, Any]) -> tuple[OneShotResult, EgressDelta | None, OneShotExports | None]:
    return OneShotResult(**data["result"]), data["egress"], data["exports"]
