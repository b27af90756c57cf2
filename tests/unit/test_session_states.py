"""The session state machine: every outcome of a run, resets, closes, limits.

Each test drives a real SessionManager in-process on scripted kernels (tests/fakes/kernel.py):
no sandbox and no ipykernel, so what is tested is the session's and manager's handling of each
outcome. The e2e suite proves the same paths inside real sandboxes with real kernels.
"""

from __future__ import annotations

import os
import time

import anyio
import pytest

from coderunner.kernel.incarnation import KernelStartError, RunStatus
from coderunner.kernel.run_result import ExecutionResult
from coderunner.sessions import Session, SessionBusy, SessionError, SessionManager
from tests.fakes.backend import FakeBackend
from tests.fakes.kernel import START_DEATH_MESSAGE, FakeKernels, KernelCue

from .conftest import ManagerFactory

pytestmark = pytest.mark.anyio

#: Bound on waiting for something another task does (a run to start, the reaper to act).
WAIT_S = 20.0
#: A cell that runs far longer than any test waits, and ignores nothing by itself (a real kernel's).
LONG_CELL = "import time\nfor _ in range(600): time.sleep(0.05)"
#: The same, for a scripted kernel.
HANG = "hang"


async def run(session: Session, code: str, timeout_s: float | None = None) -> ExecutionResult:
    return await session.run(code, timeout_s, None)


def text(result: ExecutionResult) -> str:
    return result.outcome.output.text()


async def until(condition: object, what: str) -> None:
    """Wait (bounded) for `condition()` to hold: another task is getting there."""
    with anyio.fail_after(WAIT_S):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.02)


def fake(manager: SessionManager) -> FakeBackend:
    assert isinstance(manager.backend, FakeBackend)
    return manager.backend


