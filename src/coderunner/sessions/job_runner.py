"""Jobs: work that outlives the tool call that started it.

MCP clients give up on a call at their own timeout (60 s in the TypeScript SDK, 5 s in
openai-agents). So a cell runs as a job, a task in a task group its owner holds (the session's,
or the manager's for one-shot runs), not in the request: the call waits for it up to
`detach_after_s`, then answers with what it has and the job's id, and the job goes on.
manage_jobs `wait` reads what is new since the last read (a cursor per job); `cancel` cancels the
job's own scope, which the kernel answers by interrupting the cell (and the session by
restarting a kernel that ignores that).

Everything is bounded: one running python job per session (its kernel has one cell at a time),
a few finished jobs kept per table, and per job at most `limit_chars` of unread text in memory
(the whole output goes to the spill file, as for any call).
"""

from __future__ import annotations

import collections
import enum
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup

from coderunner.edge.callers import client_of_key
from coderunner.errors import CodeRunnerError, SessionError
from coderunner.kernel.output_capture import OutputCollector, strip_ansi

log = logging.getLogger(__name__)

#: Finished jobs a table keeps for manage_jobs wait; the oldest finished one goes first.
MAX_KEPT_JOBS = 16
#: Bound on waiting for a cancelled job to end (its kernel may need a restart after the grace).
CANCEL_MARGIN_S = 10.0
#: Characters of the code a job is labelled with in manage_jobs list and busy messages.
LABEL_CHARS = 60


