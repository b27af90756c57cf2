"""Jobs: detaching, reading without repeats, cancel (kept or restarted), loss, lifetimes.

On scripted kernels in-process (tests/fakes/kernel.py); the e2e suite (test_e2e_jobs.py) drives
the same paths through the MCP client inside real sandboxes with real kernels.
"""

from __future__ import annotations

import anyio
import pytest

from coderunner.kernel.incarnation import RunStatus
from coderunner.sessions import SessionManager
from coderunner.sessions.job_runner import Job, JobOutput, JobStatus, JobTable, attend, cancel
from tests.fakes.kernel import FakeKernels, KernelCue

from .test_session_states import HANG, WAIT_S, run, text, until

pytestmark = pytest.mark.anyio

#: Prints a numbered line every 0.05 s, then defines `finished`.
TICKING = "tick {n} 0.05"


def ticks(seen: str) -> list[str]:
    return [line for line in seen.splitlines() if line.startswith("tick ")]


async def test_a_detached_job_runs_on_and_each_read_gives_only_what_is_new(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    job = await session.start_run(TICKING.format(n=15), None)
    assert not await attend(job, 0.3)
    job.detached = True
    assert job.output is not None
    first = job.output.take().text
    assert ticks(first) and job.running
    assert session.jobs.running() is job
    assert await attend(job, WAIT_S)
    rest = job.output.take().text
    seen = ticks(first) + ticks(rest)
    assert seen == [f"tick {i}" for i in range(15)]  # each line once, in order
    assert job.status is JobStatus.DONE and not job.state_lost
    assert job.output.take().text == ""  # nothing new
    assert "15" in text(await run(session, "get finished"))


async def test_a_caller_cancelled_before_detaching_interrupts_the_cell(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    job = await session.start_run(HANG, None)
    with anyio.move_on_after(0.3):
        await attend(job, None)
    assert not job.running and job.status is JobStatus.INTERRUPTED
    assert "7" in text(await run(session, "get kept"))


async def test_a_caller_cancelled_after_detaching_leaves_the_job_running(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    job = await session.start_run(TICKING.format(n=10), None, owner="x")
    job.detached = True
    with anyio.move_on_after(0.2):
        await attend(job, None)
    assert job.running
    assert await attend(job, WAIT_S) and job.status is JobStatus.DONE


async def test_cancel_interrupts_and_keeps_state(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    before = session.generation
    job = await session.start_run("print started\n" + HANG, None)
    await until(lambda: job.output is not None and "started" in job.output.tail_text(), "the cell to start")
    assert await cancel(job, WAIT_S)
    assert job.status is JobStatus.INTERRUPTED and not job.state_lost
    assert job.notice == "cancelled: interrupted; the kernel and its state are kept"
    assert session.generation == before and session.kernel_state() == (before, True)
    assert "7" in text(await run(session, "get kept"))


async def test_cancel_restarts_a_kernel_that_ignores_the_interrupt_and_says_state_was_lost(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    kernels.cue(KernelCue.IGNORE_INTERRUPTS)
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    before, _ = session.kernel_state()
    job = await session.start_run(HANG, None)
    await until(lambda: session.busy, "the cell to start")
    assert await cancel(job, WAIT_S)
    assert job.status is JobStatus.INTERRUPTED and job.state_lost
    assert "kernel restarted; state lost" in (job.notice or "")
    assert session.kernel_state(lost=job.state_lost) == (before + 1, False)
    assert "False" in text(await run(session, "has kept"))
    assert session.kernel_state() == (before + 1, True)


async def test_a_job_that_kills_its_kernel_is_lost_and_a_fresh_kernel_is_ready(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    job = await session.start_run("sleep 0.2\ndie 9", None)
    job.detached = True
    assert await attend(job, WAIT_S)
    assert job.status is JobStatus.LOST
    result = session.job_result(job)
    assert result.outcome.status is RunStatus.DIED and result.state_lost
    assert "2" in text(await run(session, "print 2"))


async def test_closing_the_session_ends_its_job_and_tells_the_waiter(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    session = await scripted.create()
    job = await session.start_run(HANG, None)
    job.detached = True
    await until(lambda: session.busy, "the cell to start")
    async with anyio.create_task_group() as tg:
        ended: list[bool] = []

        async def waiter() -> None:
            ended.append(await attend(job, WAIT_S))

        tg.start_soon(waiter)
        await scripted.close(session.session_id)
    assert ended == [True] and job.status is JobStatus.LOST
    assert session.job_result(job).notice == "the session was closed during this call"
    assert kernels.processes and all(not process.alive for process in kernels.processes)


async def test_reset_during_a_job_ends_it_with_state_lost(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    job = await session.start_run(HANG, None)
    job.detached = True
    await until(lambda: session.busy, "the cell to start")
    await session.reset()
    assert await attend(job, WAIT_S)
    assert session.job_result(job).notice == "stopped by a kernel reset: state lost"
    assert session.job_result(job).state_lost


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
