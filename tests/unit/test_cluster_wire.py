"""A run's answer crosses between node agent and front door as plain data (cluster/wire.py): made again whole."""

from __future__ import annotations

from typing import Any

from coderunner.cluster.wire import JobDelta, portable_result
from coderunner.kernel.execution import CellError, RunOutcome, RunStatus
from coderunner.kernel.output_capture import ImageOutput
from coderunner.kernel.run_result import ExecutionResult
from coderunner.sessions.job_runner import JobOutput

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


def test_a_finished_runs_delta_crosses_as_plain_data_and_is_made_again_equal() -> None:
    outcome = RunOutcome(
        RunStatus.ERROR, finished_output(), CellError("ValueError", "no", "Traceback ...\nValueError: no"),
        execution_count=7, duration_s=0.25, guest_payload={"files": ["a.txt"], "sizes": {"a.txt": 3}},
    )  # fmt: skip
    delta = JobDelta(
        "job-1", text="after the read\n", images=[ImageOutput("image/png", "AAAA")], saved=["/workspace/a.png"],
        executing_for_s=0.2, elapsed_s=0.3, ended=True, status="done", generation=2, mark=5,
        result=portable_result(ExecutionResult(outcome, notice="restarted", state_lost=True)),
    )  # fmt: skip
    wire = delta.wire()
    assert plain(wire), wire
    again = JobDelta.of_wire(wire)
    assert again == delta
    assert again.result is not None and isinstance(again.result.outcome.output, JobOutput)
    assert again.result.outcome.output.text() == delta.result.outcome.output.text()  # type: ignore[union-attr]


def test_a_running_jobs_delta_and_a_gone_one_cross_too() -> None:
    running = JobDelta("job-2", text="tick\n", executing_for_s=1.0, mark=1)
    gone = JobDelta("job-3", gone=True, ended=True, status="lost", notice="the job is no longer known")
    for delta in (running, gone):
        assert plain(delta.wire())
        assert JobDelta.of_wire(delta.wire()) == delta


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
