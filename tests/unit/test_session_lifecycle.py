"""More of a session's life: cancelled calls, lost output, guest calls, progress, status,
persistent names, and what the manager leaves when it stops.

On scripted kernels (tests/fakes/kernel.py), but for what only a real kernel process shows (a
message over the channel bound, the memory of a process tree): those run a real ipykernel."""

from __future__ import annotations

import os

import anyio
import pytest
from pydantic import ValidationError

from coderunner.config import Settings
from coderunner.kernel.incarnation import KernelStartError, RunStatus
from coderunner.kernel.output_capture import OutputCollector
from coderunner.sessions import GuestCallError, SessionBusy, SessionError, SessionManager
from coderunner.vocabulary.sandbox_request import SandboxRequest
from tests.fakes.backend import FakeBackend
from tests.fakes.kernel import FAKE_MEMORY_MB, FakeKernels, KernelCue

from .conftest import ManagerFactory
from .test_session_states import HANG, fake, run, text, until

pytestmark = pytest.mark.anyio


def test_no_setting_selects_the_fake_backend() -> None:
    with pytest.raises(ValidationError, match="backend"):
        Settings(backend="fake")
    with pytest.raises(ValidationError, match="backend"):
        Settings(backend=FakeBackend.name)


async def test_a_cancelled_run_is_interrupted_and_the_state_kept(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "set kept 7")
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, session, HANG, 60)
        await until(lambda: session.busy, "the run to start")
        tg.cancel_scope.cancel()
    assert not session.busy and session.restarts == 0
    assert "7" in text(await run(session, "get kept"))


async def test_a_cancelled_run_that_ignores_the_interrupt_gets_a_fresh_kernel(
    scripted: SessionManager, kernels: FakeKernels
) -> None:
    kernels.cue(KernelCue.IGNORE_INTERRUPTS)
    session = await scripted.resolve(None)
    stuck = session.kernel
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, session, HANG, 60)
        await until(lambda: session.busy, "the run to start")
        tg.cancel_scope.cancel()
    assert stuck is not None and stuck.process is not None and not stuck.process.alive
    assert session.restarts == 1 and session.kernel is not stuck
    assert "2" in text(await run(session, "print 2"))


async def test_an_oversized_message_is_dropped_and_the_reply_says_so(manager: SessionManager) -> None:
    session = await manager.resolve(None)
    # One display message over the host's 32 MiB bound (stream output would come in chunks).
    code = "from IPython.display import display\ndisplay({'text/plain': 'x' * (33 * 2**20)}, raw=True)\n'after'"
    result = await run(session, code)
    assert result.outcome.status is RunStatus.OK and result.outcome.output_lost
    assert "some output was lost" in (result.notice or "")
    assert "after" in text(result) and len(text(result)) < 2 * manager.settings.output_limit_chars


async def test_progress_is_reported_while_a_run_goes_on(make_scripted: ManagerFactory) -> None:
    async with make_scripted(progress_interval_s=0.1) as manager:
        session = await manager.resolve(None)
        seen: list[tuple[float, str]] = []

        async def progress(elapsed_s: float, output: OutputCollector) -> None:
            seen.append((elapsed_s, output.tail_text(100)))

        code = "print step 0; sleep 0.1; print step 1; sleep 0.1; print step 2; sleep 0.1; print step 3; sleep 0.1"
        result = await session.run(code, None, progress)
        assert result.outcome.status is RunStatus.OK
        assert seen and any("step" in tail for _elapsed, tail in seen)
        assert [elapsed for elapsed, _ in seen] == sorted(elapsed for elapsed, _ in seen)


