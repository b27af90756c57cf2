"""JobUpdate: a session's job as one call found it, in plain data: every job call of the seam answers one.

The tools never hold a session's live Job (its events, its output's files): they start a cell and then ask
about it by its id (sessions/seam.py), and each answer is a JobUpdate, the same value whether the session
lives in this process (session.py) or in a node agent (cluster/session_side.py sends it in its wire form:
dicts and lists that Ray packs as they are, where a dataclass is pickled each time). So the cluster
forwards job calls and mirrors no job (issue 40: one protocol, two transports).

Two kinds of wait, because a job has two kinds of reader:
- `start_run` and `wait_job` are the run's own call waiting for its end. A job that ended comes whole (its
  result) and is forgotten: that caller was answered with all of it. Cancelling that call cancels the cell,
  as a cancelled run_python always has.
- `read_job` is a later reader (manage_jobs wait, a run that answered with a job id): it takes what is new
  since the last read, and the job is detached from then on: cancelling a reader leaves it running, and
  another run is told at once that the session is busy with it.

One idea: what a job is to a reader in another process, and how a job here becomes that.
"""

from __future__ import annotations

import collections
import copy
import time
from dataclasses import dataclass, field, fields
from typing import Any

from coderunner.errors import CodeRunnerError
from coderunner.kernel.execution import CellError, RunOutcome, RunStatus
from coderunner.kernel.output_capture import ImageOutput, OutputCollector
from coderunner.kernel.run_result import ExecutionResult
from coderunner.sessions.job_runner import Job, JobOutput, JobStatus, duration

#: Characters of a running job's latest output an update carries, for a progress note.
TAIL_CHARS = 200


@dataclass
class JobUpdate:
    """Where a job stands; what is new in it (a read only); its result once it ended."""

    job_id: str
    status: str = JobStatus.RUNNING.value
    elapsed_s: float = 0.0
    #: Seconds since its code was sent to the kernel (None: still waiting for the kernel).
    executing_for_s: float | None = None
    #: The kernel generation it runs in (the session's, while it waits for its kernel).
    generation: int = 0
    #: The last TAIL_CHARS of its output, for a progress note.
    tail: str = ""
    #: A read's text, images and saved image paths new since the previous read, and the spill file once known.
    text: str = ""
    images: list[ImageOutput] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    spill_path: str | None = None
    dropped_images: int = 0
    #: Once it ended: its result (None for a job that never ran: see failure), a word on how it ended.
    result: ExecutionResult | None = None
    notice: str | None = None
    state_lost: bool = False
    #: A refusal it met before it ran (the session closed, busy behind another call), as its caller reads it.
    failure: str | None = None
    #: The session does not hold it (forgotten, or never its).
    gone: bool = False

    @property
    def running(self) -> bool:
        return self.status == JobStatus.RUNNING.value

    def wire(self) -> dict[str, Any]:
        """This update as dicts, lists, strings and numbers; `of_wire` makes it again."""
        data = {item.name: getattr(self, item.name) for item in fields(self)}
        data["images"] = _plain_images(self.images)
        data["result"] = None if self.result is None else _plain_result(self.result)
        return data

    @classmethod
    def of_wire(cls, data: dict[str, Any]) -> JobUpdate:
        values = dict(data)
        values["images"] = _images(values["images"])
        values["result"] = None if values["result"] is None else _result(values["result"])
        return cls(**values)


def running_note(job_id: str, elapsed_s: float) -> str:
    """What a reply says of a job that goes on after it."""
    return (
        f"still running as job {job_id} after {duration(elapsed_s)}: manage_jobs action 'wait' for the rest, "
        "'cancel' to stop it"
    )


def unknown_job(job_id: str) -> JobUpdate:
    return JobUpdate(job_id, status=JobStatus.LOST.value, gone=True, notice="the job is no longer known")


def job_update(job: Job, generation: int, result_of: Any, read: bool = False) -> JobUpdate:
    """`job` as it stands now; `read`: with what is new since the last read (moving the read cursors).
    `result_of(job)`: its result once it ended (it raises the refusal of a job that never ran)."""
    output = job.output
    assert output is not None
    since = job.executing_since
    update = JobUpdate(
        job.job_id, status=job.status.value, elapsed_s=job.elapsed_s(),
        executing_for_s=None if since is None else time.monotonic() - since,
        generation=job.generation if job.generation is not None else generation,
        tail=output.tail_text(TAIL_CHARS), dropped_images=output.dropped_images,
    )  # fmt: skip
    if read:
        taken = output.take()
        update.text, update.images, update.saved, update.spill_path = (
            taken.text, taken.images, taken.saved, taken.spill_path,
        )  # fmt: skip
    if not job.running:
        update.notice, update.state_lost = job.notice, job.state_lost
        try:
            update.result = result_of(job)
        except CodeRunnerError as exc:
            update.failure = str(exc)
        if read:
            output.release_images()
    return update


# --- a result that crosses a process boundary -------------------------------------------------------


def portable_output(output: OutputCollector) -> OutputCollector:
    """A copy of a finished collector that holds no fd, writer, pending write or hook (safe to pickle)."""
    moved = copy.copy(output)
    moved.writer = None
    moved._pending = []
    moved._spill_fd = None
    if isinstance(moved, JobOutput):
        moved.on_change = None
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
