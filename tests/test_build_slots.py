"""Sandboxes built at once (sandbox/build_slots.py), on real bwrap sandboxes of a real SessionManager.

Creates started together build at most BUILDS_AT_ONCE sandboxes at a time (from a start's clones to its pid 1's
init), all of them answer, and every slot comes back: after a burst, after a build bwrap refuses, and after a
create cancelled mid-build.
"""

from __future__ import annotations

import os
import shutil
from typing import Any
from unittest import mock

import anyio
import pytest

from coderunner.kernel.process import KernelStartError
from coderunner.sandbox import build_slots, bwrap, make_backend
from coderunner.sandbox.bwrap import BwrapBackend
from coderunner.sessions.manager import SessionManager

from .conftest import ServerDirs, server_env, server_settings

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

SLOTS = 2
TOGETHER = 6


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_builds_in_flight_stay_within_their_slots_and_every_slot_comes_back(
    dirs: ServerDirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bwrap's")
    monkeypatch.setattr(build_slots, "BUILDS_AT_ONCE", SLOTS)
    env = server_env(dirs, CODERUNNER_RESET_STANDBY="0", CODERUNNER_MAX_SESSIONS=str(TOGETHER + 2))
    settings = server_settings(env)
    if settings.backend != "bwrap":
        pytest.skip("bwrap's")
    building = [0]
    most = [0]
    stage, wait_built = BwrapBackend._stage, bwrap.wait_built

    def counted_stage(self: BwrapBackend, spec: Any) -> Any:  # a build begins: its clones are made
        building[0] += 1
        most[0] = max(most[0], building[0])
        return stage(self, spec)

    async def counted_wait_built(child: int | None) -> bool:  # and ends: its pid 1 runs the init
        try:
            return await wait_built(child)
        finally:
            building[0] -= 1

    monkeypatch.setattr(BwrapBackend, "_stage", counted_stage)
    monkeypatch.setattr(bwrap, "wait_built", counted_wait_built)
    with mock.patch.dict(os.environ, env):
        async with SessionManager(settings, make_backend(settings)) as manager:
            answers: list[str] = []

            async def one() -> None:
                session = await manager.create()
                result = await session.run("6*7", 120, None)
                answers.append("".join(result.outcome.output.head).strip())
                await manager.close(session.session_id)

            with anyio.fail_after(300):
                async with anyio.create_task_group() as group:
                    for _ in range(TOGETHER):
                        group.start_soon(one)
            assert answers == ["42"] * TOGETHER, answers
            assert 1 <= most[0] <= SLOTS, f"{most[0]} builds were in flight at once, {SLOTS} allowed"
            assert (building[0], build_slots.build_slots().value) == (0, SLOTS), "every build's slot came back"

            # A build bwrap refuses (a bind of a source that does not exist) gives its slot back too.
            argv = bwrap.BwrapCommand.argv

            def refused(self: Any, *args: Any, **kwargs: Any) -> list[str]:
                full = argv(self, *args, **kwargs)
                at = full.index("--")
                return [*full[:at], "--ro-bind", "/nonexistent-build-slots-source", "/x", *full[at:]]

            with (
                mock.patch.object(bwrap.BwrapCommand, "argv", refused),
                pytest.raises(KernelStartError, match="nonexistent-build-slots-source"),
            ):
                await manager.create()
            # A create cancelled once its build began gives it back as well.
            with anyio.CancelScope() as scope:

                async def cancel_once_building() -> None:
                    while not building[0]:
                        await anyio.sleep(0.001)
                    scope.cancel()

                async with anyio.create_task_group() as group:
                    group.start_soon(cancel_once_building)
                    await manager.create()
            assert scope.cancelled_caught, "the create was cancelled mid-build"
            with anyio.fail_after(30):  # a build's end is waited for in the background, shortly
                while build_slots.build_slots().value != SLOTS:
                    await anyio.sleep(0.05)
            session = await manager.create()
            result = await session.run("6*7", 120, None)
            assert "".join(result.outcome.output.head).strip() == "42", "the server still starts sandboxes"