class JobStatus(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    ERROR = "error"
    INTERRUPTED = "interrupted"
    LOST = "lost"


class JobNotFound(SessionError):
    """No job of this caller has that id."""


def text_bytes(pieces: Iterable[str]) -> bytes:
    """Text as the spill file holds it (OutputCollector._spill encodes it so)."""
    return "".join(pieces).encode("utf-8", "replace")


def duration(seconds: float) -> str:
    """3m12s, 1h04m, 7s: how long a job has run, for a model to read."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


@dataclass
class JobOutput(OutputCollector):
    """A call's output collector that also keeps what no reply has shown yet (bounded), for manage_jobs wait.

    The base keeps head and tail for the whole run and spills everything to a file; this adds a
    window of unread text (its last `limit_chars`; what falls out of it is in the spill file) and
    read cursors over the images.
    """

    _unread: collections.deque[str] = field(default_factory=collections.deque)
    _unread_chars: int = 0
    #: Unread characters dropped from the window since the last read, and their UTF-8 bytes.
    _skipped: int = 0
    _skipped_bytes: int = 0
    #: UTF-8 bytes of the text before the unread window (shown or skipped): where it starts in the spill file.
    _read_bytes: int = 0
    _images_read: int = 0
    _saved_read: int = 0
    _spill_linked: bool = False
    #: Told of each change a reader would see (text, an image, the cell's start; True: its end), on the event
    #: loop: a cluster node publishes its jobs' progress by it (cluster/session_side.py).
    on_change: Callable[[bool], None] | None = None

    def note_change(self, ended: bool = False) -> None:
        if self.on_change is not None:
            self.on_change(ended)

    def add_text(self, text: str) -> None:
        super().add_text(text)
        text = strip_ansi(text)
        if not text:
            return
        self.note_change()
        self._unread.append(text)
        self._unread_chars += len(text)
        while self._unread_chars > self.limit_chars:
            extra = self._unread_chars - self.limit_chars
            first = self._unread[0]
            if len(first) <= extra:
                self._unread.popleft()
                cut = first
            else:
                self._unread[0] = first[extra:]
                cut = first[:extra]
            self._unread_chars -= len(cut)
            self._skipped += len(cut)
            self._skipped_bytes += len(text_bytes([cut]))

    def add_image(self, mime_type: str, data_b64: str) -> None:
        super().add_image(mime_type, data_b64)
        self.note_change()

    def close(self) -> None:
        """The job ended (JobTable._drive closes its output right before it sets `done`)."""
        super().close()
        self.note_change(ended=True)

    def take(self) -> JobRead:
        """What is new since the last take, and move the cursors past it."""
        text = "".join(self._unread)
        if self._skipped:
            where = self.spill_path or (f"not saved: {self.spill_error}" if self.spill_error else "not saved")
            if self.spill_path and not self.spill_error:  # the file holds all: they begin where the last read ended
                where += f" (read_file offset={self._read_bytes} for them)"
            text = f"[... {self._skipped:,} characters not shown here; full output: {where}]\n" + text
        images = self.images[self._images_read :]
        saved = self.saved_images[self._saved_read :]
        new_spill = self.spill_path if self.spill_path and not self._spill_linked else None
        self._read_bytes += self._skipped_bytes + len(text_bytes(self._unread))
        self._unread.clear()
        self._unread_chars = self._skipped = self._skipped_bytes = 0
        self._images_read = len(self.images)
        self._saved_read = len(self.saved_images)
        self._spill_linked = self._spill_linked or new_spill is not None
        return JobRead(text=text, images=images, saved=saved, spill_path=new_spill)

    def release_images(self) -> None:
        """A finished job whose images were all read: their bytes need not stay in memory."""
        if self._images_read == len(self.images):
            self.images = []
            self._images_read = 0


@dataclass
class JobRead:
    """What one read of a job returns: text and images new since the previous read."""

    text: str
    images: list[Any]
    saved: list[str]
    spill_path: str | None


@dataclass
class Job:
    job_id: str
    #: "python" (a cell in a session's kernel) or "execute_code" (a one-shot run).
    kind: str
    label: str
    #: The caller that started it (callers.py): only its client may read or cancel it.
    owner: str
    session_id: str | None = None
    output: JobOutput | None = None
    started_at: float = field(default_factory=time.monotonic)
    ended_at: float | None = None
    status: JobStatus = JobStatus.RUNNING
    #: What the work returned (an ExecutionResult or a OneShotResult), once it ended by itself.
    result: Any = None
    #: Set by the work or the table when it ended otherwise (cancelled, failed), or to add a word.
    notice: str | None = None
    state_lost: bool = False
    #: A refusal the work raised before it ran (closed, busy behind another call): its caller is told.
    failure: CodeRunnerError | None = None
    #: The kernel generation it ran in (python jobs), to tell whether state survived it.
    generation: int | None = None
    #: When its code was sent to run (None: still waiting for the kernel): progress starts from there,
    #: so a client that stops a call at its first progress note stops a cell that is running.
    executing_since: float | None = None
    #: True once a call answered without its result: a cancelled caller no longer cancels it.
    detached: bool = False
    cancel_requested: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    def elapsed_s(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started_at

    def cancel(self) -> None:
        self.cancel_requested = True
        self.scope.cancel()

    def describe(self) -> dict[str, Any]:
        """The job as manage_jobs list and manage_sessions status show it."""
        described: dict[str, Any] = {
            "job_id": self.job_id,
            "kind": self.kind,
            "status": self.status.value,
            "elapsed_s": round(self.elapsed_s(), 1),
            "code": self.label,
        }
        if self.session_id is not None:
            described["session_id"] = self.session_id
        return described


def label_of(code: str) -> str:
    first = code.strip().splitlines()[0] if code.strip() else ""
    return first if len(first) <= LABEL_CHARS else first[: LABEL_CHARS - 1] + "…"


@dataclass
class JobTable:
    """The jobs of one owner (a session, or the manager's one-shot runs), run in its task group."""

    task_group: TaskGroup
    max_kept: int = MAX_KEPT_JOBS
    jobs: dict[str, Job] = field(default_factory=dict)

    def running(self, kind: str | None = None) -> Job | None:
        return next((job for job in self.jobs.values() if job.running and kind in (None, job.kind)), None)

    def running_of(self, owner: str) -> int:
        """How many jobs the client of caller `owner` has running here."""
        client = client_of_key(owner)
        return sum(job.running and client_of_key(job.owner) == client for job in self.jobs.values())

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def start(self, job: Job, work: Callable[[Job], Awaitable[Any]], status_of: Callable[[Job], JobStatus]) -> Job:
        """Register `job` (at once: a second caller sees it before anything awaits) and run `work`."""
        self._trim(client_of_key(job.owner))
        self.jobs[job.job_id] = job
        self.task_group.start_soon(self._drive, job, work, status_of, name=f"job {job.job_id}")
        return job

    def new_id(self) -> str:
        while True:
            job_id = f"job-{secrets.token_hex(3)}"
            if job_id not in self.jobs:
                return job_id

    async def _drive(
        self, job: Job, work: Callable[[Job], Awaitable[Any]], status_of: Callable[[Job], JobStatus]
    ) -> None:
        """Run the work in the job's own scope; whatever happens, end the job and wake its waiters."""
        try:
            with job.scope:
                job.result = await work(job)
            if job.scope.cancelled_caught or job.result is None:
                job.status = JobStatus.INTERRUPTED if job.cancel_requested else JobStatus.LOST
                job.notice = job.notice or "cancelled"
            else:
                job.status = status_of(job)
        except Exception as exc:  # a job must never take its owner's task group down with it
            if isinstance(exc, CodeRunnerError):  # said for the caller (a session's, a one-shot's refusal)
                job.failure = exc
                job.notice = str(exc)
            else:
                log.exception("job %s failed", job.job_id)
                job.notice = f"the job failed in the server: {type(exc).__name__}"
            job.status = JobStatus.LOST
        finally:
            job.ended_at = time.monotonic()
            if job.output is not None:
                job.output.close()
            job.done.set()

    def forget(self, job: Job) -> None:
        self.jobs.pop(job.job_id, None)

    def _trim(self, client: str) -> None:
        """Keep `client`'s last finished jobs (per client: one client's runs never push out another's)."""
        finished = [job for job in self.jobs.values() if not job.running and client_of_key(job.owner) == client]
        for job in finished[: max(0, len(finished) - self.max_kept + 1)]:
            del self.jobs[job.job_id]

    def cancel_all(self, notice: str) -> None:
        """End every running job (its owner is going away); waiters are told `notice`."""
        for job in self.jobs.values():
            if job.running:
                job.notice = job.notice or notice
                job.cancel()


async def attend(
    job: Job,
    wait_s: float | None,
    tick: Callable[[Job], Awaitable[None]] | None = None,
    interval_s: float = 1.0,
    cancel_wait_s: float = CANCEL_MARGIN_S,
) -> bool:
    """Wait for `job` up to `wait_s` (None: to its end), calling `tick` every `interval_s`; True if it ended.

    A caller cancelled while the job is still attached to it (not yet detached) cancels the job, as a
    cancelled run_python has always interrupted its cell; a detached job goes on.
    """
    deadline = None if wait_s is None else time.monotonic() + wait_s
    try:
        while not job.done.is_set():
            step = interval_s if tick is not None else float("inf")
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                step = min(step, remaining)
            with anyio.move_on_after(step):
                await job.done.wait()
            if not job.done.is_set() and tick is not None:
                await tick(job)
    except anyio.get_cancelled_exc_class():
        if not job.detached:
            job.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(cancel_wait_s):
                await job.done.wait()
        raise
    return True


async def cancel(job: Job, wait_s: float) -> bool:
    """Cancel `job` and wait (bounded) for it to end; True if it did."""
    if job.running:
        job.cancel()
    with anyio.move_on_after(wait_s):
        await job.done.wait()
    return job.done.is_set()