async def test_guest_calls_answer_or_raise_with_the_reason(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    assert await session.call_guest("variables", {"values": {"n": 3}}, timeout_s=20) is not None
    assert "3" in text(await run(session, "get n"))
    with pytest.raises(GuestCallError, match="no_such_tool"):
        await session.call_guest("no_such_tool", {}, timeout_s=20)


async def test_a_guest_call_waits_for_a_busy_kernel_then_says_busy(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, session, HANG, 60)
        await until(lambda: session.busy, "the run to start")
        with pytest.raises(SessionBusy):
            await session.call_guest("variables", {"values": {"n": 1}}, timeout_s=0.3)
        tg.cancel_scope.cancel()


async def test_install_packages_without_network_says_how_to_get_it(make_scripted: ManagerFactory) -> None:
    async with make_scripted(max_network="internet") as manager:
        session = await manager.resolve(None)
        with pytest.raises(SessionError, match=r"create_session\(network='internet'\)"):
            await session.install_packages(["six"], timeout_s=10)
    async with make_scripted() as manager:  # the user allows no network: nothing above it is named
        session = await manager.resolve(None)
        with pytest.raises(SessionError, match="ask the user") as refused:
            await session.install_packages(["six"], timeout_s=10)
        assert "network=" not in str(refused.value)


async def test_status_tells_the_truth_about_a_live_and_a_dead_kernel(manager: SessionManager) -> None:
    session = await manager.resolve(None)
    await run(session, "block = bytearray(64 * 2**20)")
    status = await session.status()
    assert status.alive and not status.busy and status.restarts == 0
    assert status.memory_used_mb is not None and status.memory_used_mb > 64  # the process tree's RSS
    assert status.isolation == fake(manager).describe_isolation()
    assert status.limits["memory_mb"].enforced_by is None  # the fake enforces nothing, and says so
    assert session.kernel is not None and session.kernel.process is not None
    await session.kernel.process.kill()
    dead = await session.status()
    assert not dead.alive and dead.memory_used_mb is None and dead.kernel_uptime_s == 0.0


async def test_a_persistent_session_keeps_its_files_for_the_next_one(scripted: SessionManager) -> None:
    manager = scripted
    options = manager.options(SandboxRequest(name="notes", persistent=True))
    first = await manager.create(options)
    await run(first, "write kept.txt from the first")
    await manager.close(first.session_id)
    assert first.workspace.path.exists()
    second = await manager.create(manager.options(SandboxRequest(name="notes", persistent=True)))
    assert second.workspace.path == first.workspace.path and second.workspace.reopened
    assert "from the first" in text(await run(second, "read kept.txt"))
    with pytest.raises(SessionError, match="needs a name"):
        manager.options(SandboxRequest(persistent=True))


async def test_stopping_the_manager_ends_every_sandbox_and_removes_their_dirs(
    make_scripted: ManagerFactory, kernels: FakeKernels
) -> None:
    async with anyio.create_task_group() as tg, make_scripted() as manager:
        sessions = [await manager.create() for _ in range(2)]
        tg.start_soon(run, sessions[0], HANG, 60)
        await until(lambda: sessions[0].busy, "the run to start")
        runtime = manager.settings.runtime_dir
        # The manager has stopped while a run was going on.
    assert kernels.processes and not any(process.alive for process in kernels.processes)
    assert [name for name in os.listdir(runtime) if len(name) == 8] == []
    assert not any(session.workspace.path.exists() for session in sessions)


async def test_dirs_left_by_a_killed_server_are_removed_on_start(make_scripted: ManagerFactory) -> None:
    async with make_scripted() as manager:
        session = await manager.create()
        top, workspace = session.dirs.top, session.workspace.path
        # As if the server were SIGKILLed: its lock goes with it, its dirs stay.
        assert session.kernel is not None and session.kernel.process is not None
        await session.kernel.process.kill()
        os.close(session.dirs.lock_fd)
        manager._sessions.clear()
        assert top.exists() and workspace.exists()
    async with make_scripted():
        assert not top.exists() and not workspace.exists()


async def test_the_idle_reaper_leaves_a_starting_session_alone(
    make_scripted: ManagerFactory, kernels: FakeKernels
) -> None:
    # A start that outlasts idle_timeout_s (a loaded machine) ends by its own bound, not by the reaper.
    async with make_scripted(idle_timeout_s=0.3, startup_timeout_s=1.0) as manager:
        kernels.cue(KernelCue.HANG_AT_START)
        with pytest.raises(KernelStartError, match="did not answer in time"):
            await manager.create()
        assert manager.list() == []


async def test_status_reports_a_scripted_kernels_memory_and_its_death(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    await run(session, "print warm")
    status = await session.status()
    assert status.alive and not status.busy and status.restarts == 0 and status.kernel_generation == 1
    assert status.memory_used_mb == FAKE_MEMORY_MB and status.usage["memory_mb"] == FAKE_MEMORY_MB
    assert status.network == "none" and status.workspace == FakeBackend.workspace_path and status.job is None
    assert session.kernel is not None and session.kernel.process is not None
    await session.kernel.process.kill()
    dead = await session.status()
    assert not dead.alive and dead.memory_used_mb is None and dead.kernel_uptime_s == 0.0


async def test_status_names_the_running_job(scripted: SessionManager) -> None:
    session = await scripted.resolve(None)
    job = await session.start_run("print started\nhang", None)
    await until(lambda: session.busy, "the cell to start")
    status = await session.status()
    assert status.busy and status.idle_s == 0.0
    assert status.job is not None and status.job["job_id"] == job.job_id
    await session.reset()