async def test_ok_keeps_state_between_runs(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    first = await run(session, "set x 41\nprint hello")
    assert first.outcome.status is RunStatus.OK and "hello" in text(first)
    second = await run(session, "get x")
    assert second.outcome.status is RunStatus.OK and "41" in text(second)
    assert not second.is_error and second.notice is None and session.restarts == 0


async def test_error_reports_the_exception_and_keeps_state(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 'yes'")
    result = await run(session, "raise ValueError bad input")
    assert result.outcome.status is RunStatus.ERROR and result.is_error
    assert result.outcome.error is not None and result.outcome.error.ename == "ValueError"
    assert "bad input" in result.outcome.error.evalue
    assert "yes" in text(await run(session, "get kept"))
    assert session.restarts == 0


async def test_timeout_interrupts_and_keeps_state(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    result = await run(session, "print started\nhang", timeout_s=0.2)
    assert result.outcome.status is RunStatus.INTERRUPTED
    assert "interrupted; the kernel and its state are kept" in (result.notice or "")
    assert "started" in text(result) and not result.state_lost
    assert "7" in text(await run(session, "get kept"))
    assert session.restarts == 0


async def test_timeout_restarts_a_kernel_that_ignores_the_interrupt(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    kernels.cue(KernelCue.IGNORE_INTERRUPTS)
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    stuck = session.kernel
    assert stuck is not None and stuck.process is not None
    result = await run(session, HANG, timeout_s=0.2)
    assert result.outcome.status is RunStatus.UNRESPONSIVE and result.state_lost
    assert "kernel restarted; state lost" in (result.notice or "")
    assert not stuck.process.alive and session.restarts == 1
    after = await run(session, "has kept")
    assert after.outcome.status is RunStatus.OK and "False" in text(after)


async def test_death_during_a_run_is_reported_and_a_fresh_kernel_is_ready(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    result = await run(session, "print bye\ndie 7")
    assert result.outcome.status is RunStatus.DIED and result.state_lost
    assert "kernel died (exit code 7" in (result.notice or "")
    assert "bye" in text(result)
    assert session.restarts == 1 and session.kernel is not None and session.kernel.alive
    after = await run(session, "has kept")
    assert after.outcome.status is RunStatus.OK and "False" in text(after)


async def test_an_oom_death_names_the_memory_limit(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    result = await run(session, "die oom")
    assert result.outcome.status is RunStatus.DIED and result.state_lost
    limit = session.options.limits.memory_mb
    assert f"kernel died (killed for exceeding its memory limit of {limit} MiB)" in (result.notice or "")
    assert session.restarts == 1 and session.kernel is not None and session.kernel.alive


async def test_death_between_runs_is_healed_by_the_next_run(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    assert session.kernel is not None and session.kernel.process is not None
    await session.kernel.process.kill()
    result = await run(session, "print 2")
    assert result.outcome.status is RunStatus.OK and "2" in text(result)
    assert session.restarts == 1


async def test_a_sandbox_that_dies_at_start_is_an_error_with_its_words(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    kernels.cue(KernelCue.DIE_AT_START)
    with pytest.raises(KernelStartError, match=START_DEATH_MESSAGE):
        await scripted.create()
    assert scripted.list() == []
    kept = await scripted.leases.spare_key()  # the next session's dirs, made ahead
    assert {name.removesuffix(".img") for name in os.listdir(scripted.settings.workspaces_dir)} <= {kept}
    assert [name for name in os.listdir(scripted.settings.runtime_dir) if len(name) == 8] in ([], [kept])


async def test_a_kernel_that_never_answers_is_bounded_by_startup_timeout(
    make_scripted: ManagerFactory, kernels: FakeKernels
) -> None:
    async with make_scripted(startup_timeout_s=0.3) as manager:
        kernels.cue(KernelCue.HANG_AT_START)
        with pytest.raises(KernelStartError, match="did not answer in time"):
            await manager.create()
        assert manager.list() == []
        assert kernels.processes and not any(process.alive for process in kernels.processes)


async def test_a_second_call_waits_for_an_attended_run_and_is_told_at_once_of_a_detached_job(
    scripted: SessionManager,
) -> None:
    session = await scripted.resolve(None)
    results: list[ExecutionResult] = []
    async with anyio.create_task_group() as tg:

        async def first() -> None:
            results.append(await run(session, "print started\nhang", timeout_s=60))

        tg.start_soon(first)
        await until(lambda: session.jobs.running() is not None, "the first run to start")
        job = session.jobs.running()
        assert job is not None and job.output is not None
        await until(lambda: "started" in job.output.tail_text(), "the cell to start")  # an interrupt needs a cell
        with pytest.raises(SessionBusy, match="is busy with another call"):
            await run(session, "print 1", timeout_s=0.3)
        job.detached = True  # as run_python does once detach_after_s has passed
        with pytest.raises(
            SessionBusy, match=rf"busy with job {job.job_id} \(running \d+s\): manage_jobs \(wait or cancel\)"
        ):
            await run(session, "print 1", timeout_s=30)
        with pytest.raises(SessionBusy, match=f"busy with job {job.job_id}"):
            await session.call_guest("variables", {"values": {"x": 1}}, 30)
        assert session.kernel is not None
        session.kernel.interrupt()
    assert results[0].outcome.status is RunStatus.ERROR  # KeyboardInterrupt, raised in the cell
    assert results[0].outcome.error is not None and results[0].outcome.error.ename == "KeyboardInterrupt"


async def test_reset_when_idle_clears_state_and_keeps_files(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 7\nwrite note.txt still here")
    await session.reset()
    after = await run(session, "has kept\nread note.txt")
    assert "False\nstill here" in text(after)
    assert session.restarts == 1


async def _reset_during_a_run(session: Session) -> ExecutionResult:
    await run(session, "set kept 7")
    results: list[ExecutionResult] = []
    async with anyio.create_task_group() as tg:

        async def long_run() -> None:
            results.append(await run(session, HANG, timeout_s=60))

        tg.start_soon(long_run)
        await until(lambda: session.busy, "the run to start")
        await session.reset()
    after = await run(session, "has kept")
    assert after.outcome.status is RunStatus.OK and "False" in text(after)
    return results[0]


async def test_reset_while_busy_stops_the_run(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    stopped = await _reset_during_a_run(session)
    assert stopped.notice == "stopped by a kernel reset: state lost" and stopped.state_lost


async def test_reset_while_busy_kills_a_run_that_ignores_the_interrupt(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    kernels.cue(KernelCue.IGNORE_INTERRUPTS)
    session = await scripted.resolve(None)
    first = session.kernel
    stopped = await _reset_during_a_run(session)
    assert stopped.notice == "stopped by a kernel reset: state lost" and stopped.state_lost
    assert first is not None and first.process is not None and not first.process.alive


async def test_close_during_a_run_ends_the_run_and_removes_the_session(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    session = await scripted.create()
    results: list[ExecutionResult] = []
    async with anyio.create_task_group() as tg:

        async def long_run() -> None:
            results.append(await run(session, HANG, timeout_s=60))

        tg.start_soon(long_run)
        await until(lambda: session.busy, "the run to start")
        await scripted.close(session.session_id)
    assert results[0].notice == "the session was closed during this call" and results[0].state_lost
    assert scripted.list() == [] and not session.workspace.path.exists()
    assert not any(process.alive for process in kernels.processes)
    with pytest.raises(SessionError, match="unknown or expired session_id"):
        await scripted.resolve(session.session_id)
    with pytest.raises(SessionError, match="was closed"):
        await run(session, "print 1")


async def test_close_during_a_start_stops_it_and_removes_the_session(
    make_scripted: ManagerFactory, kernels: FakeKernels
) -> None:
    async with make_scripted(startup_timeout_s=60) as manager:
        kernels.cue(KernelCue.HANG_AT_START)
        failures: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def create() -> None:
                try:
                    await manager.create()
                except SessionError as exc:
                    failures.append(exc)

            tg.start_soon(create)
            await until(lambda: len(manager.list()) == 1, "the session to be starting")
            await manager.close(manager.list()[0].session_id)
        assert len(failures) == 1 and "was closed" in str(failures[0])
        assert manager.list() == [] and not any(process.alive for process in kernels.processes)
        kept = await manager.leases.spare_key()  # the next session's dirs, made ahead
        assert {name.removesuffix(".img") for name in os.listdir(manager.settings.workspaces_dir)} <= {kept}


async def test_each_caller_has_its_own_default_session(scripted: SessionManager) -> None:
    manager = scripted
    alice = await manager.resolve(None, "tok/client:alice")
    assert await manager.resolve(None, "tok/client:alice") is alice
    bob = await manager.resolve(None, "tok/client:bob")
    assert bob is not alice and manager.is_default(alice) and manager.is_default(bob)
    await run(alice, "set who 'alice'")
    assert "False" in text(await run(bob, "has who"))
    # Same token: bob may use alice's session by id; another token may not.
    assert await manager.resolve(alice.session_id, "tok/client:bob") is alice
    with pytest.raises(SessionError, match="unknown or expired session_id"):
        await manager.resolve(alice.session_id, "other/client:eve")
    assert manager.list("tok/client:alice") == [alice]
    await manager.release_caller("tok/client:alice")
    assert manager.list() == [bob]
    assert await manager.resolve(None, "tok/client:alice") is not alice


async def test_max_sessions_refuses_one_more(make_scripted: ManagerFactory) -> None:
    async with make_scripted(max_sessions=2) as manager:
        first = await manager.create()
        await manager.create()
        with pytest.raises(SessionError, match=r"session limit reached \(2 open\)"):
            await manager.create()
        await manager.close(first.session_id)
        third = await manager.create()
        assert len(manager.list()) == 2 and third.session_id != first.session_id


async def test_max_sessions_per_client_counts_each_callers_sessions(make_scripted: ManagerFactory) -> None:
    async with make_scripted(max_sessions_per_client=1) as manager:
        await manager.create(owner="tok/client:alice")
        with pytest.raises(SessionError, match="already holds 1 sessions"):
            await manager.create(owner="tok/client:alice")
        await manager.create(owner="tok/client:bob")


async def test_the_idle_reaper_closes_idle_sessions_but_not_busy_ones(make_scripted: ManagerFactory) -> None:
    async with make_scripted(idle_timeout_s=0.5) as manager:
        idle = await manager.create()
        busy = await manager.create()
        # Its idle time counts from before its kernel started: start counting now, so only the run below is tested.
        busy.last_used = time.monotonic()
        # A run much longer than the idle limit: the reaper passes several times and must let it be.
        result = await run(busy, "sleep 1.0\nprint done", timeout_s=30)
        assert result.outcome.status is RunStatus.OK and result.notice is None
        # Reaped: out of the list at once, closed (its dirs removed) a moment later.
        await until(lambda: idle.close_done is not None and idle.close_done.is_set(), "the idle session to be reaped")
        assert idle not in manager.list() and idle.closed and not idle.workspace.path.exists()
        await until(lambda: manager.list() == [], "the other session to be reaped once idle")


async def test_each_kernel_is_a_new_generation_and_replies_say_whether_state_was_kept(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    session = await scripted.resolve(None)
    assert session.generation == 1 and session.kernel_state() == (1, True)
    await run(session, "die 1")
    assert session.generation == 2 and len(kernels.made) == 2
    assert session.kernel_state(lost=True) == (2, False)
    assert session.kernel_state() == (2, True)
    await session.reset()
    assert session.kernel_state() == (3, False)  # a new kernel the last reply did not name
    assert [kernel.generation for kernel in kernels.made] == [0, 1, 2]
