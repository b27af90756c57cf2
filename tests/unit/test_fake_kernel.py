"""The scripted kernel itself: each command and cue does what the state-machine tests rely on,
and each outcome is reported as Kernel.execute reports a real kernel's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from coderunner.kernel.incarnation import KernelStartError, RunOutcome, RunStatus
from coderunner.kernel.output_capture import OutputCollector
from tests.fakes.kernel import KILLED_CODE, START_DEATH_MESSAGE, FakeKernel, FakeKernels, KernelCue

pytestmark = pytest.mark.anyio


def output() -> OutputCollector:
    return OutputCollector(limit_chars=10_000, spill_limit_bytes=0, image_limit_bytes=10_000)


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Any]:
    """`await make(*cues)`: a started FakeKernel (its workspace `tmp_path`), from a FakeKernels."""
    factory = FakeKernels()
    dirs: Any = SimpleNamespace(workspace=SimpleNamespace(path=tmp_path))
    async with anyio.create_task_group() as group:

        async def started(*cues: KernelCue, timeout_s: float = 5.0) -> FakeKernel:
            factory.cue(*cues)
            kernel = factory(None, None, group, dirs, generation=len(factory.made))  # type: ignore[arg-type]
            await kernel.start(timeout_s)
            return kernel

        yield started
        group.cancel_scope.cancel()


async def execute(kernel: FakeKernel, code: str, timeout_s: float = 5.0, **options: Any) -> RunOutcome:
    return await kernel.execute(code, output(), timeout_s=timeout_s, interrupt_grace_s=0.2, **options)


async def test_cells_share_a_namespace_and_count_only_non_silent_runs(make: Any) -> None:
    kernel = await make()
    first = await execute(kernel, "set x 41; print hello")
    second = await execute(kernel, "get x\nhas x\nhas y")
    silent = await execute(kernel, "pass", silent=True)
    assert first.status is RunStatus.OK and first.output.text() == "hello\n" and first.execution_count == 1
    assert second.output.text() == "41\nTrue\nFalse\n" and second.execution_count == 2
    assert silent.status is RunStatus.OK and silent.execution_count is None and kernel.execution_count == 2


async def test_a_raise_or_an_unbound_name_is_a_cell_error(make: Any) -> None:
    kernel = await make()
    raised = await execute(kernel, "raise ValueError bad input")
    unbound = await execute(kernel, "get nothing")
    unknown = await execute(kernel, "frobnicate")
    assert raised.status is RunStatus.ERROR and raised.error is not None
    assert (raised.error.ename, raised.error.evalue) == ("ValueError", "bad input")
    assert "ValueError: bad input" in raised.output.text()
    assert unbound.error is not None and unbound.error.ename == "NameError"
    assert unknown.error is not None and unknown.error.ename == "SyntaxError" and kernel.alive


async def test_a_deadline_interrupts_the_cell_and_keeps_the_kernel(make: Any) -> None:
    kernel = await make()
    outcome = await execute(kernel, "print started\nhang", timeout_s=0.1)
    assert outcome.status is RunStatus.INTERRUPTED and outcome.error is not None
    assert outcome.error.ename == "KeyboardInterrupt" and "started" in outcome.output.text()
    assert kernel.alive and not kernel.wedged and kernel.interrupts == 1
    assert (await execute(kernel, "print again")).status is RunStatus.OK


async def test_a_kernel_that_ignores_interrupts_is_unresponsive_and_wedged_when_cancelled(make: Any) -> None:
    kernel = await make(KernelCue.IGNORE_INTERRUPTS)
    assert (await execute(kernel, "hang", timeout_s=0.1)).status is RunStatus.UNRESPONSIVE
    with anyio.move_on_after(0.1):
        await execute(kernel, "hang", timeout_s=60)
    assert kernel.wedged and kernel.alive and kernel.interrupts == 2


async def test_a_cell_the_owner_discards_is_not_interrupted_when_cancelled(make: Any) -> None:
    kernel = await make()
    with anyio.move_on_after(0.1):
        await kernel.execute("hang", output(), timeout_s=60, interrupt_grace_s=30, keep_on_cancel=False)
    assert kernel.wedged and kernel.interrupts == 0


async def test_an_outside_interrupt_raises_keyboard_interrupt_in_the_cell(make: Any) -> None:
    kernel = await make()
    async with anyio.create_task_group() as group:
        outcomes: list[RunOutcome] = []

        async def run() -> None:
            outcomes.append(await execute(kernel, "hang", timeout_s=60))

        group.start_soon(run)
        await anyio.sleep(0.05)
        kernel.interrupt()
    assert outcomes[0].status is RunStatus.ERROR and outcomes[0].error is not None
    assert outcomes[0].error.ename == "KeyboardInterrupt"


async def test_death_in_a_cell_and_a_kill_from_outside_are_deaths_with_their_codes(make: Any) -> None:
    kernel = await make()
    died = await execute(kernel, "print bye\ndie 7")
    assert died.status is RunStatus.DIED and died.exit_code == 7 and not kernel.alive
    after = await execute(kernel, "print never")
    assert after.status is RunStatus.DIED and after.output.text() == ""
    killed = await make()
    async with anyio.create_task_group() as group:
        outcomes: list[RunOutcome] = []

        async def run() -> None:
            outcomes.append(await execute(killed, "hang", timeout_s=60))

        group.start_soon(run)
        await anyio.sleep(0.05)
        await killed.shutdown()
    assert outcomes[0].status is RunStatus.DIED and outcomes[0].exit_code == KILLED_CODE


async def test_an_oom_death_is_seen_by_the_process(make: Any) -> None:
    kernel = await make()
    assert (await execute(kernel, "die oom")).status is RunStatus.DIED
    assert kernel.fake_process.oom_killed() and kernel.fake_process.memory_used_mb() is None


async def test_start_cues_fail_as_a_real_start_does_and_leave_no_process(make: Any) -> None:
    with pytest.raises(KernelStartError, match=START_DEATH_MESSAGE):
        await make(KernelCue.DIE_AT_START)
    with pytest.raises(KernelStartError, match="did not answer in time"):
        await make(KernelCue.HANG_AT_START, timeout_s=0.1)


async def test_guest_calls_are_answered_like_the_guest_dispatcher(make: Any) -> None:
    kernel = await make()
    call = "await __import__('coderunner_guest.dispatch', fromlist=['call']).call({!r}, {!r})"
    answer = await execute(kernel, call.format("variables", '{"values": {"n": 3}}'), silent=True)
    assert answer.guest_payload == {"ok": True, "result": {"set": ["n"]}} and kernel.namespace["n"] == 3
    unknown = await execute(kernel, call.format("nope", "{}"), silent=True)
    assert unknown.guest_payload == {"ok": False, "error": "unknown guest tool 'nope'"}


async def test_images_lost_output_files_and_progress(make: Any, tmp_path: Path) -> None:
    kernel = await make()
    seen: list[float] = []

    async def progress(elapsed_s: float, _output: OutputCollector) -> None:
        seen.append(elapsed_s)

    outcome = await execute(kernel, "image image/png\nlose\nwrite a.txt hi there\nread a.txt\nsleep 0.25",
                            progress=progress, progress_interval_s=0.05)  # fmt: skip
    assert outcome.status is RunStatus.OK and outcome.output_lost
    assert [image.mime_type for image in outcome.output.images] == ["image/png"]
    assert (tmp_path / "a.txt").read_text() == "hi there" and "hi there\n" in outcome.output.text()
    assert len(seen) >= 2 and seen == sorted(seen)
