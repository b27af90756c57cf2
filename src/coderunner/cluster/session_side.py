"""SessionSide: one session as its node agent serves it (agent.py): every call a front door makes of it.

The agent holds the node's one SessionManager; this holds what a session needs beyond its Session while
front doors call it: runs whose first answer has not left (cancel_run), the relay that asks a front
door's user about hosts (relay_asker.py), uploads staged in pieces, and its outbox (node_exports.py).
The agent routes each call `(session id, method, args)` to the session's side (agent.SESSION_CALLS).

A session's jobs are its own job calls (start_run, wait_job, read_job: sessions/job_updates.py), forwarded
as they are, each answer a JobUpdate in its wire form: nothing of a job is mirrored at the front door.
What a front door cannot ask for, the hosts the proxy asks its user about while a run or a guest call that
can ask goes, is the session's SessionNews in the agent's long poll (sessions/changes.py, the key its id),
published as it changes: a front door follows it there and answers (answer_egress) what it brings.

The kernel's ZMQ stays on ipc:// on this node: only these calls cross the network.

One idea: the node side of one session: every call a front door makes of it, as plain-data answers (wire.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Iterator
from dataclasses import asdict
from typing import Any

import anyio

from coderunner.cluster.node_exports import NodeOutbox
from coderunner.cluster.relay_asker import RelayAsker
from coderunner.cluster.remote_egress import delta_of
from coderunner.cluster.staged_uploads import StagedUploads
from coderunner.cluster.wire import (
    EgressDelta,
    ExportListing,
    NodeInfo,
    SessionInfo,
    SessionNews,
)
from coderunner.errors import CodeRunnerError, SessionError
from coderunner.hostfs.sandbox_files import Entry
from coderunner.sessions.changes import Changes
from coderunner.sessions.job_runner import JobStatus
from coderunner.sessions.job_updates import JobUpdate
from coderunner.sessions.manager import SessionManager
from coderunner.sessions.session import Session

#: Cancels remembered for runs not started yet (a front door cancelled before its start arrived).
MAX_CANCELLED_RUNS = 64
#: What SessionSide._asking holds while the start of a run that can ask has not answered (no job id yet).
ASKING_STARTS = "(starting)"


class SessionSide:
    """One open session of an agent's manager, and its calls' state on the node; its news published in `changes`."""

    def __init__(
        self, manager: SessionManager, session: Session, node: NodeInfo, transfer_limit: int, standby_after_reset: bool,
        changes: Changes,
    ) -> None:  # fmt: skip
        self.manager = manager
        self.session: Session | None = session
        self.session_id = session.session_id
        self.node = node
        self._standby_after_reset = standby_after_reset
        self._uploads = StagedUploads(transfer_limit)
        #: Runs' own waits (start_run, wait_job) that have not answered yet, by their caller's token (cancel_run).
        self._runs: dict[str, anyio.CancelScope] = {}
        self._cancelled_runs: set[str] = set()
        self._changes = changes
        #: Asking the user about hosts across the cluster: the job id of the run whose caller can be asked
        #: (ASKING_STARTS while its start has not answered), if any.
        self._relay = RelayAsker(self._publish)
        self._asking: str | None = None
        #: Guest calls (guest_op, install_packages) whose caller can be asked, by their call token.
        self._asking_calls: set[str] = set()
        #: The session's outbox, copied out by its front door (node_exports.py), not into this node's export_dir.
        self._outbox: NodeOutbox | None = None
        plan = session.sandbox_mounts
        if plan is not None and plan.exporter is not None:
            self._outbox, plan.exporter = NodeOutbox(plan.exporter.scan), None
        self._publish()  # the key exists from the start: a front door that follows it before any change waits

    # --- what a front door follows (SessionNews) --------------------------------------------------

    def _publish(self) -> None:
        if self.open:  # a session closed is dropped from the news (close; the agent's _forget_closed)
            self._changes.publish(self.session_id, SessionNews(self._relay.waiting()))

    @property
    def open(self) -> bool:
        """Until its close has finished (a close under way has taken it off the manager's list already)."""
        session = self.session
        return (
            session is not None
            and not session.closed
            and (session.close_done is None or not session.close_done.is_set())
        )

    def _session(self) -> Session:
        if self.session is None or self.session.closed:
            raise SessionError(f"unknown or expired session_id {self.session_id!r}")
        return self.session

    def info(self) -> SessionInfo:
        session = self._session()
        return SessionInfo(
            session_id=session.session_id, owner=session.owner, options=session.options, node=self.node,
            generation=session.generation, startup=session.startup, seeded=session.seeded,
            workspace_path=session.backend.workspace_path, egress=self.egress_delta(0),
        )  # fmt: skip

    # --- jobs: the session's own job calls (sessions/job_updates.py), each answer in its wire form ------

    async def start_run(
        self, code: str, timeout_s: float | None, variables: dict[str, Any] | None, owner: str, wait_s: float,
        egress_since: int | None = None, run_token: str | None = None, ask: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Start a cell and wait up to `wait_s` for it (a quick cell's whole answer comes back at once).
        `egress_since`: the caller's mark in this session's egress log (see egress_delta).
        `run_token`: the caller's name for this run, so that it can cancel it before this answers.
        `ask`: the caller's user can be asked about hosts while this run goes (relay_asker.py)."""
        session = self._session()
        if ask and session.egress is not None:
            self._asking = ASKING_STARTS
            session.egress.set_asker(self._relay)
        update = None
        try:
            update = await self._attended(run_token, session.start_run(code, timeout_s, variables, wait_s, owner=owner))
        finally:
            if update is None or not update.running:
                self._stop_asking(ASKING_STARTS)
        if update is None:
            update = JobUpdate("", status=JobStatus.INTERRUPTED.value, notice="cancelled before it answered")
        elif self._asking == ASKING_STARTS:
            self._asking = update.job_id
        return await self._answer(update, egress_since)

    async def wait_job(
        self, job_id: str, wait_s: float, egress_since: int | None = None, run_token: str | None = None
    ) -> dict[str, Any]:
        """The run's own further wait (`run_token`: as start_run's, to cancel it and with it the cell)."""
        update = await self._attended(run_token, self._session().wait_job(job_id, wait_s))
        if update is None:
            update = JobUpdate(job_id, status=JobStatus.INTERRUPTED.value, notice="cancelled while it waited")
        return await self._answer(update, egress_since)

    async def _attended(self, run_token: str | None, wait: Awaitable[JobUpdate]) -> JobUpdate | None:
        """A run's own wait (start_run, wait_job), which cancel_run(run_token) cancels as a cancelled caller's
        wait is cancelled here: the session then cancels the cell (None: it was)."""
        scope = anyio.CancelScope()
        if run_token is not None:
            self._runs[run_token] = scope
            if run_token in self._cancelled_runs:
                scope.cancel()
        try:
            with scope:
                return await wait
        finally:
            if run_token is not None:
                self._runs.pop(run_token, None)
                self._cancelled_runs.discard(run_token)
        return None

    async def read_job(
        self, job_id: str, wait_s: float = 0.0, take: bool = True, egress_since: int | None = None
    ) -> dict[str, Any]:
        return await self._answer(await self._session().read_job(job_id, wait_s, take), egress_since)

    async def _answer(self, update: JobUpdate, egress_since: int | None) -> dict[str, Any]:
        """An update as it crosses: its wire form, the proxy's decisions after the caller's mark, and at the
        job's end what its outbox holds for the front door to copy out."""
        exports = None
        if not update.running:
            self._stop_asking(update.job_id)
            exports = await self.export_changes()
        return {"update": update.wire(), "egress": self.egress_delta(egress_since), "exports": exports}

    def _stop_asking(self, job_id: str) -> None:
        """The run that could ask is over: its questions go unanswered (unless a guest call's caller can be asked)."""
        if self._asking != job_id:
            return
        self._asking = None
        session = self.session
        if not self._asking_calls:
            self._relay.give_up()
            if session is not None and session.egress is not None:
                session.egress.set_asker(None)

    async def cancel_run(self, run_token: str) -> None:
        """Cancel a run's own wait (start_run, wait_job) that has not answered (its caller was cancelled meanwhile),
        and with it the cell; a token not seen yet is remembered, so a wait that arrives after this is cancelled
        as it starts."""
        scope = self._runs.get(run_token)
        if scope is not None:
            scope.cancel()
        elif len(self._cancelled_runs) < MAX_CANCELLED_RUNS:
            self._cancelled_runs.add(run_token)

    async def answer_egress(self, question_id: str, allowed: bool | None) -> None:
        """The front door's answer to a question its read brought (None: nobody answered)."""
        self._relay.answer(question_id, allowed)

    async def cancel_job(self, job_id: str) -> None:
        await self._session().cancel_job(job_id)

    async def list_jobs(self) -> list[dict[str, Any]]:
        return await self._session().list_jobs()

    # --- the session ---------------------------------------------------------------------------

    async def reset(self) -> int:
        """A fresh kernel; from the first reset on, the session keeps a standby for the next (when the
        front door's reset_standby asks for one and the backend allows it: standby.py)."""
        session = self._session()
        await session.reset()
        if self._standby_after_reset and not session.standby.enabled and session.backend.private_files:
            session.standby.enabled = True
            session.keep_standby()
        return session.generation

    async def generation(self) -> int:
        return self._session().generation

    async def take_snapshot(self, name: str) -> Any:
        """A snapshot of the session in this node's store (its Taken record)."""
        return await self.manager.take_snapshot(self._session(), name)

    # --- the outbox, copied out by the front door (node_exports.py) ----------------------------

    async def export_changes(self) -> ExportListing | None:
        """What the outbox holds that the front door has not copied yet; None (one dir read) mostly."""
        outbox = self._outbox
        if outbox is None or outbox.empty():
            return None
        return await anyio.to_thread.run_sync(outbox.listing)

    async def read_export_piece(self, rel: str, ino: int, offset: int, size: int) -> bytes | None:
        outbox = self._outbox
        return None if outbox is None else await anyio.to_thread.run_sync(outbox.read_piece, rel, ino, offset, size)

    async def forget_exports(self, rels: list[str]) -> None:
        if self._outbox is not None:
            self._outbox.forget(rels)

    async def guest_op(
        self, tool: str, op: str, args: dict[str, Any], timeout_s: float, paths: list[str], input_path: str | None,
        egress_since: int | None = None, ask_token: str | None = None,
    ) -> tuple[dict[str, Any], EgressDelta | None, ExportListing | None]:  # fmt: skip
        """`ask_token`: the caller's user can be asked about hosts while this goes (its questions in the news).
        Its answer, the proxy's decisions and what it left in the outbox."""
        session = self._session()
        try:
            with self._asking_during(session, ask_token):
                done = await session.guest_op(tool, op, args, timeout_s, paths=paths, input_path=input_path)
        except CodeRunnerError as exc:  # the denials that made it fail still reach the caller's reply
            exc.egress = self.egress_delta(egress_since)  # type: ignore[attr-defined]
            raise
        return done, self.egress_delta(egress_since), await self.export_changes()

    async def install_packages(
        self, packages: list[str], timeout_s: float, egress_since: int | None = None, ask_token: str | None = None
    ) -> tuple[dict[str, Any], EgressDelta | None, ExportListing | None]:
        session = self._session()
        try:
            with self._asking_during(session, ask_token):
                done = await session.install_packages(packages, timeout_s)
        except CodeRunnerError as exc:
            exc.egress = self.egress_delta(egress_since)  # type: ignore[attr-defined]
            raise
        return done, self.egress_delta(egress_since), await self.export_changes()

    @contextlib.contextmanager
    def _asking_during(self, session: Session, ask_token: str | None) -> Iterator[None]:
        """While a guest call whose caller can be asked goes, the proxy asks the relay (its questions reach
        the front door in the session's news, as a run's do)."""
        if ask_token is None or session.egress is None:
            yield
            return
        self._asking_calls.add(ask_token)
        session.egress.set_asker(self._relay)
        try:
            yield
        finally:
            self._asking_calls.discard(ask_token)
            if not self._asking_calls and self._asking is None:  # nobody left to answer what still waits
                self._relay.give_up()
                session.egress.set_asker(None)

    async def status(self, egress_since: int | None = None) -> dict[str, Any]:
        session = self._session()
        status = await session.status()
        return {**asdict(status), "node": self.node.node_id, "node_address": self.node.address,
                "egress": self.egress_delta(egress_since)}  # fmt: skip

    def egress_delta(self, since: int | None) -> EgressDelta | None:
        """The session's allowlist proxy after the caller's mark `since` (None: not asked; or no proxy)."""
        session = self.session
        egress = session.egress if session is not None else None
        if since is None or egress is None:
            return None
        return delta_of(egress, since)

    async def close(self) -> str | None:
        """Close the session (its kernel, sandbox and workspace); the agent then forgets this side."""
        session = self._session()
        try:
            await self.manager.close(session.session_id)
        finally:
            self._changes.drop(self.session_id)
        return session.close_note

    # --- files (each call resolves its path again on the node, never following a link) ----------

    async def list_files(self, path: str, depth: int) -> list[Entry]:
        return await anyio.to_thread.run_sync(self._session().files.list, path, depth)

    async def read_piece(self, path: str, offset: int, size: int) -> tuple[bytes, int, str]:
        files = self._session().files
        return await anyio.to_thread.run_sync(lambda: files.read(path, offset=offset, limit=size))

    async def stage_piece(self, upload_id: str, data: bytes) -> str:
        """Add a piece to an upload (a memfd on this node, never a path); '' starts a new one."""
        return await self._uploads.stage(upload_id, data)

    async def commit_upload(self, upload_id: str, path: str, overwrite: bool) -> str:
        """Write a staged upload to `path` in the session's files; returns its sandbox path."""
        return await self._uploads.commit(upload_id, self._session().files, path, overwrite)
