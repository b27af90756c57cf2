"""The reset standby's state machine (sessions/standby.py) on scripted kernels: which kernel a reset or
a restart hands over, and that a standby's start never outlives its session.

The e2e suite (tests/test_e2e_reset_standby.py) proves the same in real sandboxes; here a start can be
made to hang or a standby to die at a chosen moment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from coderunner.kernel.incarnation import RunStatus
from coderunner.sessions import Session, SessionManager
from coderunner.sessions import session as session_module
from coderunner.sessions import standby as standby_module
from coderunner.sessions.standby import SWAP_IN_CODE
from coderunner.sessions.warm_up import PRELOAD_STEP_CODES
from tests.fakes.backend import FakeBackend
from tests.fakes.kernel import FakeKernel, FakeKernels, KernelCue

from .conftest import ManagerFactory

pytestmark = pytest.mark.anyio

WAIT_S = 20.0
#: A call that runs past STANDBY_BESIDE_CALL_S (as shortened below), so a standby starts beside it, and
#: ends well before STANDBY_PRELOAD_BESIDE_CALL_S, so its preload waits for the session to rest.
LONG_CALL = "sleep 2"


@pytest.fixture(autouse=True)
def shorter_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standby's waits a few times shorter, in the same order (the start delay, then a call's time
    beside which a standby starts, then the rest before its preload; a room poll): the same state machine,
    without seconds of sleep per test. The e2e suite keeps the real ones."""
    monkeypatch.setattr(standby_module, "START_DELAY_S", 0.1)
    monkeypatch.setattr(standby_module, "ROOM_POLL_S", 0.25)
    monkeypatch.setattr(session_module, "STANDBY_BESIDE_CALL_S", 0.3)
    monkeypatch.setattr(session_module, "STANDBY_PRELOAD_REST_S", 1.0)


@pytest.fixture
async def standing(make_scripted: ManagerFactory) -> AsyncIterator[SessionManager]:
    """A scripted manager whose backend gives private files: its sessions keep a standby."""
    async with make_scripted() as manager:
        assert isinstance(manager.backend, FakeBackend)
        manager.backend.private_files = True  # type: ignore[misc]
        yield manager


async def until(condition: object, what: str) -> None:
    with anyio.fail_after(WAIT_S):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.02)


def preloaded(session: Session) -> bool:
    described = session.standby.describe()
    return described is not None and described.get("preloaded") is True


def ready(session: Session) -> FakeKernel:
    kernel = session.standby.kernel
    assert isinstance(kernel, FakeKernel)
    return kernel


async def has(session: Session, name: str) -> str:
    result = await session.run(f"has {name}", None, None)
    assert result.outcome.status is RunStatus.OK
    return result.outcome.output.text().strip()


async def test_a_reset_hands_over_the_ready_standby_under_the_other_sandbox_name(standing: SessionManager) -> None:
    session = await standing.create()
    first = session.kernel
    assert first is not None
    await session.run("set kept 1", None, None)
    await until(lambda: preloaded(session), "the standby to be ready and preloaded")
    standby = ready(session)
    assert {first.spec.name, standby.spec.name} == {first.spec.name, f"{first.spec.name}-b"}
    # Its warm-up, then (the session at rest) the common imports: silent, nothing in its namespace.
    assert standby.executed == ["pass", *PRELOAD_STEP_CODES] and standby.preloads == len(PRELOAD_STEP_CODES)
    await session.reset()
    assert session.kernel is standby and standby.swap_ins == 1
    assert first.process is not None and not first.process.alive
    assert await has(session, "kept") == "False"
    assert session.generation == 2 and session.restarts == 1
    # The next standby takes the name the first kernel let go of.
    await until(lambda: session.standby.kernel is not None, "the next standby")
    assert ready(session).spec.name == first.spec.name


async def test_a_reset_while_the_standby_still_starts_stops_that_start_and_starts_cold(
    standing: SessionManager, kernels: FakeKernels
) -> None:
    session = await standing.create()
    kernels.cue(KernelCue.HANG_AT_START)  # the standby's start never ends by itself
    await until(lambda: len(kernels.made) == 2, "the standby's start")
    hanging = kernels.made[1]
    await session.reset()
    assert session.kernel is kernels.made[2] and session.kernel.alive  # cold
    assert session.generation == 2  # the kernels the session had, not the kernels made
    assert hanging.process is not None and not hanging.process.alive
    assert session.standby.describe() is not None and session.standby.describe()["swapped_in"] == 0  # type: ignore[index]
    await until(lambda: session.standby.kernel is not None, "a new standby")


async def test_a_standby_that_died_is_not_handed_out(standing: SessionManager, kernels: FakeKernels) -> None:
    session = await standing.create()
    await until(lambda: session.standby.kernel is not None, "the standby")
    dead = ready(session)
    dead.fake_process.end(9)
    await session.reset()
    assert session.kernel is not dead and session.kernel is kernels.made[-1] and session.kernel.alive
    assert dead.swap_ins == 0 and session.standby.failed == 1


async def test_a_kernel_death_is_also_replaced_by_the_standby(standing: SessionManager) -> None:
    session = await standing.create()
    await until(lambda: session.standby.kernel is not None, "the standby")
    standby = ready(session)
    died = await session.run("die 1", None, None)
    assert died.outcome.status is RunStatus.DIED and died.state_lost
    assert session.kernel is standby and standby.swap_ins == 1


async def test_closing_while_the_standby_starts_leaves_no_kernel_running(
    standing: SessionManager, kernels: FakeKernels
) -> None:
    session = await standing.create()
    kernels.cue(KernelCue.HANG_AT_START)
    await until(lambda: len(kernels.made) == 2, "the standby's start")
    await standing.close(session.session_id)
    assert all(process.returncode is not None for process in kernels.processes)
    assert session.standby.kernel is None and session.standby.describe()["state"] == "none"  # type: ignore[index]


