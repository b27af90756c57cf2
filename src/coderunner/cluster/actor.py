"""SessionActor: one session on one node, as a detached named Ray actor.

The actor runs an ordinary SessionManager on its node (the node's own backend, dirs, uid pool and
egress proxy) holding exactly one session, and answers the front doors' calls with plain data
(wire.py). The kernel's ZMQ stays on ipc:// on this node: only these actor calls cross the network.

The manager lives in one task of its own (`_hold`), as anyio's task groups need: entered and left
in the same task. When its session closes (a close by manage_sessions, or the manager's idle reaper) the actor
ends itself, so nothing is left on the node.

One idea: the node side of one session: every call a front door makes of it, as the methods of one actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from typing import Any

import anyio

from coderunner.cluster.node_exports import NodeOutbox
from coderunner.cluster.pool_key import pool_key
from coderunner.cluster.relay_asker import RelayAsker
from coderunner.cluster.remote_egress import delta_of
from coderunner.cluster.staged_uploads import StagedUploads
from coderunner.cluster.wire import (
    NODE_LOCAL,
    EgressDelta,
    ExportListing,
    JobDelta,
    NodeInfo,
    Question,
    SessionInfo,
    portable_result,
)
from coderunner.config import Settings, load_settings
from coderunner.errors import CodeRunnerError, SessionError
from coderunner.hostfs.sandbox_files import Entry
from coderunner.sandbox import make_backend
from coderunner.sessions.job_runner import Job
from coderunner.sessions.manager import SessionManager
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.sessions.session import Session

log = logging.getLogger(__name__)

#: How often the actor checks whether its session is still open (reaped sessions end their actor).
WATCH_INTERVAL_S = 2.0
#: After a session close, how long the actor waits for its front door to kill it before it ends itself.
KILL_BACKUP_S = 10.0
#: Cancels remembered for runs not started yet (a front door cancelled before its start arrived).
MAX_CANCELLED_RUNS = 64
#: How often a read of a guest call's questions looks whether that call has begun here yet.
CALL_START_POLL_S = 0.05


class SessionActor:
    """Ray wraps this class (`ray.remote`) in the front door; it holds no Ray import of its own.

    `pooled`: started ahead by a node's pool (node_pool.py): its manager keeps one warm sandbox
    (its own warm pool of one, for the default options) until a create claims the actor and opens
    its session from that sandbox. Its max_sessions of one stops the pool refilling after that. It
    keeps the settings it was started with: it opens only with their key (pool_key.py).
    """

    def __init__(self, settings: dict[str, Any], session_id: str, pooled: bool = False) -> None:
        pool_size = 1 if pooled else 0
        # The standby kernel waits for the session's first reset (see reset): a burst of creates then
        # starts one kernel per session, not two, and a session never reset holds one.
        self.settings = node_settings(settings, pool_size=pool_size, max_sessions=1, reset_standby=False)
        self._standby_after_reset = bool(settings.get("reset_standby", True))
        self.session_id = session_id
        self.pool_key = pool_key(settings) if pooled else None
        self.manager: SessionManager | None = None
        self.session: Session | None = None
        self._entered = asyncio.Event()
        self._opened = asyncio.Event()
        self._opening = False
        self._closed_by_call = False
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        self._main: asyncio.Task[None] | None = None
        self._uploads = StagedUploads(self.settings.transfer_limit_bytes)
        #: Runs whose start_run has not answered yet, by their caller's token (cancel_run).
        self._runs: dict[str, Job] = {}
        self._cancelled_runs: set[str] = set()
        #: Asking the user about hosts across the cluster: the run whose caller can be asked, if any.
        self._relay = RelayAsker()
        self._asking: Job | None = None
        #: Guest calls (guest_op, install_packages) whose caller can be asked: call token -> set at its end.
        self._asking_calls: dict[str, anyio.Event] = {}
        #: The session's outbox, copied out by its front door (node_exports.py), not into this node's export_dir.
        self._outbox: NodeOutbox | None = None
        self.node = _this_node()

    async def _manager(self) -> SessionManager:
        """The node's manager for this actor, entered in a task of its own on first use."""
        if self._main is None:
            self._main = asyncio.get_running_loop().create_task(self._hold())
        await self._entered.wait()
        if self.manager is None:
            why = str(self._failure) if isinstance(self._failure, CodeRunnerError) else repr(self._failure)
            raise SessionError(f"the session could not start on node {self.node.label}: {why}")
        return self.manager

    async def prestart(self, wait_s: float) -> bool:
        """Pooled: start the manager and wait (bounded) until its warm sandbox is ready."""
        manager = await self._manager()
        with anyio.move_on_after(wait_s):
            while manager.pool.held < 1:
                await anyio.sleep(0.05)
        return manager.pool.held >= 1

    async def open(self, options: SandboxOptions, owner: str, seed: Any = None, key: str | None = None) -> SessionInfo:
        """Create the session (from the warm sandbox when pooled and `options` are the defaults);
        its id is the actor's name. A second open is refused: a pooled actor is claimed once, by a
        front door whose settings' `key` is its own (refused, it ends, as after any failed open)."""
        manager = await self._manager()
        if self._opening:
            raise SessionError("this session actor is already taken")
        self._opening = True
        try:
            if self.pool_key is not None and key != self.pool_key:
                raise SessionError("this pooled session was started with other settings than this front door's")
            self.session = await manager.create(options, owner=owner, seed=seed, session_id=self.session_id)
        except CodeRunnerError as exc:
            self._stop.set()
            raise SessionError(str(exc)) from None
        except BaseException:
            self._stop.set()
            raise
        finally:
            self._opened.set()
        plan = self.session.sandbox_mounts
        if plan is not None and plan.exporter is not None:
            self._outbox, plan.exporter = NodeOutbox(plan.exporter.scan), None
        info = self.info()
        info.status = await self.status()  # the create's reply shows it: one actor call fewer
        return info

    async def _hold(self) -> None:
        try:
            backend = make_backend(self.settings)
            async with SessionManager(self.settings, backend) as manager:
                self.manager = manager
                self._entered.set()
                await self._opened.wait()
                while not self._stop.is_set() and self._still_open():
                    with anyio.move_on_after(WATCH_INTERVAL_S):
                        await self._stop.wait()
        except BaseException as exc:
            self._failure = self._failure or exc
            raise
        finally:
            self._entered.set()
            self._end_soon()

    def _still_open(self) -> bool:
        """Until its close has finished (a close under way has taken it off the list already)."""
        session = self.session
        return session is not None and (session.close_done is None or not session.close_done.is_set())

    def _end_soon(self) -> None:
        """The session is gone: end this process. Closed by a front door, which kills the actor once
        the reply to close has left (an intended exit, as Ray sees it), this only backs that up;
        reaped idle, nobody else will end it."""
        delay = KILL_BACKUP_S if self._closed_by_call else 0.2
        asyncio.get_running_loop().call_later(delay, os._exit, 0)

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

    async def ping(self) -> str:
        return self.node.node_id

    # --- jobs -----------------------------------------------------------------------------------

    async def start_run(
        self, code: str, timeout_s: float | None, variables: dict[str, Any] | None, owner: str, wait_s: float,
        egress_since: int | None = None, run_token: str | None = None, ask: bool = False,
    ) -> JobDelta:  # fmt: skip
        """Start a cell and wait up to `wait_s` for it: a quick cell's whole answer comes back at once,
        and its job is dropped here (the front door has all of it; one call fewer per run).
        `egress_since`: the caller's mark in this session's egress log (see egress_delta).
        `run_token`: the caller's name for this run, so that it can cancel it before this answers.
        `ask`: the caller's user can be asked about hosts while this run goes (relay_asker.py)."""
        session = self._session()
        job = await session.start_run(code, timeout_s, variables, owner=owner)
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
        return delta

    async def read_job(self, job_id: str, wait_s: float, egress_since: int | None = None) -> JobDelta:
        job = self._session().job(job_id)
        if job is None:
            return JobDelta(job_id, gone=True, ended=True, status="lost", notice="the job is no longer known")
        return await self._delta(job, wait_s, egress_since)

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

    async def list_jobs(self) -> list[dict[str, Any]]:
        return [job.describe() for job in self._session().list_jobs()]

    async def _delta(self, job: Job, wait_s: float, egress_since: int | None = None) -> JobDelta:
        """Wait up to `wait_s` for the job to end, then say what is new (its end and result, if it ended)."""
        asking = self._asking is job
        if wait_s > 0 and job.running:
            with anyio.move_on_after(wait_s):
                if asking:
                    await _first_of(job.done.wait, self._relay.asked.wait)  # a question goes out at once
                else:
                    await job.done.wait()
        session = self._session()
        assert job.output is not None
        read = job.output.take()
        since = job.executing_since
        delta = JobDelta(
            job.job_id, text=read.text, images=read.images, saved=read.saved, spill_path=read.spill_path,
            executing_for_s=None if since is None else time.monotonic() - since, elapsed_s=job.elapsed_s(),
            generation=session.generation, dropped_images=job.output.dropped_images,
            egress=self.egress_delta(egress_since), questions=self._relay.take() if asking else [],
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
        assert self.manager is not None
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
        """`ask_token`: the caller's user can be asked about hosts while this goes (read_questions).
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
        """A guest call is one actor call, with no reads to carry questions: while it goes, the proxy asks
        the relay, and the caller reads the questions with read_questions (the run's channel otherwise)."""
        if ask_token is None or session.egress is None:
            yield
            return
        ended = self._asking_calls[ask_token] = anyio.Event()
        session.egress.set_asker(self._relay)
        try:
            yield
        finally:
            ended.set()
            del self._asking_calls[ask_token]
            if not self._asking_calls and self._asking is None:  # nobody left to answer what still waits
                self._relay.give_up()
                session.egress.set_asker(None)

    async def read_questions(self, ask_token: str, wait_s: float) -> list[Question]:
        """The questions the proxy asks while the guest call `ask_token` goes, as soon as there is one (up to
        `wait_s`); none once that call is over. The call may not have begun here yet: Ray may start this first."""
        with anyio.move_on_after(wait_s):
            while ask_token not in self._asking_calls:
                await anyio.sleep(CALL_START_POLL_S)
            await _first_of(self._relay.asked.wait, self._asking_calls[ask_token].wait)
        return self._relay.take() if ask_token in self._asking_calls else []

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
        """Close the session (its kernel, sandbox and workspace); the front door then kills the actor."""
        session = self._session()
        assert self.manager is not None
        self._closed_by_call = True
        await self.manager.close(session.session_id)
        self._stop.set()
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


async def _first_of(*waits: Callable[[], Awaitable[Any]]) -> None:
    """Return as soon as one of `waits` returns."""
    async with anyio.create_task_group() as group:

        async def one(wait: Callable[[], Awaitable[Any]]) -> None:
            await wait()
            group.cancel_scope.cancel()

        for wait in waits:
            group.start_soon(one, wait)


def _this_node() -> NodeInfo:
    import ray  # imported here: the class itself must load where ray is absent (a front door's checks)

    return NodeInfo(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def node_settings(sent: dict[str, Any], **fixed: Any) -> Settings:
    """The front door's settings with this node's own NODE_LOCAL ones (its disks, its sandbox environment)."""
    local = load_settings()
    mine = {name: getattr(local, name) for name in NODE_LOCAL}
    if sent.get("export_dir") is None:  # no export folder at the front door: no outbox in its sandboxes
        mine["export_dir"] = None
    return Settings.model_validate({**sent, **mine, **fixed, "ray_address": None})
