"""What crosses between a front door and a node agent: plain, picklable data, never a live object; and
the names both sides agree on (the agents' names, the session ids that carry their agent).

A session's kernel, sandbox, dirs and jobs stay on its node; the front door gets copies of what the
tools read (an ExecutionResult whose output holds no file descriptor, a JobDelta of new output).

What every run answers (a JobDelta, its result within; a one-shot's result) crosses in its wire form
(`JobDelta.wire`, `oneshot_answer`):
dicts and lists of strings and numbers, which Ray packs as they are (msgpack) where a dataclass would
be pickled and unpickled on each answer (about 0.5 ms of a warm run's round trip, measured). A value
msgpack cannot hold (an egress log, an export listing, a string with a lone surrogate) still crosses,
pickled by Ray: the wire form is only faster, never lossy.
"""

from __future__ import annotations

import collections
import copy
import secrets
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from coderunner.egress.audit import Decision
from coderunner.kernel.execution import CellError, RunOutcome, RunStatus
from coderunner.kernel.output_capture import ImageOutput, OutputCollector
from coderunner.kernel.run_result import ExecutionResult
from coderunner.oneshot.runs import OneShotResult
from coderunner.policy.egress import EgressPolicy
from coderunner.sessions.job_runner import JobOutput
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
    door following it compares, so that it calls only when something it waits for changed."""

    #: Each job the node holds: how many changes a reader could see it has had (text, images, its start, its end).
    jobs: dict[str, int] = field(default_factory=dict)
    #: Hosts its proxy asks the user about, not answered yet (answer with answer_egress).
    questions: tuple[Question, ...] = ()


@dataclass
class JobDelta:
    """What is new in a job since the last read: text, images, saved files; its end, once it ended."""

    job_id: str
    text: str = ""
    images: list[ImageOutput] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    spill_path: str | None = None
    #: Seconds since the job started running its code (None: still waiting for the kernel).
    executing_for_s: float | None = None
    elapsed_s: float = 0.0
    ended: bool = False
    status: str = "running"
    result: ExecutionResult | None = None
    notice: str | None = None
    state_lost: bool = False
    #: A refusal the job raised before it ran, as the caller should read it.
    failure: str | None = None
    generation: int = 0
    dropped_images: int = 0
    #: The agent no longer knows the job (forgotten, or its session closed).
    gone: bool = False
    #: The session's egress since the caller's mark (network 'allowlist' only).
    egress: EgressDelta | None = None
    #: The job's change count as of this read (SessionNews.jobs): a front door reads again once it grew.
    mark: int = 0
    #: At the job's end: what its outbox holds that the front door should copy out (None: nothing).
    exports: ExportListing | None = None

    def wire(self) -> dict[str, Any]:
        """This delta as plain data (the module says why); `of_wire` makes it again."""
        data = {item.name: getattr(self, item.name) for item in fields(self)}
        data["images"] = _plain_images(self.images)
        data["result"] = None if self.result is None else _plain_result(self.result)
        return data

    @classmethod
    def of_wire(cls, data: dict[str, Any]) -> JobDelta:
        values = dict(data)
        values["images"] = _images(values["images"])
        values["result"] = None if values["result"] is None else _result(values["result"])
        return cls(**values)


def oneshot_answer(result: OneShotResult, egress: EgressDelta | None, exports: OneShotExports | None) -> dict[str, Any]:
    """A one-shot run's answer as plain data (the module says why): its result's fields, which are strings,
    numbers and a dict of them; its proxy's decisions and its exported files as they are (Ray pickles those,
    when a run has any). `of_oneshot_answer` makes the three again."""
    return {"result": {item.name: getattr(result, item.name) for item in fields(result)}, "egress": egress,
            "exports": exports}  # fmt: skip


def of_oneshot_answer(data: dict[str, Any]) -> tuple[OneShotResult, EgressDelta | None, OneShotExports | None]:
    return OneShotResult(**data["result"]), data["egress"], data["exports"]


def portable_output(output: OutputCollector) -> OutputCollector:
    """A copy of a finished collector that holds no fd, writer, pending write or hook (safe to pickle)."""
    moved = copy.copy(output)
    moved.writer = None
    moved._pending = []
    moved._spill_fd = None
    if isinstance(moved, JobOutput):
        moved.on_change = None  # the node's hook (session_side.py): bound to what never crosses
    return moved


def portable_result(result: ExecutionResult) -> ExecutionResult:
    outcome = copy.copy(result.outcome)
    outcome.output = portable_output(outcome.output)
    return ExecutionResult(outcome, notice=result.notice, state_lost=result.state_lost)


#: What a collector holds that never crosses (portable_output leaves them empty): made anew on the other side.
LOCAL_ONLY = frozenset({"writer", "_pending", "_spill_fd", "on_change"})


def _plain_images(images: list[ImageOutput]) -> list[dict[str, Any]]:
    return [{item.name: getattr(image, item.name) for item in fields(image)} for image in images]


def _images(plain: list[dict[str, Any]]) -> list[ImageOutput]:
    return [ImageOutput(**values) for values in plain]


def _plain_output(output: OutputCollector) -> dict[str, Any]:
    """Every field of a finished collector but LOCAL_ONLY: its deques as lists, its images as pairs."""
    values: dict[str, Any] = {}
    for item in fields(output):
        if item.name not in LOCAL_ONLY:
            value = getattr(output, item.name)
            values[item.name] = list(value) if isinstance(value, collections.deque) else value
    values["images"] = _plain_images(output.images)
    return {"job": isinstance(output, JobOutput), "fields": values}


def _output(data: dict[str, Any]) -> OutputCollector:
    kind = JobOutput if data["job"] else OutputCollector
    values = dict(data["fields"])
    for item in fields(kind):
        if item.default_factory is collections.deque and item.name in values:
            values[item.name] = collections.deque(values[item.name])
    values["images"] = _images(values["images"])
    return kind(**values)


def _plain_result(result: ExecutionResult) -> dict[str, Any]:
    outcome = {item.name: getattr(result.outcome, item.name) for item in fields(result.outcome)}
    outcome["status"] = result.outcome.status.value
    outcome["output"] = _plain_output(result.outcome.output)
    error = result.outcome.error
    outcome["error"] = None if error is None else {item.name: getattr(error, item.name) for item in fields(error)}
    return {"outcome": outcome, "notice": result.notice, "state_lost": result.state_lost}


def _result(data: dict[str, Any]) -> ExecutionResult:
    outcome = dict(data["outcome"])
    outcome["status"] = RunStatus(outcome["status"])
    outcome["output"] = _output(outcome["output"])
    outcome["error"] = None if outcome["error"] is None else CellError(**outcome["error"])
    return ExecutionResult(RunOutcome(**outcome), notice=data["notice"], state_lost=data["state_lost"])
