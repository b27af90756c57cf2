"""Unit checks of the bounds: image count in cell output, guest answers, and per-caller one-shot shares."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from coderunner.kernel.output_capture import MAX_INLINE_IMAGES, MAX_SAVED_IMAGES, OutputCollector, WorkspaceWriter
from coderunner.oneshot.runs import OneShotError, OneShotRunner
from coderunner.tools.replies import ReplyBounds, guest_tool_result

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()


def test_cell_output_keeps_at_most_a_fixed_number_of_images(tmp_path: Path) -> None:
    out = OutputCollector(limit_chars=1_000, spill_limit_bytes=1_000_000, image_limit_bytes=10**9,
                          writer=WorkspaceWriter(tmp_path, "/workspace"))  # fmt: skip
    for _ in range(MAX_INLINE_IMAGES + MAX_SAVED_IMAGES + 50):
        out.add_image("image/png", PNG)
    assert len(out.images) == MAX_INLINE_IMAGES
    assert len(out.saved_images) == MAX_SAVED_IMAGES
    assert out.dropped_images == 50


def test_a_guest_answer_is_cut_to_the_bounds_of_cell_output() -> None:
    answer: dict[str, Any] = {"previews": [PNG] * 20_000, "preview": "x" * 700_000, "text": "A" * 100_000}
    result = guest_tool_result(answer, ReplyBounds(text_chars=2_000, image_bytes=10_000, spill_bytes=0))
    images = [block for block in result.content if block.type == "image"]
    text = "".join(block.text for block in result.content if block.type == "text")
    assert 0 < len(images) <= MAX_INLINE_IMAGES
    assert len(text) < 3_000 and "characters omitted" in text and "previews not shown" in text
    assert result.structured_content is None


def test_a_small_guest_answer_is_whole_and_said_once() -> None:
    result = guest_tool_result({"path": "/workspace/a.png", "preview": PNG}, ReplyBounds(2_000, 10_000, 0))
    assert json.loads(result.content[0].text) == {"path": "/workspace/a.png"}  # type: ignore[union-attr]
    assert result.structured_content is None  # no structured copy doubling the text
    assert [block.type for block in result.content] == ["text", "image"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def runner(total: int, per_caller: int) -> OneShotRunner:
    return OneShotRunner(backend=None, task_group=None, leases=None, output_limit_chars=0,  # type: ignore[arg-type]
                         max_concurrent=total, max_per_caller=per_caller)  # fmt: skip


@pytest.mark.anyio
async def test_one_caller_takes_only_its_share_of_one_shot_slots() -> None:
    shots = runner(total=3, per_caller=2)
    release = anyio.Event()
    holding = 0

    async def hold(caller: str) -> None:
        nonlocal holding
        async with shots.slots.slot(30, caller):
            holding += 1
            await release.wait()

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(hold, "greedy")
        await anyio.sleep(0.1)
        assert holding == 2  # its share, though a third global slot is free
        with pytest.raises(OneShotError, match="this client already has 2"):
            async with shots.slots.slot(0.1, "greedy"):
                pass
        async with shots.slots.slot(0.1, "other"):  # not queued behind the greedy caller
            pass
        async with shots.slots.slot(0.1, None):  # the server's own probe takes no share
            pass
        release.set()
    assert holding == 4 and shots.slots._callers == {}
