"""A job whose cell runs in a session of a node agent, mirrored at the front door.

The tools attend a Job (sessions/job_runner.py): wait on `done`, read `output` for progress and for
what is new, read the result at the end. RemoteJob is that Job at the front door, kept in step with
the real one on the node by its session (remote_session.py): the agent publishes each job's change
count in the session's news, the front door's long poll of the agent brings it (agent_watch.py),
and the session reads what is new when the count passed its last read's. Cancelling it asks the
agent to cancel the real one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coderunner.cluster.wire import JobDelta
from coderunner.errors import SessionError
from coderunner.sessions.job_runner import Job, JobOutput, JobStatus


@dataclass
class RemoteJob(Job):
    """A Job whose work happens in a node agent; `cancel` is forwarded there."""

    #: Asks the agent to cancel the real job (set by the session that made this one).
    request_cancel: Callable[[], None] | None = None
    #: The node dropped it already (it ended within the first call, whose answer had all of it).
    node_forgot: bool = False
    #: The node's change count of the job as of the last read (JobDelta.mark; SessionNews.jobs).
    read_mark: int = 0
    _applied_end: bool = field(default=False, repr=False)

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.request_cancel is not None:
            self.request_cancel()

    def apply(self, delta: JobDelta) -> None:
        """Take in what the agent said is new; at the job's end, its status and result, and wake waiters."""
        output = self.output
        assert output is not None
        if delta.text:
            output.add_text(delta.text)
        output.images.extend(delta.images)
        output.saved_images.extend(delta.saved)
        if delta.spill_path:
            output.spill_path = delta.spill_path
        output.dropped_images = delta.dropped_images
        if delta.executing_for_s is not None and self.executing_since is None:
            self.executing_since = time.monotonic() - delta.executing_for_s
        self.generation = delta.generation
        self.read_mark = max(self.read_mark, delta.mark)
        if delta.ended and not self._applied_end:
            self.end(JobStatus(delta.status), delta.result, delta.notice, delta.state_lost, delta.failure)

    def end(
        self, status: JobStatus, result: Any = None, notice: str | None = None, state_lost: bool = False,
        failure: str | None = None,
    ) -> None:  # fmt: skip
        self._applied_end = True
        self.status, self.result, self.notice, self.state_lost = status, result, notice, state_lost
        if failure is not None:
            self.failure = SessionError(failure)
        self.ended_at = time.monotonic()
        self.done.set()


def mirror_output(limit_chars: int) -> JobOutput:
    """The front door's copy of a job's output: no files (the node spilled them), images as sent."""
    return JobOutput(limit_chars=limit_chars, spill_limit_bytes=0, image_limit_bytes=0, writer=None)
