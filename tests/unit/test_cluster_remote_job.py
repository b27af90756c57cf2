"""A job mirrored at the front door (cluster/remote_job.py), fed by scripted reads instead of an actor."""

from __future__ import annotations

import pytest

from coderunner.cluster.remote_job import RemoteJob, mirror_output, pump
from coderunner.cluster.wire import JobDelta
from coderunner.errors import SessionError
from coderunner.kernel.output_capture import ImageOutput
from coderunner.sessions.job_runner import JobStatus

pytestmark = pytest.mark.anyio


def mirrored() -> RemoteJob:
    return RemoteJob(job_id="job-1", kind="python", label="x", owner="o", output=mirror_output(1000))


async def test_what_the_node_sends_is_read_once_then_the_end_wakes_the_waiters() -> None:
    job = mirrored()
    deltas = iter([
        JobDelta("job-1", text="tick 0\n", executing_for_s=0.2),
        JobDelta("job-1", text="tick 1\n", images=[ImageOutput("image/png", "AAAA")], spill_path="/workspace/o.txt"),
        JobDelta("job-1", ended=True, status="done", notice="fine", generation=3),
    ])  # fmt: skip

    async def read(wait_s: float) -> JobDelta:
        return next(deltas)

    await pump(job, read, lambda exc: "lost")
    assert job.done.is_set() and job.status is JobStatus.DONE and job.notice == "fine" and job.generation == 3
    assert job.executing_since is not None
    assert job.output is not None and "tick 1" in job.output.tail_text(100)
    first = job.output.take()
    assert first.text == "tick 0\ntick 1\n" and len(first.images) == 1 and first.spill_path == "/workspace/o.txt"
    assert job.output.take().text == ""  # read once


async def test_a_node_that_stops_answering_ends_the_job_as_lost_saying_so() -> None:
    job = mirrored()

    async def read(wait_s: float) -> JobDelta:
        raise ConnectionError("node gone")

    await pump(job, read, lambda exc: f"lost with node n1 ({type(exc).__name__})")
    assert job.status is JobStatus.LOST and job.notice == "lost with node n1 (ConnectionError)"


async def test_a_refusal_from_the_node_is_the_job_s_failure() -> None:
    job = mirrored()

    async def read(wait_s: float) -> JobDelta:
        raise SessionError("session s was closed")

    await pump(job, read, lambda exc: "lost")
    assert job.status is JobStatus.LOST and isinstance(job.failure, SessionError)


async def test_cancelling_the_mirror_asks_the_node() -> None:
    job, asked = mirrored(), []
    job.request_cancel = lambda: asked.append(True)
    job.cancel()
    assert asked == [True] and job.cancel_requested and not job.done.is_set()  # the node's answer ends it
