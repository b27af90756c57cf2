"""A job's update (sessions/job_updates.py): what a job is to a reader, and how it crosses between a node
agent and a front door as plain data, made again whole."""

from __future__ import annotations

from typing import Any

import pytest

from coderunner.errors import SessionBusy
from coderunner.kernel.execution import CellError, RunOutcome, RunStatus
from coderunner.kernel.output_capture import ImageOutput
from coderunner.kernel.run_result import ExecutionResult
from coderunner.sessions.job_runner import Job, JobOutput, JobStatus
from coderunner.sessions.job_updates import JobUpdate, job_update, portable_output, portable_result, unknown_job

PLAIN = (dict, list, str, int, float, bool, bytes, type(None))


def plain(value: Any) -> bool:
    """Whether `value` is only what msgpack holds as it is (no object Ray would pickle)."""
    if isinstance(value, dict):
        return all(isinstance(key, str) and plain(item) for key, item in value.items())
    if isinstance(value, list):
        return all(plain(item) for item in value)
    return isinstance(value, PLAIN)


def finished_output() -> JobOutput:
    output = JobOutput(limit_chars=40, spill_limit_bytes=0, image_limit_bytes=1000)
    for index in range(30):  # past its limit: head, a tail deque, an unread window
        output.add_text(f"line {index}\n")
    output.add_image("image/png", "iVBORw0KGgo=")
    output.take()
    output.add_text("after the read\n")
    return output


def test_a_finished_runs_update_crosses_as_plain_data_and_is_made_again_equal() -> None:
    outcome = RunOutcome(
        RunStatus.ERROR, finished_output(), CellError("ValueError", "no", "Traceback ...\nValueError: no"),
        execution_count=7, duration_s=0.25, guest_payload={"files": ["a.txt"], "sizes": {"a.txt": 3}},
    )  # fmt: skip
    delta = JobUpdate(
        "job-1", text="after the read\n", images=[ImageOutput("image/png", "AAAA")], saved=["/workspace/a.png"],
        executing_for_s=0.2, elapsed_s=0.3, status="done", generation=2, tail="read\n",
        result=portable_result(ExecutionResult(outcome, notice="restarted", state_lost=True)),
    )  # fmt: skip
    wire = delta.wire()
    assert plain(wire), wire
    again = JobUpdate.of_wire(wire)
    assert again == delta and not again.running
    assert again.result is not None and isinstance(again.result.outcome.output, JobOutput)
    assert again.result.outcome.output.text() == delta.result.outcome.output.text()  # type: ignore[union-attr]


def test_a_running_jobs_update_and_a_gone_one_cross_too() -> None:
    running = JobUpdate("job-2", text="tick\n", executing_for_s=1.0)
    gone = unknown_job("job-3")
    assert running.running and not gone.running and gone.gone
    for update in (running, gone):
        assert plain(update.wire())
        assert JobUpdate.of_wire(update.wire()) == update


def a_job(status: JobStatus = JobStatus.RUNNING) -> Job:
    output = JobOutput(limit_chars=1000, spill_limit_bytes=0, image_limit_bytes=1000)
    job = Job(job_id="job-9", kind="python", label="x", owner="o", output=output, generation=4)
    output.add_text("one\n")
    output.add_image("image/png", "AAAA")
    if status is not JobStatus.RUNNING:
        job.status, job.result = status, "the result"
        job.done.set()
    return job


@pytest.mark.anyio
async def test_a_look_leaves_the_output_for_the_next_read_and_a_read_takes_it_once() -> None:
    job = a_job()
    look = job_update(job, 1, lambda job: job.result)
    assert look.running and look.text == "" and look.images == [] and look.tail == "one\n" and look.generation == 4
    read = job_update(job, 1, lambda job: job.result, read=True)
    assert read.text == "one\n" and len(read.images) == 1 and read.result is None
    assert job_update(job, 1, lambda job: job.result, read=True).text == ""  # taken once


@pytest.mark.anyio
async def test_an_ended_job_brings_its_result_or_the_refusal_it_met() -> None:
    ended = job_update(a_job(JobStatus.DONE), 1, lambda job: job.result)
    assert not ended.running and ended.status == "done" and ended.result == "the result"

    def refused(job: Job) -> Any:
        raise SessionBusy("busy behind another call")

    failed = job_update(a_job(JobStatus.LOST), 1, refused)
    assert failed.result is None and failed.failure == "busy behind another call"


def test_a_finished_job_s_result_crosses_without_the_node_s_hook() -> None:
    """A node's output carries hooks bound to what never crosses; its portable copy holds none of them."""
    import pickle
    import threading

    output = JobOutput(limit_chars=100, spill_limit_bytes=0, image_limit_bytes=0)
    lock = threading.Lock()  # stands for what a hook is bound to: nothing that pickles
    output.on_change = lambda ended: lock.acquire(blocking=False) and None
    output.add_text("done\n")
    moved = pickle.loads(pickle.dumps(portable_output(output)))
    assert moved.text() == "done\n" and moved.on_change is None and output.on_change is not None


def test_a_one_shot_runs_answer_crosses_as_plain_data_and_is_made_again_equal() -> None:
    """Its result is plain data; its egress decisions and exported files, when a run has any, cross as they are."""
    from coderunner.cluster.oneshot_exports import OneShotExports
    from coderunner.cluster.wire import EgressDelta, of_oneshot_answer, oneshot_answer
    from coderunner.oneshot.runs import OneShotResult
    from coderunner.policy.egress import EgressPolicy

    result = OneShotResult(
        "python", True, 0, "42\n", "", False, 31.5, 12.25, {"memory_mb": 512, "timeout_s": 30}, exported="a.txt"
    )
    answer = oneshot_answer(result, None, None)
    assert plain(answer), answer
    assert of_oneshot_answer(answer) == (result, None, None)
    exports = OneShotExports("/node/exports/run-1", [("a.txt", b"hi")])
    delta = EgressDelta([], 1, {"allowed": 1}, [], EgressPolicy.parse(["a.example.org"]))
    assert of_oneshot_answer(oneshot_answer(result, delta, exports)) == (result, delta, exports)
