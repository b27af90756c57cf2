"""Jobs: detaching, reading without repeats, cancel (kept or restarted), loss, lifetimes.

On scripted kernels in-process (tests/fakes/kernel.py); the e2e suite (test_e2e_jobs.py) drives
the same paths through the MCP client inside real sandboxes with real kernels.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from coderunner.kernel.incarnation import RunStatus
from coderunner.sessions import SessionManager
from coderunner.sessions.job_runner import Job, JobOutput, JobStatus, JobTable
from coderunner.sessions.job_updates import JobUpdate
from coderunner.sessions.session import Session
from tests.fakes.kernel import FakeKernels, KernelCue

from .test_session_states import HANG, WAIT_S, run, text, until

pytestmark = pytest.mark.anyio

#: Prints a numbered line every 0.05 s, then defines `finished`.
TICKING = "tick {n} 0.05"


def ticks(seen: str) -> list[str]:
    return [line for line in seen.splitlines() if line.startswith("tick ")]


async def started(session: Session, code: str, **kwargs: Any) -> str:
    """`code` started as the session's job, still running: its id."""
    update = await session.start_run(code, None, **kwargs)
    assert update.running and session.holds_job(update.job_id), update
    return update.job_id


async def test_a_detached_job_runs_on_and_each_read_gives_only_what_is_new(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    update = await session.start_run(TICKING.format(n=15), None, None, 0.3)
    assert update.running and update.executing_for_s is not None and "tick" in update.tail
    first = await session.read_job(update.job_id)
    assert ticks(first.text) and first.running
    assert session.jobs.running() is not None and session.holds_job(update.job_id)
    rest = await session.read_job(update.job_id, WAIT_S)
    seen = ticks(first.text) + ticks(rest.text)
    assert seen == [f"tick {i}" for i in range(15)]  # each line once, in order
    assert rest.status == JobStatus.DONE.value and not rest.state_lost and rest.result is not None
    assert (await session.read_job(update.job_id)).text == ""  # nothing new
    assert "15" in text(await run(session, "get finished"))


async def test_a_run_that_ends_within_its_wait_comes_whole_and_is_forgotten(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    update = await session.start_run("print 2", None, None, WAIT_S)
    assert update.status == JobStatus.DONE.value and update.result is not None and "2" in text(update.result)
    assert not session.holds_job(update.job_id) and (await session.read_job(update.job_id)).gone


async def test_a_caller_cancelled_before_detaching_interrupts_the_cell(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    with anyio.move_on_after(0.3):
        await session.start_run(HANG, None, None, WAIT_S)
    (described,) = await session.list_jobs()
    assert described["status"] == JobStatus.INTERRUPTED.value, described
    job_id = await started(session, HANG)
    with anyio.move_on_after(0.3):
        await session.wait_job(job_id, WAIT_S)
    assert (await session.read_job(job_id)).status == JobStatus.INTERRUPTED.value
    assert "7" in text(await run(session, "get kept"))


async def test_a_reader_cancelled_leaves_the_job_running(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    job_id = await started(session, TICKING.format(n=10), owner="x")
    with anyio.move_on_after(0.2):
        await session.read_job(job_id, WAIT_S)
    assert (await session.read_job(job_id, take=False)).running
    assert (await session.read_job(job_id, WAIT_S)).status == JobStatus.DONE.value


async def test_cancel_interrupts_and_keeps_state(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    before = session.generation
    job_id = await started(session, "print started\n" + HANG)
    with anyio.fail_after(WAIT_S):
        while "started" not in (await session.read_job(job_id, 0.05, take=False)).tail:
            pass
    await session.cancel_job(job_id)
    update = await session.read_job(job_id)
    assert update.status == JobStatus.INTERRUPTED.value and not update.state_lost
    assert update.notice == "cancelled: interrupted; the kernel and its state are kept"
    assert session.generation == before and session.kernel_state() == (before, True)
    assert "7" in text(await run(session, "get kept"))


async def test_cancel_restarts_a_kernel_that_ignores_the_interrupt_and_says_state_was_lost(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    kernels.cue(KernelCue.IGNORE_INTERRUPTS)
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    before, _ = session.kernel_state()
    job_id = await started(session, HANG)
    await until(lambda: session.busy, "the cell to start")
    await session.cancel_job(job_id)
    update = await session.read_job(job_id)
    assert update.status == JobStatus.INTERRUPTED.value and update.state_lost
    assert "kernel restarted; state lost" in (update.notice or "")
    assert session.kernel_state(lost=update.state_lost) == (before + 1, False)
    assert "False" in text(await run(session, "has kept"))
    assert session.kernel_state() == (before + 1, True)


async def test_a_job_that_kills_its_kernel_is_lost_and_a_fresh_kernel_is_ready(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    update = await session.start_run("sleep 0.2\ndie 9", None, None, WAIT_S)
    assert update.status == JobStatus.LOST.value and update.result is not None
    assert update.result.outcome.status is RunStatus.DIED and update.result.state_lost
    assert "2" in text(await run(session, "print 2"))


async def test_closing_the_session_ends_its_job_and_tells_the_reader(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    session = await scripted.create()
    job_id = await started(session, HANG)
    await until(lambda: session.busy, "the cell to start")
    async with anyio.create_task_group() as tg:
        ended: list[JobUpdate] = []

        async def reader() -> None:
            ended.append(await session.read_job(job_id, WAIT_S))

        tg.start_soon(reader)
        await scripted.close(session.session_id)
    (update,) = ended
    assert update.status == JobStatus.LOST.value and update.result is not None
    assert update.result.notice == "the session was closed during this call"
    assert kernels.processes and all(not process.alive for process in kernels.processes)


async def test_reset_during_a_job_ends_it_with_state_lost(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    job_id = await started(session, HANG)
    await until(lambda: session.busy, "the cell to start")
    await session.reset()
    update = await session.read_job(job_id, WAIT_S)
    assert update.result is not None and update.result.notice == "stopped by a kernel reset: state lost"
    assert update.result.state_lost and not update.running


async def test_unread_text_is_bounded_and_points_at_the_spill_file() -> None:
    output = JobOutput(limit_chars=1000, spill_limit_bytes=0, image_limit_bytes=0)
    for i in range(500):
        output.add_text(f"line {i:04d}\n")
    read = output.take()
    assert len(read.text) < 1200
    assert read.text.startswith("[... 4,000 characters not shown here; full output: not saved]")
    assert read.text.endswith("line 0499\n")
    assert output.take().text == ""


async def test_a_table_keeps_only_the_last_finished_jobs() -> None:
    async with anyio.create_task_group() as tg:
        table = JobTable(tg, max_kept=3)

        async def work(job: Job) -> str:
            return "ok"

        jobs = [table.start(Job(table.new_id(), "t", "", "o"), work, lambda job: JobStatus.DONE) for _ in range(6)]
        for job in jobs:
            await job.done.wait()
        table.start(Job(table.new_id(), "t", "", "o"), work, lambda job: JobStatus.DONE)
        assert len(table.jobs) == 3 and jobs[0].job_id not in table.jobs
