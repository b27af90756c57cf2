"""A run's result and a guest tool's answer as MCP content: what the caller reads, and its bounds."""

from __future__ import annotations

import json

from mcp.types import ImageContent, ResourceLink, TextContent

from coderunner.kernel.incarnation import CellError, RunOutcome, RunStatus
from coderunner.kernel.output_capture import OutputCollector
from coderunner.kernel.run_result import ExecutionResult
from coderunner.tools.replies import MAX_ERROR_CHARS, ReplyBounds, error_result, execution_reply, guest_tool_result

PNG = "iVBORw0KGgo="


def outcome(status: RunStatus = RunStatus.OK, text: str = "", count: int | None = 3) -> RunOutcome:
    output = OutputCollector(limit_chars=1000, spill_limit_bytes=0, image_limit_bytes=1000)
    output.add_text(text)
    return RunOutcome(status=status, output=output, execution_count=count, duration_s=0.1234)


def texts(blocks: list[object]) -> list[str]:
    return [block.text for block in blocks if isinstance(block, TextContent)]


def test_a_cell_reply_is_its_output_then_a_footer() -> None:
    reply = execution_reply(ExecutionResult(outcome(text="hello\n")))
    assert texts(reply.content) == ["hello\n[ok in 0.123s, cell 3]"] and not reply.is_error


def test_a_notice_is_bracketed_and_a_failed_run_is_an_error() -> None:
    run = outcome(RunStatus.DIED, count=None)
    reply = execution_reply(ExecutionResult(run, notice="kernel died", state_lost=True))
    assert texts(reply.content) == ["[kernel died]\n[died in 0.123s]"] and reply.is_error


def test_every_status_but_ok_is_an_error() -> None:
    for status in RunStatus:
        assert ExecutionResult(outcome(status)).is_error is (status is not RunStatus.OK)


def test_images_follow_the_text_and_saved_files_are_linked_only_when_asked() -> None:
    run = outcome(RunStatus.ERROR, text="x\n")
    run.error = CellError("ValueError", "bad", "")
    run.output.add_image("image/png", PNG)
    run.output.spill_path = "/workspace/.coderunner/output-1.txt"
    linked = execution_reply(ExecutionResult(run), session_id="s1")
    kinds = [type(block) for block in linked.content]
    assert kinds == [TextContent, ImageContent, ResourceLink]
    assert (
        linked.content[1].data == PNG
        and str(linked.content[2].uri) == "sandbox://s1/workspace/.coderunner/output-1.txt"
    )
    assert [type(block) for block in execution_reply(ExecutionResult(run), session_id="s1", links=False).content] == [
        TextContent,
        ImageContent,
    ]


def test_saved_and_dropped_images_are_named_in_the_text() -> None:
    run = outcome()
    run.output.saved_images.append("/workspace/.coderunner/image-21.png")
    run.output.dropped_images = 1500
    text = texts(execution_reply(ExecutionResult(run)).content)[0]
    assert "saved: /workspace/.coderunner/image-21.png" in text and "[1,500 more images were neither shown" in text


def test_an_error_result_keeps_head_and_tail_of_a_long_message() -> None:
    assert texts(error_result("short").content) == ["short"] and error_result("short").is_error
    message = "A" * MAX_ERROR_CHARS + "B" * 1000
    text = texts(error_result(message).content)[0]
    assert text.startswith("A" * (MAX_ERROR_CHARS // 2)) and text.endswith("B" * 1000)
    assert "[... 1,000 characters omitted ...]" in text


def test_a_guest_answer_is_json_with_its_previews_as_images_within_budget() -> None:
    bounds = ReplyBounds(text_chars=10_000, image_bytes=20, spill_bytes=0, image_count=2)
    answer = {"pages": 3, "previews": ["a" * 15, "b" * 15, "c" * 5, "d" * 5]}
    reply = guest_tool_result(answer, bounds)
    body = texts(reply.content)[0]
    assert json.loads(body.split("\n[")[0]) == {"pages": 3}
    assert "[2 of 4 previews not shown: over the inline image budget]" in body
    assert [block.data for block in reply.content if isinstance(block, ImageContent)] == ["a" * 15, "c" * 5]
    assert reply.structured_content is None  # the JSON once, as text


def test_a_truncated_guest_answer_has_no_structured_copy() -> None:
    bounds = ReplyBounds(text_chars=100, image_bytes=0, spill_bytes=0)
    reply = guest_tool_result({"text": "x" * 1000}, bounds)
    assert reply.structured_content is None and "characters omitted" in texts(reply.content)[0]
