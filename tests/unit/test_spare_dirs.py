"""A session's dirs made ahead (sessions/leases.py: keep_spare): a create with the server's defaults takes them and
the next are made in the background; any other create makes its own; the server's close removes what it kept."""

from __future__ import annotations

import os

import anyio
import pytest

from coderunner.hostfs.blank_images import BLANK
from coderunner.hostfs.session_dirs import MADE_AHEAD
from coderunner.vocabulary.sandbox_request import SandboxRequest

from .conftest import ManagerFactory

pytestmark = pytest.mark.anyio


def workspace_names(manager: object) -> set[str]:
    workspaces = manager.settings.workspaces_dir  # type: ignore[attr-defined]
    return {name for name in os.listdir(workspaces) if not name.endswith(".img")}


async def spare_key(manager: object) -> str:
    """The key of the dirs kept ahead, once they are made (bounded)."""
    with anyio.fail_after(30):
        key = await manager.leases.spare_key()  # type: ignore[attr-defined]
    assert key is not None
    return key


async def test_a_default_create_takes_the_dirs_made_ahead_and_the_next_are_made(make_scripted: ManagerFactory) -> None:
    # As root, a capped workspace: an image (a copy of the blank) loop-mounted, as a root server's are.
    async with make_scripted(disk_mb=64, workspace_quota=os.getuid() == 0) as manager:
        settings = manager.settings
        first = await spare_key(manager)
        assert workspace_names(manager) == {first}  # made ahead, before any create
        assert (settings.runtime_dir / first / MADE_AHEAD).exists()  # and marked so
        session = await manager.create()
        assert session.lease.dirs.key == first
        assert not (settings.runtime_dir / first / MADE_AHEAD).exists()  # a session's now
        second = await spare_key(manager)
        assert second != first and workspace_names(manager) == {first, second}
        assert (settings.runtime_dir / second / MADE_AHEAD).exists()
        await manager.close(session.session_id)
        assert workspace_names(manager) == {second}
    left = [name for name in os.listdir(settings.workspaces_dir) if not BLANK.fullmatch(name)]
    assert left == []  # the close removed the dirs kept ahead, image and all (the blank is a cache)
    assert [name for name in os.listdir(settings.runtime_dir) if len(name) == 8] == []


async def test_a_create_with_other_options_makes_its_own(make_scripted: ManagerFactory) -> None:
    async with make_scripted() as manager:
        kept = await spare_key(manager)
        for request in (SandboxRequest(name="n1", persistent=True), SandboxRequest(name="n2", persistent=True)):
            session = await manager.create(manager.options(request))
            assert session.lease.dirs.key != kept
            assert await manager.leases.spare_key() == kept
            await manager.close(session.session_id)
