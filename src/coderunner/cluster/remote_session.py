"""RemoteSession: a SessionHandle (sessions/seam.py) for a session that lives in a node agent (agent.py).

Calls go to its agent with the session id first (`agent.call`), each bounded; what the tools read
synchronously (options, the kernel's generation, export note) is kept here from the agent's answers.
An agent that stops answering (its node gone, or the agent itself killed) turns every call into a
SessionError that says the session was lost, with what was lost.

What it waits for on the node (a running job's progress and end, a host its proxy asks the user about)
comes by its agent's long poll (agent_watch.py): the session follows it while something is under way,
reads a job when its change count passed the last read's and answers each new question.

One idea: a session in a node agent as the tools use it: each call forwarded, what they read kept from
the answers and from the agent's long poll.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import anyio
import ray
from anyio.abc import TaskGroup

from coderunner.cluster.agent_link import AgentLink
from coderunner.cluster.agent_watch import ANSWER_S, POLL_WAIT_S, AgentWatch
from coderunner.cluster.remote_egress import RemoteEgress
from coderunner.cluster.remote_exports import RemoteExports
from coderunner.cluster.remote_files import RemoteFiles, RemoteWorkspaceWriter
from coderunner.cluster.remote_job import RemoteJob, mirror_output
from coderunner.cluster.session_channel import ChannelBroken, ChannelUnused
from coderunner.cluster.wire import EgressDelta, ExportListing, JobDelta, Question, SessionInfo, SessionNews
from coderunner.errors import CodeRunnerError, SessionError
from coderunner.kernel.client import longest_grace_s
from coderunner.kernel.output_capture import WorkspaceWriter
from coderunner.kernel.run_result import ExecutionResult
from coderunner.sandbox import LimitReport
from coderunner.sessions.job_runner import Job, JobStatus, label_of
from coderunner.sessions.kernel_calls import python_job_result
from coderunner.sessions.session_status import SessionStatus, export_entry

if TYPE_CHECKING:
    from coderunner.config import Settings
    from coderunner.sessions.egress_wiring import SessionEgress
    from coderunner.sessions.sandbox_options import SandboxOptions

log = logging.getLogger(__name__)

#: Bound on a control call to a session's agent (status, files piece, job read beyond its own wait).
CALL_S = 30.0
#: How long a run waits on the node for a quick cell to end before its first answer comes back.
FIRST_WAIT_S = 0.5
#: Bound on the last look into the outbox before a close (a node that does not answer is not waited for twice).
CLOSE_EXPORT_S = 10.0
#: Bound on cancelling a run whose first answer had not come (beyond the interrupt's own grace).
CANCEL_S = 5.0


class RemoteSession:
    """One session in a node agent, as the tools use it. `agent_lost(node id, agent)`: told when the agent
    stops answering (the front door then forgets its handle). `link`: the front door's long poll and session
    channel of the agent (one per agent, agent_link.py; by default a long poll of its own and Ray's calls)."""

    def __init__(
        self, agent: Any, info: SessionInfo, settings: Settings, task_group: TaskGroup,
        agent_lost: Callable[[str, Any], None] | None = None, link: AgentLink | None = None,
    ) -> None:  # fmt: skip
        self.agent = agent
        self._link = link
        self._watch = link.watch if link is not None else AgentWatch(agent, task_group)
        #: The latest news of it the long poll brought; jobs being read now; questions being answered now;
        #: calls under way whose user can be asked about hosts.
        self._news = SessionNews()
        self._reading: set[str] = set()
        self._answering: set[str] = set()
        self._asking_calls = 0
        self._agent_lost = agent_lost
        self.info = info
        self.settings = settings
        self._task_group = task_group
        self._generation = info.generation
        self._reported_generation: int | None = None
        self._jobs: dict[str, RemoteJob] = {}
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

    def gone(self, exc: BaseException) -> SessionError:
        """Its agent is gone: with its node, or killed itself (an agent holding sessions never ends on its
        own), and the session with it. Blocking (it asks Ray whether the node lives): call it from a worker thread."""
        self.closed = True
        if self._agent_lost is not None:
            self._agent_lost(self.node, self.agent)
        return SessionError(self.lost_text(exc, _node_lost(exc, self.info.node.node_id)))

    # --- calls -----------------------------------------------------------------------------------

    async def acall(self, method: str, *args: Any, timeout_s: float = CALL_S) -> Any:
        """One call of the session's agent from the event loop, bounded: by its session channel when there is
        one, else (or if it cannot connect) by Ray. An agent gone is a SessionError saying so."""
        channel = self._link.channel if self._link is not None else None
        try:
            with anyio.fail_after(timeout_s):
                if channel is not None:
                    try:
                        return await channel.call("call", (self.session_id, method, list(args)))
                    except ChannelUnused:
                        pass
                    except ChannelBroken as exc:
                        raise await self._broken(exc, method) from None
                return await self.agent.call.remote(self.session_id, method, list(args))
        except AGENT_FAILURES as exc:
            raise await self._failure(exc, method, timeout_s) from None

    async def _broken(self, exc: ChannelBroken, method: str) -> BaseException:
        """The channel ended while `method` was under way: Ray says whether the agent still lives (else its failure
        is the session's); if it does, the call's end is unknown and the caller is told so."""
        await self.agent.ping.remote()
        return SessionError(
            f"session {self.session_id}'s {method} was cut off on its way ({exc}); whether it ran is unknown. The "
            "session is still there: look before doing it again"
        )

    async def _failure(self, exc: BaseException, method: str, timeout_s: float) -> BaseException:
        """One of AGENT_FAILURES as the tools read it: a SessionError saying what happened, or the agent's own."""
        if isinstance(exc, TimeoutError):
            return SessionError(f"session {self.session_id}'s node did not answer {method} within {timeout_s:g}s")
        if isinstance(exc, ray.exceptions.RayTaskError):
            return cause_of(exc)
        return await anyio.to_thread.run_sync(self.gone, exc)

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
            raise self.gone(exc) from None

    # --- jobs ------------------------------------------------------------------------------------

    async def start_run(self, code: str, timeout_s: float | None, variables: dict[str, Any] | None = None) -> Job:
        limit = min(timeout_s or self.options.timeout_s, self.settings.max_timeout_s)
        token = secrets.token_hex(8)
        self.export_note = None
        asking = self._egress is not None and self._egress.asker is not None
        self._asking_calls += asking  # its questions may come during its first wait: followed from now
        self._follow_as_needed()
        answered = False
        try:
            first = JobDelta.of_wire(await self.acall(
                "start_run", code, timeout_s, variables, self.owner, FIRST_WAIT_S, self._egress_mark, token,
                asking, timeout_s=limit + CALL_S,
            ))  # fmt: skip
            answered = True
        except anyio.get_cancelled_exc_class():  # cancelled before the node answered: the cell must not run on
            with anyio.CancelScope(shield=True), contextlib.suppress(SessionError):
                await self.acall(
                    "cancel_run", token, timeout_s=longest_grace_s(self.settings.interrupt_grace_s) + CANCEL_S
                )
            raise
        finally:
            self._asking_calls -= asking
            if not answered:
                self._follow_as_needed()
        self._take_egress(first.egress)
        job = RemoteJob(
            job_id=first.job_id, kind="python", label=label_of(code), owner=self.owner, session_id=self.session_id,
            output=mirror_output(self.settings.output_limit_chars),
        )  # fmt: skip

        def request_cancel() -> None:
            self._task_group.start_soon(self._cancel_remote, job.job_id)

        job.request_cancel = request_cancel
        self._jobs[job.job_id] = job
        await self._take_exports(first.exports)  # before its end is seen: the reply carries the note
        job.apply(first)
        job.node_forgot = first.ended  # the node dropped a job it answered whole
        self._track(first.generation)
        self._follow_as_needed()
        self._catch_up_soon(job)  # its news may have come before its first answer
        return job

    # --- what the agent's long poll brings (agent_watch.py) --------------------------------------

    def _follow_as_needed(self) -> None:
        """Follow the session's news while a job of it runs or a call that can ask goes; else not."""
        running = any(isinstance(job, RemoteJob) and not job.done.is_set() for job in self._jobs.values())
        if (running or self._asking_calls) and not self.closed:
            self._watch.follow(self.session_id, self)
        else:
            self._watch.unfollow(self.session_id, self)

    def news(self, news: SessionNews) -> None:
        """The node published news of this session: read the jobs that changed, answer the new questions."""
        self._news = news
        for job in list(self._jobs.values()):
            self._catch_up_soon(job)
        for question in news.questions:
            if question.question_id not in self._answering:
                self._answering.add(question.question_id)
                self._task_group.start_soon(self._answer, question)
        self._answering &= {question.question_id for question in news.questions}

    def dropped(self) -> None:
        """Its agent no longer holds it (closed by another front door, or its node's idle reaper)."""
        refusal = f"unknown or expired session_id {self.session_id!r}"
        self._end_running(refusal, refusal)

    def lost(self, exc: BaseException) -> None:
        """Its agent's long poll failed (the agent or its node gone, or no answer in time)."""
        self._task_group.start_soon(self._lose, exc)

    async def _lose(self, exc: BaseException) -> None:
        if isinstance(exc, AGENT_FAILURES):
            failure = str(await self._failure(exc, "its long poll", POLL_WAIT_S + ANSWER_S))
            self._end_running(failure, failure)
        else:
            self._end_running(self.lost_text(exc), None)

    def _end_running(self, notice: str, failure: str | None) -> None:
        for job in self._jobs.values():
            if isinstance(job, RemoteJob) and not job.done.is_set():
                job.end(JobStatus.LOST, notice=notice, failure=failure)

    def _catch_up_soon(self, job: Job) -> None:
        if isinstance(job, RemoteJob) and not job.done.is_set() and job.job_id not in self._reading:
            mark = self._news.jobs.get(job.job_id)
            if mark is None or mark > job.read_mark:
                self._reading.add(job.job_id)
                self._task_group.start_soon(self._catch_up, job)

    async def _catch_up(self, job: RemoteJob) -> None:
        """Read the job until the last read is as new as its news (once, if the news has not named it yet)."""
        try:
            while not job.done.is_set():
                mark = self._news.jobs.get(job.job_id)
                if mark is not None and mark <= job.read_mark:
                    break
                try:
                    job.apply(await self._read(job.job_id))
                except CodeRunnerError as exc:
                    job.end(JobStatus.LOST, notice=str(exc), failure=str(exc))
                except Exception as exc:  # the agent or its node is gone: say so instead of waiting forever
                    log.info("job %s: %r", job.job_id, exc)
                    job.end(JobStatus.LOST, notice=self.lost_text(exc))
                if mark is None:
                    break
        finally:
            self._reading.discard(job.job_id)
            self._follow_as_needed()

    async def _read(self, job_id: str) -> JobDelta:
        delta = JobDelta.of_wire(await self.acall("read_job", job_id, self._egress_mark))
        self._track(delta.generation)
        self._take_egress(delta.egress)
        await self._take_exports(delta.exports)
        return delta

    async def _cancel_remote(self, job_id: str) -> None:
        try:
            await self.acall("cancel_job", job_id, timeout_s=longest_grace_s(self.settings.interrupt_grace_s) + CALL_S)
        except SessionError as exc:
            log.info("cancelling %s: %s", job_id, exc)

    def job_result(self, job: Job) -> ExecutionResult:
        return python_job_result(job)

    def job(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def list_jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def forget_job(self, job: Job) -> None:
        self._jobs.pop(job.job_id, None)
        if not (isinstance(job, RemoteJob) and job.node_forgot):
            self._task_group.start_soon(self._forget_remote, job.job_id)

    async def _forget_remote(self, job_id: str) -> None:
        with contextlib.suppress(SessionError):
            await self.acall("forget_job", job_id)

    async def cancel_job(self, job: Job) -> None:
        job.cancel_requested = True
        await self.acall(
            "cancel_job",
            job.job_id,
            timeout_s=longest_grace_s(self.settings.interrupt_grace_s) + self.settings.startup_timeout_s + CALL_S,
        )
        with anyio.move_on_after(CALL_S):
            await job.done.wait()

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

    def status(self) -> SessionStatus:
        """Called in a worker thread (the tools' summary): a blocking, bounded call is fine there.
        The first, right after the open, is the status the open brought (its create's reply)."""
        opened, self.info.status = self.info.status, None
        raw: dict[str, Any] = opened if opened is not None else self.call("status", self._egress_mark)
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
        try:
            self.close_note = await self.acall("close", timeout_s=self.settings.snapshot_timeout_s + CALL_S)
        finally:
            for job in self._jobs.values():
                if not job.done.is_set():
                    job.end(JobStatus.LOST, notice=f"session {self.session_id} was closed")


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


def _node_lost(exc: BaseException, node_id: str) -> bool:
    """Whether the agent went away with its node (rather than alone: killed, or crashed)."""
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return True
    try:
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    except Exception:  # the cluster itself does not answer: nothing of it can be relied on
        return True
    return node_id not in alive
