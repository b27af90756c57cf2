"""The warm pool: its state machine with stand-in members, then on scripted kernels through the
SessionManager (what a taker gets, what it never gets, and what is left when the server stops)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from coderunner.sessions import Session, SessionError
from coderunner.sessions.pool import WarmPool
from coderunner.sessions.warm_up import PRELOAD_CODE
from coderunner.vocabulary.sandbox_request import SandboxRequest
from tests.fakes.kernel import FakeKernel, FakeKernels

from .conftest import ManagerFactory
from .test_session_states import fake, run, text, until

pytestmark = pytest.mark.anyio


@dataclass
class Member:
    number: int
    alive: bool = True
    closed: bool = False


@dataclass
class Starts:
    """Stand-in start/discard: counts, can be told to fail or to block until released."""

    made: list[Member] = field(default_factory=list)
    fail: bool = False
    gate: anyio.Event | None = None
    cleaned_up: int = 0
    room: bool = True
    mb: float | None = None

    async def start(self) -> Member:
        if self.gate is not None:
            try:
                await self.gate.wait()
            except BaseException:
                self.cleaned_up += 1  # what a real start does when cancelled: it removes its sandbox
                raise
        if self.fail:
            raise RuntimeError("no sandbox today")
        member = Member(len(self.made))
        self.made.append(member)
        return member

    async def discard(self, member: Member) -> None:
        member.closed = True

    def pool(self, size: int = 2, budget_mb: float = 10_000) -> WarmPool[Member]:
        return WarmPool(
            size=size,
            memory_budget_mb=budget_mb,
            start=self.start,
            discard=self.discard,
            alive=lambda member: member.alive,
            room=lambda: self.room,
            measure_mb=lambda member: self.mb,
        )


async def test_it_fills_to_size_and_refills_what_is_taken() -> None:
    starts = Starts()
    pool = starts.pool(size=2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().ready == 2, "the pool to fill")
        first = pool.take()
        assert first is not None and first.number == 0
        await until(lambda: pool.stats().ready == 2, "the pool to refill")
        assert len(starts.made) == 3 and pool.stats().taken == 1
        await pool.drain()
        tg.cancel_scope.cancel()
    # Everything the pool still held is closed; what was taken is the taker's and stays open.
    assert [m.closed for m in starts.made] == [False, True, True]


async def test_it_refills_only_into_room_the_manager_grants() -> None:
    starts = Starts(room=False)
    pool = starts.pool(size=2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await anyio.sleep(0.2)
        assert pool.take() is None and starts.made == []
        starts.room = True
        pool.notify()
        await until(lambda: pool.stats().ready == 2, "the pool to fill once there is room")
        await pool.drain()
        tg.cancel_scope.cancel()


async def test_it_stops_at_its_memory_budget() -> None:
    starts = Starts(mb=300.0)
    pool = starts.pool(size=4, budget_mb=700)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().ready == 2, "two members (600 MiB of a 700 MiB budget)")
        await anyio.sleep(0.2)
        assert pool.stats().ready == 2 and pool.stats().member_mb == 300.0
        await pool.drain()
        tg.cancel_scope.cancel()


async def test_a_member_over_the_budget_is_never_offered() -> None:
    starts = Starts(mb=300.0)
    pool = starts.pool(size=2, budget_mb=200)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().discarded == 1, "the measured member to be closed")
        await anyio.sleep(0.2)
        assert pool.take() is None and len(starts.made) == 1 and starts.made[0].closed
        await pool.drain()
        tg.cancel_scope.cancel()


async def test_failed_starts_back_off_and_leave_takers_cold() -> None:
    starts = Starts(fail=True)
    pool = starts.pool(size=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().failed >= 1, "a start to fail")
        assert pool.take() is None
        assert await pool.take_or_wait(0.5) is None  # nothing under way worth waiting for
        assert pool.stats().failed == 1  # backing off, not spinning
        await pool.drain()
        tg.cancel_scope.cancel()


async def test_a_dead_member_is_never_handed_out_and_is_closed() -> None:
    starts = Starts()
    pool = starts.pool(size=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().ready == 1, "the pool to fill")
        starts.made[0].alive = False
        assert pool.take() is None
        await until(lambda: starts.made[0].closed, "the dead member to be closed")
        await until(lambda: pool.stats().ready == 1, "a live replacement")
        member = pool.take()
        assert member is not None and member.number == 1
        await pool.drain()
        tg.cancel_scope.cancel()


async def test_take_or_wait_waits_for_the_start_under_way() -> None:
    starts = Starts(gate=anyio.Event())
    pool = starts.pool(size=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().starting == 1, "a start to begin")
        assert pool.take() is None

        async def release() -> None:
            await anyio.sleep(0.1)
            assert starts.gate is not None
            starts.gate.set()

        tg.start_soon(release)
        member = await pool.take_or_wait(10)
        assert member is not None and member.number == 0
        await pool.drain()
        tg.cancel_scope.cancel()


async def test_drain_cancels_a_start_under_way_and_it_cleans_up() -> None:
    starts = Starts(gate=anyio.Event())
    pool = starts.pool(size=2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().starting == 1, "a start to begin")
        with anyio.fail_after(10):
            await pool.drain()
        assert starts.cleaned_up == 1 and starts.made == []
        assert pool.take() is None
        tg.cancel_scope.cancel()


# Through the manager, on scripted kernels (tests/fakes/kernel.py).


async def test_a_default_session_comes_from_the_pool_and_starts_clean(make_scripted: ManagerFactory) -> None:
    async with make_scripted(pool_size=1) as manager:
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        first = await manager.resolve(None, "tok/client:alice")
        assert manager.pool.stats().taken == 1 and first.owner == "tok/client:alice"
        await run(first, "set secret 41\nwrite left-behind.txt x")
        first_dirs = first.dirs
        await manager.close(first.session_id)
        await until(lambda: manager.pool.stats().ready == 1, "the pool to refill")
        second = await manager.resolve(None, "tok/client:bob")
        assert manager.pool.stats().taken == 2
        assert second.dirs.key != first_dirs.key and second.workspace.path != first_dirs.workspace.path
        assert second.dirs.user is None or second.dirs.user.uid != first_dirs.user.uid  # type: ignore[union-attr]
        found = text(await run(second, "has secret\nls"))
        assert "False" in found and "left-behind" not in found
        assert second.session_id != first.session_id and second.options.client == "local"


def kernel_of(session: Session) -> FakeKernel:
    assert isinstance(session.kernel, FakeKernel)
    return session.kernel


async def test_a_pooled_kernel_ran_the_preload_and_a_cold_one_did_not(make_scripted: ManagerFactory) -> None:
    async with make_scripted(pool_size=1) as manager:
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        pooled, cold = (
            kernel_of(await manager.create()),
            kernel_of(await manager.create(manager.options(SandboxRequest(memory_mb=1024)))),
        )
        assert manager.pool.stats().taken == 1
        assert pooled.executed[:1] == [PRELOAD_CODE] and pooled.preloads == 1 and pooled.execution_count == 0
        assert cold.preloads == 0  # a cold kernel's first reply waits for nothing of ours


async def test_non_default_options_start_cold(make_scripted: ManagerFactory) -> None:
    async with make_scripted(pool_size=1) as manager:
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        cold = await manager.create(manager.options(SandboxRequest(memory_mb=1024)))
        named = await manager.create(manager.options(SandboxRequest(name="proj")))
        assert manager.pool.stats().taken == 0 and manager.pool.stats().ready == 1
        assert "2" in text(await run(cold, "print 2")) and named.options.name == "proj"


async def test_the_client_is_bound_at_take(make_scripted: ManagerFactory) -> None:
    async with make_scripted(pool_size=1) as manager:
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        session = await manager.create(manager.options(SandboxRequest(client="t.alice")), owner="alice/x")
        assert manager.pool.stats().taken == 1
        assert session.options.client == "t.alice" and session.owner == "alice/x"
        assert manager.list("alice/x") == [session]


async def test_the_pool_never_makes_a_users_create_fail(make_scripted: ManagerFactory) -> None:
    async with make_scripted(pool_size=2, max_sessions=2) as manager:
        await until(lambda: manager.pool.stats().ready == 2, "the pool to fill all the room")
        first = await manager.create(manager.options(SandboxRequest(memory_mb=1024)))  # cold: a pooled one gives way
        second = await manager.create(manager.options(SandboxRequest(memory_mb=1024)))
        assert len(manager.list()) == 2 and manager.pool.stats().ready == 0
        with pytest.raises(SessionError, match="session limit reached"):
            await manager.create()
        await manager.close(first.session_id)
        await until(lambda: manager.pool.stats().ready == 1, "the freed room to go to the pool")
        assert second in manager.list()


async def test_pool_size_zero_starts_nothing_ahead(make_scripted: ManagerFactory, kernels: FakeKernels) -> None:
    async with make_scripted(pool_size=0) as manager:
        await anyio.sleep(0.3)
        assert kernels.made == []
        session = await manager.resolve(None)
        assert "2" in text(await run(session, "print 2")) and manager.pool.stats().taken == 0


async def test_stopping_the_manager_leaves_no_pooled_process(
    make_scripted: ManagerFactory, kernels: FakeKernels
) -> None:
    async with make_scripted(pool_size=2) as manager:
        await until(lambda: manager.pool.stats().ready == 2, "the pool to fill")
        await manager.resolve(None)
        await until(lambda: manager.pool.stats().ready + manager.pool.stats().starting == 2, "a refill to begin")
        spawned = kernels.processes
        backend = fake(manager)
    assert len(spawned) >= 2 and not any(process.alive for process in spawned)
    assert not any(backend.root.parent.joinpath("w").iterdir())


async def test_exports_go_to_the_takers_folder_only(make_scripted: ManagerFactory, root: Path) -> None:
    exports = root / "exports"
    async with make_scripted(pool_size=1, export_dir=exports) as manager:
        await until(lambda: manager.pool.stats().ready == 1, "the pool to fill")
        session = await manager.create(manager.options(SandboxRequest(client="t.alice")), owner="alice/x")
        assert manager.pool.stats().taken == 1
        await run(session, "write .coderunner/outputs/made.txt x")
        assert (exports / "t.alice" / "made.txt").read_text() == "x"
        await until(lambda: manager.pool.stats().ready == 1, "the pool to refill")
    # The untaken member was closed without copying anywhere: no folder for the placeholder client.
    assert sorted(path.name for path in exports.iterdir()) == ["t.alice"]


async def test_why_it_had_nothing_ready_says_what_it_waits_for() -> None:
    """A cold session's status says why the pool had no member for it: one starting, a back-off after a failed
    start (and that start's error), no room, a budget too small for another member."""
    starts = Starts(gate=anyio.Event())
    pool = starts.pool(size=1, budget_mb=100)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().starting == 1, "a start under way")
        assert pool.why_empty() == "the warm pool had no sandbox ready (one is starting)"
        starts.fail = True
        starts.gate.set()
        await until(lambda: pool.stats().failed == 1, "the start to fail")
        said = pool.why_empty()
        assert said.startswith("the warm pool had no sandbox ready (it starts again in ") and said.endswith(
            "s after a failed start; its last failed start: no sandbox today)"
        ), said
        await pool.drain()
    starts = Starts(room=False)
    pool = starts.pool(size=1)
    assert "no room is left under max_sessions" in pool.why_empty()
    starts = Starts(mb=150)
    pool = starts.pool(size=1, budget_mb=100)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await until(lambda: pool.stats().discarded == 1, "a member measured over the budget discarded")
        assert pool.why_empty() == (
            "the warm pool had no sandbox ready (another member (150 MiB measured) would not fit pool_memory_mb)"
        )
        await pool.drain()
    assert pool.why_empty() == "the warm pool had no sandbox ready (it is closed)"
    starts = Starts()
    pool = starts.pool(size=1, budget_mb=0)  # pool_memory_mb 0: nothing measured, nothing may start
    assert pool.why_empty() == "the warm pool had no sandbox ready (another member would not fit pool_memory_mb)"
