"""The manager's side of snapshots on scripted kernels: options, and a shutdown that waits for itself."""

from __future__ import annotations

import anyio
import pytest

from coderunner.sessions import SessionError
from coderunner.vocabulary.sandbox_request import SandboxRequest

from .conftest import ManagerFactory

pytestmark = pytest.mark.anyio


async def test_keep_state_is_only_for_a_named_persistent_session(make_scripted: ManagerFactory) -> None:
    async with make_scripted() as manager:
        with pytest.raises(SessionError, match="keep_state needs persistent=true and a name"):
            manager.options(SandboxRequest(keep_state=True))
        with pytest.raises(SessionError, match="keep_state needs persistent=true"):
            manager.options(SandboxRequest(name="x", keep_state=True))
        options = manager.options(SandboxRequest(name="x", persistent=True, keep_state=True))
        assert options.keep_state and options.persistent


async def test_a_second_close_all_waits_for_the_first(make_scripted: ManagerFactory) -> None:
    async with make_scripted() as manager:
        sessions = [await manager.create() for _ in range(2)]
        finished: list[str] = []

        async def close(tag: str) -> None:
            await manager.close_all()
            finished.append(tag)
            # Whoever returns, every session is closed by then: a signal handler that exits right after
            # its close_all can no longer cut the first one short.
            assert all(session.closed for session in sessions)
            assert all(session.kernel is None for session in sessions)

        async with anyio.create_task_group() as tg:
            tg.start_soon(close, "first")
            await anyio.sleep(0)
            tg.start_soon(close, "second")
        assert sorted(finished) == ["first", "second"]
