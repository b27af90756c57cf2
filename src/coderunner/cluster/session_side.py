"""SessionSide: one session as its node agent serves it (agent.py): every call a front door makes of it.

The agent holds the node's one SessionManager; this holds what a session needs beyond its Session while
front doors call it: runs whose first answer has not left (cancel_run), the relay that asks a front
door's user about hosts (relay_asker.py), uploads staged in pieces, and its outbox (node_exports.py).
The agent routes each call `(session id, method, args)` to the session's side (agent.SESSION_CALLS).

What a front door waits for (a running job's progress and end, a host the proxy asks about) is the
session's SessionNews in the agent's long poll (sessions/changes.py, the key its id), published as it
changes: a front door follows it there and calls (read_job, answer_egress) only when it changed.

The kernel's ZMQ stays on ipc:// on this node: only these calls cross the network.

One idea: the node side of one session: every call a front door makes of it, as plain-data answers (wire.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Iterator
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
    JobDelta,
    NodeInfo,
    SessionInfo,
    SessionNews,
    portable_result,
)
from coderunner.errors import CodeRunnerError, SessionError
from coderunner.hostfs.sandbox_files import Entry
from coderunner.sessions.changes import Changes
from coderunner.sessions.job_runner import Job
from coderunner.sessions.manager import SessionManager
from coderunner.sessions.session import Session

#: Cancels remembered for runs not started yet (a front door cancelled before its start arrived).
MAX_CANCELLED_RUNS = 64
#: A running job's output is published at most this often (its end, and a question, at once): a cell that
#: prints all the time costs a front door a few reads a second, not one per line.
PUBLISH_GAP_S = 0.25


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
        #: Runs whose start_run has not answered yet, by their caller's token (cancel_run).
        self._runs: dict[str, Job] = {}
        self._cancelled_runs: set[str] = set()
        self._changes = changes
        #: Each job this node holds for the session: its change count (SessionNews.jobs).
        self._job_marks: dict[str, int] = {}
        self._published_at = 0.0
        self._publish_later: asyncio.TimerHandle | None = None
        #: Asking the user about hosts across the cluster: the run whose caller can be asked, if any.
        self._relay = RelayAsker(self._publish)
        self._asking: Job | None = None
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
        if self._publish_later is not None:
            self._publish_later.cancel()
            self._publish_later = None
        if self.open:  # a session closed is dropped from the news (close; the agent's _forget_closed)
            self._changes.publish(self.session_id, SessionNews(dict(self._job_marks), self._relay.waiting()))
            self._published_at = time.monotonic()

    def _follow(self, job: Job) -> None:
        """Publish each change of `job` a reader would see, until it is forgotten here."""
        self._job_marks[job.job_id] = 0
        assert job.output is not None
        job.output.on_change = functools.partial(self._job_changed, job.job_id)
        self._publish()

    def _job_changed(self, job_id: str, ended: bool) -> None:
        """Count the change; publish it now if it is the job's end or none went out for PUBLISH_GAP_S, else then."""
        if job_id not in self._job_marks:
            return
        self._job_marks[job_id] += 1
        due_in = self._published_at + PUBLISH_GAP_S - time.monotonic()
        if ended or due_in <= 0:
            self._publish()
        elif self._publish_later is None:
            self._publish_later = asyncio.get_running_loop().call_later(due_in, self._publish)

    def _unfollow(self, job: Job) -> None:
        if self._job_marks.pop(job.job_id, None) is not None:
            self._publish()

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

    # --- jobs -----------------------------------------------------------------------------------

    async def start_run(
        self, code: str, timeout_s: float | None, variables: dict[str, Any] | None, owner: str, wait_s: float,
        egress_since: int | None = None, run_token: str | None = None, ask: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Start a cell and wait up to `wait_s` for it: a quick cell's whole answer comes back at once,
        and its job is dropped here (the front door has all of it; one call fewer per run). The answer
        is a JobDelta in its wire form (wire.py).
        `egress_since`: the caller's mark in this session's egress log (see egress_delta).
        `run_token`: the caller's name for this run, so that it can cancel it before this answers.
        `ask`: the caller's user can be asked about hosts while this run goes (relay_asker.py)."""
        session = self._session()
        job = await session.start_run(code, timeout_s, variables, owner=owner)
        self._follow(job)
        if ask and session.egress is not None:
            self._asking = job
            session.egress.set_asker(self._relay)
        if run_token is not None:
            self._runs[run_token] = job
            if run_token in self._cancelled_runs:
                await session.cancel_job(job)
        try:
            delta = await self._delta(job, wait_s, egress_since)
        finally:
            if run_token is not None:
                self._runs.pop(run_token, None)
                self._cancelled_runs.discard(run_token)
        if delta.ended:
            session.forget_job(job)
            self._unfollow(job)
        return delta.wire()

    async def read_job(self, job_id: str, egress_since: int | None = None) -> dict[str, Any]:
        """What is new in the job (a front door reads when its SessionNews count grew past its last read's),
        as a JobDelta's wire form."""
        job = self._session().job(job_id)
        if job is None:
            return JobDelta(job_id, gone=True, ended=True, status="lost", notice="the job is no longer known").wire()
        return (await self._delta(job, 0.0, egress_since)).wire()

    async def cancel_run(self, run_token: str) -> None:
        """Cancel a run whose start_run has not answered (its caller was cancelled meanwhile); a token
        not seen yet is remembered, so a start that arrives after this is cancelled as it starts."""
        job = self._runs.get(run_token)
        if job is None:
            if len(self._cancelled_runs) < MAX_CANCELLED_RUNS:
                self._cancelled_runs.add(run_token)
            return
        await self._session().cancel_job(job)

    async def answer_egress(self, question_id: str, allowed: bool | None) -> None:
        """The front door's answer to a question its read brought (None: nobody answered)."""
        self._relay.answer(question_id, allowed)

    async def cancel_job(self, job_id: str) -> None:
        session = self._session()
        job = session.job(job_id)
        if job is not None:
            await session.cancel_job(job)

    async def forget_job(self, job_id: str) -> None:
        session = self._session()
        job = session.job(job_id)
        if job is not None:
            session.forget_job(job)
            self._unfollow(job)

    async def list_jobs(self) -> list[dict[str, Any]]:
        return [job.describe() for job in self._session().list_jobs()]

    async def _delta(self, job: Job, wait_s: float, egress_since: int | None = None) -> JobDelta:
        """Wait up to `wait_s` for the job to end, then say what is new (its end and result, if it ended)."""
        asking = self._asking is job
        if wait_s > 0 and job.running:
            with anyio.move_on_after(wait_s):
                await job.done.wait()
        session = self._session()
        assert job.output is not None
        read = job.output.take()
        since = job.executing_since
        delta = JobDelta(
            job.job_id, text=read.text, images=read.images, saved=read.saved, spill_path=read.spill_path,
            executing_for_s=None if since is None else time.monotonic() - since, elapsed_s=job.elapsed_s(),
            generation=session.generation, dropped_images=job.output.dropped_images,
            egress=self.egress_delta(egress_since), mark=self._job_marks.get(job.job_id, 0),
        )  # fmt: skip
        if asking and not job.running:  # the run that could ask is over: its questions go unanswered
            self._asking = None
            if not self._asking_calls:  # nor can a guest call's caller be asked now
                self._relay.give_up()
                if session.egress is not None:
                    session.egress.set_asker(None)
        if not job.running:
            delta.ended, delta.status, delta.notice, delta.state_lost = (
                True,
                job.status.value,
                job.notice,
                job.state_lost,
            )
            try:
                delta.result = portable_result(session.job_result(job))
            except CodeRunnerError as exc:
                delta.failure = str(exc)
            delta.exports = await self.export_changes()
        return delta

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
        status = await anyio.to_thread.run_sync(session.status)
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
            if self._publish_later is not None:
                self._publish_later.cancel()
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
