"""RemoteSession: a SessionHandle (sessions/seam.py) for a session that lives in a node agent (agent.py).

Calls go to its agent with the session id first (`agent.call`), each bounded; what the tools read
synchronously (options, the kernel's generation, export note) is kept here from the agent's answers.
An agent that stops answering (its node gone, or the agent itself killed) turns every call into a
SessionError that says the session was lost, with what was lost.

Its jobs are forwarded as the session's own job calls (start_run, wait_job, read_job), each answer a
JobUpdate (sessions/job_updates.py): a job lives on its node only, and waiting for one is a bounded call
there. The hosts its proxy asks the user about come by its agent's long poll (agent_watch.py): the session
follows it while a run or a guest call whose user can be asked goes, and answers each new question.

One idea: a session in a node agent as the tools use it: each call forwarded, what they read kept from
the answers and from the agent's long poll.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import anyio
import ray
from anyio.abc import TaskGroup

from coderunner.cluster.agent_link import AgentLink
from coderunner.cluster.agent_watch import AgentWatch
from coderunner.cluster.remote_egress import RemoteEgress
from coderunner.cluster.remote_exports import RemoteExports
from coderunner.cluster.remote_files import RemoteFiles, RemoteWorkspaceWriter
from coderunner.cluster.session_channel import ChannelBroken, ChannelUnused
from coderunner.cluster.wire import EgressDelta, ExportListing, Question, SessionInfo, SessionNews
from coderunner.errors import CodeRunnerError, SessionError
from coderunner.kernel.client import longest_grace_s
from coderunner.kernel.output_capture import WorkspaceWriter
from coderunner.sandbox import LimitReport
from coderunner.sessions.job_updates import JobUpdate
from coderunner.sessions.session_status import SessionStatus, export_entry

if TYPE_CHECKING:
    from coderunner.config import Settings
    from coderunner.sessions.egress_wiring import SessionEgress
    from coderunner.sessions.sandbox_options import SandboxOptions

log = logging.getLogger(__name__)

#: Bound on a control call to a session's agent (status, files piece, job read beyond its own wait).
CALL_S = 30.0
#: Ids of its jobs a session remembers the node holds for readers (manage_jobs finds a job's session by them).
MAX_KNOWN_JOBS = 64
#: Bound on the last look into the outbox before a close (a node that does not answer is not waited for twice).
CLOSE_EXPORT_S = 10.0
#: Bound on asking the node to cancel a run's wait that had not answered (the node then cancels the cell).
CANCEL_S = 5.0


class RemoteSession:
    """One session in a node agent, as the tools use it. `agent_lost(node id, agent)`: told when the agent
    stops answering (the front door then forgets its handle). `link`: the front door's long poll and session
    channel of the agent (one per agent, agent_link.py; by default a long poll of its own and Ray's calls)."""

    def __init__(
        self, agent: Any, info: SessionInfo, settings: Settings, task_group: TaskGroup,
        agent_lost: Callable[[str, Any], None] | None = None, link: AgentLink | None = None,
        reattach: Callable[[RemoteSession, Any], Awaitable[bool]] | None = None,
    ) -> None:  # fmt: skip
        self.agent = agent
        #: Asked once its agent (the second argument) died while its node lives: whether the node's next agent
        #: took it over (host.py).
        self._reattach = reattach
        #: Set when its agent died alone (not with its node): the next call asks `reattach` first.
        self.agent_died = False
        self._link = link
        self._watch = link.watch if link is not None else AgentWatch(agent, task_group)
        #: Questions being answered now; guest calls under way whose user can be asked about hosts.
        self._answering: set[str] = set()
        self._asking_calls = 0
        #: A run whose user can be asked goes (from its start until an answer says it ended), and its job id.
        self._asking_run = False
        self._asking_job: str | None = None
        #: Its jobs this front door knows the node holds (running, or ended and kept for a reader), oldest first.
        self._job_ids: dict[str, None] = {}
        self._agent_lost = agent_lost
        self.info = info
        self.settings = settings
        self._task_group = task_group
        self._generation = info.generation
        self._reported_generation: int | None = None
        self.export_note: str | None = None
        self.close_note: str | None = None
        self.closed = False
        #: Network 'allowlist': the node's proxy, mirrored from the agent's answers (remote_egress.py).
        self._egress = RemoteEgress(info.session_id, info.egress.policy) if info.egress is not None else None
        self._take_egress(info.egress)
        #: What the node's outbox gets reaches this machine's export_dir/<client> (remote_exports.py).
        self._exports = (
            RemoteExports(settings.export_dir, settings, info.options.client, self.call_each)
            if settings.export_dir is not None
            else None
        )

    # --- what the tools read ---------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self.info.session_id

    @property
    def owner(self) -> str:
        return self.info.owner

    @property
    def options(self) -> SandboxOptions:
        return self.info.options

    @property
    def node(self) -> str:
        return self.info.node.node_id

    @property
    def startup(self) -> dict[str, Any] | None:
        return self.info.startup

    @property
    def seeded(self) -> Any:
        return self.info.seeded

    @property
    def egress(self) -> SessionEgress | None:
        """The node's proxy as the tools read it (its decisions and policy; a call's asker is kept here)."""
        return self._egress  # type: ignore[return-value]  # the part of SessionEgress the tools use

    @property
    def _egress_mark(self) -> int | None:
        return self._egress.mark if self._egress is not None else None

    def _take_egress(self, delta: EgressDelta | None) -> None:
        if self._egress is not None:
            self._egress.apply(delta)

    async def _answer(self, question: Question) -> None:
        """Put a node's question to the user of the call lent now (none: no answer, the node denies)."""
        asker = self._egress.asker if self._egress is not None else None
        allowed = await asker(question.host, question.port) if asker is not None else None
        with contextlib.suppress(SessionError):
            await self.acall("answer_egress", question.question_id, allowed)

    @property
    def sandbox_uid(self) -> None:
        return None  # a uid of another machine means nothing here

    @property
    def files(self) -> RemoteFiles:
        return RemoteFiles(self.call, self.settings.transfer_limit_bytes)

    def reply_writer(self) -> WorkspaceWriter:
        return RemoteWorkspaceWriter(self.files, self.info.workspace_path)

    def note_restored_from(self, text: str) -> None:
        pass

    def lost_text(self, exc: BaseException | None = None, node_lost: bool = True) -> str:
        what = f"node {self.info.node.label}" if node_lost else f"the agent of node {self.info.node.label}"
        return (
            f"session {self.session_id} was lost with {what}: its kernel, variables and workspace files there are "
            f"gone (the {'node' if node_lost else 'agent'} stopped answering"
            + (f": {type(exc).__name__}" if exc is not None else "")
            + "). create_session starts a new one; sessions on other nodes are unharmed."
        )

    def gone(self, exc: BaseException, node_lost: bool | None = None) -> SessionError:
        """Its agent is gone: with its node, or killed itself (an agent holding sessions never ends on its
        own), and the session with it unless the node's next agent takes it over (`agent_died`: the next call
        asks). Blocking (it asks Ray whether the node lives): call it from a worker thread."""
        self.closed = True
        if node_lost is None:
            node_lost = lost_with_node(exc, self.info.node.node_id)
        self.agent_died = not node_lost
        if self._agent_lost is not None:
            self._agent_lost(self.node, self.agent)
        return SessionError(self.lost_text(exc, node_lost))

    def kept_text(self, method: str, exc: BaseException) -> str:
        """What a call that found its agent dead says once the node's next agent took the session over."""
        return (
            f"session {self.session_id}'s agent on node {self.info.node.label} died during this {method} "
            f"({type(exc).__name__}), and the node's next agent took the session over: its kernel, variables and "
            "files are kept. What this call did is unknown (a cell it started may have run, or still run): look "
            "before doing it again."
        )

    def rebind(self, agent: Any, info: SessionInfo, link: AgentLink) -> None:
        """Its node's next agent took it over (host.py reattach): calls go there from now on. What the dead agent
        held of its calls (jobs, questions) went with it, and its proxy's decision log: the next agent's counts from
        the start, so this mirror asks from there (what it mirrored stays)."""
        self._watch.forget(self.session_id)
        self.agent, self._link, self._watch, self.info = agent, link, link.watch, info
        self._job_ids.clear()
        self._asking_run, self._asking_job, self._answering = False, None, set()
        if self._egress is not None:
            self._egress.mark = 0
        self.closed = self.agent_died = False
        self._track(info.generation)

    # --- calls -----------------------------------------------------------------------------------

    async def acall(self, method: str, *args: Any, timeout_s: float = CALL_S, again: bool = True) -> Any:
        """One call of the session's agent from the event loop, bounded: by its session channel when there is
        one, else (or if it cannot connect) by Ray. An agent gone is a SessionError saying so, unless the node's
        next agent took the session over (`reattach`): then a call that cannot have reached the dead agent (its
        channel was refused, so the agent was gone before it: `again`) is made once more, there."""
        channel = self._link.channel if self._link is not None else None
        agent = self.agent
        unsent = False
        try:
            with anyio.fail_after(timeout_s):
                if channel is not None:
                    try:
                        return await channel.call("call", (self.session_id, method, list(args)))
                    except ChannelUnused:
                        unsent = True
                    except ChannelBroken as exc:
                        raise await self._broken(exc, method) from None
                return await self.agent.call.remote(self.session_id, method, list(args))
        except AGENT_FAILURES as exc:
            failure, reattached = await self._failure(exc, method, timeout_s, agent)
            if reattached and unsent and again:
                return await self.acall(method, *args, timeout_s=timeout_s, again=False)
            raise failure from None

    async def _broken(self, exc: ChannelBroken, method: str) -> BaseException:
        """The channel ended while `method` was under way: Ray says whether the agent still lives (else its failure
        is the session's); if it does, the call's end is unknown and the caller is told so."""
        await self.agent.ping.remote()
        return SessionError(
            f"session {self.session_id}'s {method} was cut off on its way ({exc}); whether it ran is unknown. The "
            "session is still there: look before doing it again"
        )

    async def _failure(
        self, exc: BaseException, method: str, timeout_s: float, agent: Any
    ) -> tuple[BaseException, bool]:
        """One of AGENT_FAILURES (of a call of `agent`) as the tools read it: a SessionError saying what happened,
        or the agent's own; and whether the node's next agent took the session over meanwhile."""
        if isinstance(exc, TimeoutError):
            late = f"session {self.session_id}'s node did not answer {method} within {timeout_s:g}s"
            return SessionError(late), False
        if isinstance(exc, ray.exceptions.RayTaskError):
            return cause_of(exc), False
        node_lost = await anyio.to_thread.run_sync(lost_with_node, exc, self.info.node.node_id)
        if not node_lost and self._reattach is not None and await self._reattach(self, agent):
            return SessionError(self.kept_text(method, exc)), True
        return await anyio.to_thread.run_sync(self.gone, exc, node_lost), False

    def call(self, method: str, *args: Any, timeout_s: float = CALL_S) -> Any:
        """One call of the session's agent from a worker thread (the file view's), bounded the same way."""
        return self.call_each(method, [args], timeout_s=timeout_s)[0]

    def call_each(self, method: str, arg_lists: list[tuple[Any, ...]], timeout_s: float = CALL_S) -> list[Any]:
        """Several calls of one method sent at once from a worker thread, their answers in order, bounded as one
        (pieces of a file in flight together: each piece's round trip no longer adds up)."""
        try:
            refs = [self.agent.call.remote(self.session_id, method, list(args)) for args in arg_lists]
            return list(ray.get(refs, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise SessionError(
                f"session {self.session_id}'s node did not answer {method} within {timeout_s:g}s"
            ) from None
        except ray.exceptions.RayTaskError as exc:
            raise cause_of(exc) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            lost = self.gone(exc)
            if self.agent_died and self._reattach is not None:  # the next call asks the node's next agent first
                raise SessionError(
                    f"session {self.session_id}'s agent on node {self.info.node.label} died during this {method} "
                    f"({type(exc).__name__}); the node's next agent may take the session over: call again"
                ) from None
            raise lost from None

    # --- jobs: forwarded as they are, each answer a JobUpdate (sessions/job_updates.py) -------------

    async def start_run(
        self, code: str, timeout_s: float | None, variables: dict[str, Any] | None = None, wait_s: float = 0.0
    ) -> JobUpdate:
        limit = min(timeout_s or self.options.timeout_s, self.settings.max_timeout_s)
        token = secrets.token_hex(8)
        self.export_note = None
        asking = self._egress is not None and self._egress.asker is not None
        self._asking_run = self._asking_run or asking  # its questions may come before it answers: followed now
        self._follow_as_needed()
        try:
            answer = await self.acall(
                "start_run", code, timeout_s, variables, self.owner, wait_s, self._egress_mark, token, asking,
                timeout_s=limit + wait_s + CALL_S,
            )  # fmt: skip
        except anyio.get_cancelled_exc_class():  # cancelled before the node answered: the cell must not run on
            with anyio.CancelScope(shield=True), contextlib.suppress(SessionError):
                await self.acall("cancel_run", token, timeout_s=CANCEL_S)
            raise
        except BaseException:
            self._asking_run = False
            self._follow_as_needed()
            raise
        return await self._taken(answer, asking)

    async def wait_job(self, job_id: str, wait_s: float) -> JobUpdate:
        token = secrets.token_hex(8)
        try:
            answer = await self.acall("wait_job", job_id, wait_s, self._egress_mark, token, timeout_s=wait_s + CALL_S)
        except anyio.get_cancelled_exc_class():  # the run's own wait, cancelled: so is the node's, and the cell
            with anyio.CancelScope(shield=True), contextlib.suppress(SessionError):
                await self.acall("cancel_run", token, timeout_s=CANCEL_S)
            raise
        return await self._taken(answer)

    async def read_job(self, job_id: str, wait_s: float = 0.0, take: bool = True) -> JobUpdate:
        answer = await self.acall("read_job", job_id, wait_s, take, self._egress_mark, timeout_s=wait_s + CALL_S)
        return await self._taken(answer, kept=True)

    async def _taken(self, answer: dict[str, Any], asking: bool = False, kept: bool = False) -> JobUpdate:
        """Take in what an answer brought beside its update: the kernel's generation, the proxy's decisions, and
        at the job's end the outbox (copied out before the reply is made, so that it carries the note).
        `kept`: a job that ended is kept on the node for its readers (a read's); else it was forgotten there."""
        update = JobUpdate.of_wire(answer["update"])
        self._track(update.generation)
        self._take_egress(answer["egress"])
        await self._take_exports(answer["exports"])
        if asking and update.running:
            self._asking_job = update.job_id
        if not update.running and (asking or update.job_id == self._asking_job):
            self._asking_run, self._asking_job = False, None
        self._job_ids.pop(update.job_id, None)
        if update.running or (kept and not update.gone):
            self._job_ids[update.job_id] = None
            while len(self._job_ids) > MAX_KNOWN_JOBS:
                del self._job_ids[next(iter(self._job_ids))]
        self._follow_as_needed()
        return update

    async def cancel_job(self, job_id: str) -> None:
        bound = longest_grace_s(self.settings.interrupt_grace_s) + self.settings.startup_timeout_s + CALL_S
        await self.acall("cancel_job", job_id, timeout_s=bound)  # a kernel that ignores it is restarted within

    async def list_jobs(self) -> list[dict[str, Any]]:
        return list(await self.acall("list_jobs"))

    def holds_job(self, job_id: str) -> bool:
        return job_id in self._job_ids

    # --- what the agent's long poll brings (agent_watch.py) --------------------------------------

    def _follow_as_needed(self) -> None:
        """Follow the session's news while a run or a guest call whose user can be asked goes; else not."""
        if (self._asking_run or self._asking_calls) and not self.closed:
            self._watch.follow(self.session_id, self)
        else:
            self._watch.unfollow(self.session_id, self)

    def news(self, news: SessionNews) -> None:
        """The node published news of this session: answer the new questions."""
        for question in news.questions:
            if question.question_id not in self._answering:
                self._answering.add(question.question_id)
                self._task_group.start_soon(self._answer, question)
        self._answering &= {question.question_id for question in news.questions}

    def dropped(self) -> None:
        """Its agent no longer holds it (closed by another front door, or its node's idle reaper): its calls
        say so themselves; nothing is waited for here."""
        self._asking_run = False
        self._follow_as_needed()

    def lost(self, exc: BaseException) -> None:
        """Its agent's long poll failed: the calls under way fail on their own, saying why."""
        log.info("session %s…: its agent's long poll failed: %r", self.session_id[:6], exc)
        self._asking_run = False
        self._follow_as_needed()

    # --- the session -----------------------------------------------------------------------------

    def _track(self, generation: int) -> None:
        self._generation = max(self._generation, generation)

    @property
    def kernel_reported(self) -> bool:
        return self._reported_generation is not None

    def kernel_state(self, lost: bool = False) -> tuple[int, bool]:
        previous = self._reported_generation
        preserved = not lost and previous in (None, self._generation)
        self._reported_generation = self._generation
        return self._generation, preserved

    async def reset(self) -> None:
        self._track(await self.acall("reset", timeout_s=self.settings.startup_timeout_s + CALL_S))

    async def copy_out(self) -> None:
        """What the outbox holds now, copied here (write_file's: a file written to the export mount)."""
        self.export_note = None
        await self._take_exports(await self.acall("export_changes"))

    async def _take_exports(self, listing: ExportListing | None) -> None:
        """Copy a listing into the client's export folder here (a worker thread; shielded, as one machine's)."""
        if listing is None or self._exports is None:
            return
        with anyio.CancelScope(shield=True):
            self.export_note = await anyio.to_thread.run_sync(self._exports.pull, listing)

    async def guest_op(
        self, tool: str, op: str, args: dict[str, Any], timeout_s: float, *,
        paths: Iterable[str] = (), input_path: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        return await self._with_egress("guest_op", tool, op, args, timeout_s, list(paths), input_path,
                                       timeout_s=timeout_s + CALL_S)  # fmt: skip

    async def install_packages(self, packages: list[str], timeout_s: float) -> dict[str, Any]:
        return await self._with_egress("install_packages", packages, timeout_s, timeout_s=timeout_s + CALL_S)

    async def _with_egress(self, method: str, *args: Any, timeout_s: float) -> dict[str, Any]:
        """A call that may reach the network: its answer (or its refusal) brings the proxy's decisions.
        While it goes, the session follows its news: the questions its node's proxy asks are put to this call's user."""
        ask_token = secrets.token_hex(8) if self._egress is not None and self._egress.asker is not None else None
        self._asking_calls += ask_token is not None
        self._follow_as_needed()
        self.export_note = None
        try:
            done, egress, exports = await self.acall(method, *args, self._egress_mark, ask_token, timeout_s=timeout_s)
        except CodeRunnerError as exc:
            self._take_egress(getattr(exc, "egress", None))
            raise
        finally:
            self._asking_calls -= ask_token is not None
            self._follow_as_needed()
        self._take_egress(egress)
        await self._take_exports(exports)
        return dict(done)

    async def status(self) -> SessionStatus:
        """The first, right after the open, is the status the open brought (its create's reply): no call."""
        opened, self.info.status = self.info.status, None
        raw: dict[str, Any] = opened if opened is not None else await self.acall("status", self._egress_mark)
        self._track(raw.get("kernel_generation", 0))
        self._take_egress(raw.pop("egress", None))
        known = {field.name for field in fields(SessionStatus)}
        status = {key: value for key, value in raw.items() if key in known}
        # The node sent each LimitReport as a dict: typed again, as a local session's are.
        status["limits"] = {name: LimitReport(**report) for name, report in status.get("limits", {}).items()}
        if self._exports is not None:  # the node lists no export mount: its outbox is copied out here
            status["mounts"] = [
                *status.get("mounts", []),
                export_entry(self.settings.export_mount, self._exports.target),
            ]
        return SessionStatus(**status)

    async def close(self) -> None:
        if self.closed:
            return
        with contextlib.suppress(CodeRunnerError):  # what the outbox got since the last call, before it goes
            await self._take_exports(await self.acall("export_changes", timeout_s=CLOSE_EXPORT_S))
        self.closed = True
        self._watch.forget(self.session_id)
        self.close_note = await self.acall("close", timeout_s=self.settings.snapshot_timeout_s + CALL_S)


#: What a call of an agent may fail with that the session turns into its own error (_failure).
AGENT_FAILURES = (
    TimeoutError,
    ray.exceptions.RayTaskError,
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnavailableError,
)


def cause_of(exc: Any) -> BaseException:
    """What the agent raised, as the tools would have seen it here: a CodeRunnerError (SessionError,
    FileAccessError, SessionBusy) as itself; anything else, a crash on the node, as a SessionError."""
    original = getattr(exc, "cause", None)
    if isinstance(original, CodeRunnerError):
        return original
    what = type(original).__name__ if original is not None else "an error"
    return SessionError(f"the session's node failed with {what} (its log says more)")


def lost_with_node(exc: BaseException, node_id: str) -> bool:
    """Whether the agent went away with its node (rather than alone: killed, or crashed)."""
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return True
    try:
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    except Exception:  # the cluster itself does not answer: nothing of it can be relied on
        return True
    return node_id not in alive