async def test_closing_with_a_standby_ready_shuts_it_down(standing: SessionManager, kernels: FakeKernels) -> None:
    session = await standing.create()
    await until(lambda: session.standby.kernel is not None, "the standby")
    await standing.close(session.session_id)
    assert len(kernels.processes) == 2 and all(process.returncode is not None for process in kernels.processes)


async def test_without_private_files_no_standby_is_kept(scripted: SessionManager, kernels: FakeKernels) -> None:
    session = await scripted.create()
    await anyio.sleep(0.8)  # past a standby's start delay
    assert len(kernels.made) == 1 and session.standby.describe() is None
    await session.reset()
    assert len(kernels.made) == 2


async def test_all_sessions_standbys_stay_within_the_servers_budget(
    make_scripted: ManagerFactory, kernels: FakeKernels
) -> None:
    """Like the pool's: each fake kernel holds FAKE_MEMORY_MB (80), so a 200 MiB budget keeps two ready;
    a session closed gives its room back, and a waiting session's standby then starts."""
    async with make_scripted(reset_standby_memory_mb=200) as manager:
        assert isinstance(manager.backend, FakeBackend)
        manager.backend.private_files = True  # type: ignore[misc]
        sessions = [await manager.create() for _ in range(4)]

        def ready_count() -> int:
            return sum(session.standby.kernel is not None for session in sessions)

        await until(lambda: ready_count() == 2, "two standbys")
        await anyio.sleep(1.5)  # past the start delay and a room poll: no third one starts
        assert ready_count() == 2 and manager.standby_budget.held_mb <= 200
        assert len(kernels.made) == 6, "no standby was started only to be dropped"
        holder = next(session for session in sessions if session.standby.kernel is not None)
        await manager.close(holder.session_id)
        await until(lambda: ready_count() == 2 and holder.standby.kernel is None, "the freed room taken")
        assert manager.standby_budget.held_mb <= 200
        # A reset swaps to a ready one and hands its room back to whoever waits.
        taker = next(session for session in sessions if session.standby.kernel is not None and session is not holder)
        await taker.reset()
        await until(lambda: ready_count() == 2, "the room taken again")
        assert manager.standby_budget.held_mb <= 200


async def test_a_zero_budget_keeps_no_standby(make_scripted: ManagerFactory, kernels: FakeKernels) -> None:
    async with make_scripted(reset_standby_memory_mb=0) as manager:
        assert isinstance(manager.backend, FakeBackend)
        manager.backend.private_files = True  # type: ignore[misc]
        session = await manager.create()
        await anyio.sleep(1.0)
        assert len(kernels.made) == 1 and session.standby.kernel is None


async def test_without_preload_imports_a_standby_warms_up_with_a_no_op(make_scripted: ManagerFactory) -> None:
    async with make_scripted(preload_imports=False) as manager:
        assert isinstance(manager.backend, FakeBackend)
        manager.backend.private_files = True  # type: ignore[misc]
        session = await manager.create()
        await until(lambda: session.standby.kernel is not None, "the standby to be ready")
        assert ready(session).executed == ["pass"] and ready(session).preloads == 0


async def test_the_standbys_preload_waits_for_the_session_to_rest(standing: SessionManager) -> None:
    session = await standing.create()
    async with anyio.create_task_group() as tg:
        tg.start_soon(session.run, LONG_CALL, None, None)
        # Started beside the call (it has run STANDBY_BESIDE_CALL_S), warmed up, but not preloaded while it runs.
        await until(lambda: any(k.executed == ["pass"] for k in session.standby.kernels()), "the standby's warm-up")
        starting = session.standby.kernels()[0]
        assert isinstance(starting, FakeKernel) and session.busy and starting.preloads == 0
    await until(lambda: preloaded(session), "the standby's preload")
    assert ready(session) is starting and starting.executed == ["pass", *PRELOAD_STEP_CODES]


async def test_a_reset_before_the_preload_began_takes_the_standby_as_it_is(standing: SessionManager) -> None:
    session = await standing.create()
    async with anyio.create_task_group() as tg:
        tg.start_soon(session.run, LONG_CALL, None, None)
        await until(lambda: session.standby.kernel is not None, "the standby's warm-up")
        standby = ready(session)
    await session.reset()  # at once: the session has not rested, so no preload had begun
    assert session.kernel is standby and standby.executed == ["pass", SWAP_IN_CODE] and standby.preloads == 0
    await until(lambda: preloaded(session), "the next standby's preload")
    assert standby.preloads == 0  # the kernel handed over never ran it


class StartingTemplate:
    """A kernel starter whose start is under way until `done` is set (its only part a standby asks of it)."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.asked = 0

    async def settled(self) -> None:
        self.asked += 1
        await self.done.wait()


async def test_a_standby_waits_for_a_starting_template_rather_than_start_cold(
    standing: SessionManager, kernels: FakeKernels
) -> None:
    """Nobody waits for a standby: in a server's first seconds it forks from the template once that is up
    rather than start a kernel cold beside it (a user's start waits only so long: template_kernels.py)."""
    template = StartingTemplate()
    standing.backend.kernel_starter = template  # type: ignore[assignment]
    session = await standing.create()
    await until(lambda: template.asked == 1, "the standby to ask for the template")
    await anyio.sleep(0.3)
    assert len(kernels.made) == 1 and session.standby.kernel is None  # the session's own kernel only
    template.done.set()
    await until(lambda: session.standby.kernel is not None, "the standby, once the template is up")
    await standing.close(session.session_id)
