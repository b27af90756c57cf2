"""The warm pool through the MCP client, on the real backend: a pooled session starts clean, options a
running sandbox cannot be given start cold (those it can: test_e2e_pool_take.py), pool_size=0 starts
nothing ahead, and a stopped server leaves nothing running.
On gvisor too: a pooled sandbox there runs behind the channel relay, so its memory can be saved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest
from mcp import Client

from .conftest import (
    ServerDirs,
    memory_client,
    open_client,
    run,
    sandbox_processes_alive,
    server_env,
    stdio_client,
    text_of,
    wait_until,
)
from .test_e2e_client_tokens import call
from .test_e2e_gvisor_memory import gvisor_image  # noqa: F401  (the gvisor image fixture)
from .test_e2e_podman import podman_image  # noqa: F401  (what gvisor_image builds on)
from .test_e2e_snapshots import output

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: Bound on waiting for the pool to have a sandbox ready for the next default create: a pooled start gets only
#: idle CPU (sandbox/cgroups.py), so on a machine loaded by the other suites it may take a minute and more.
POOL_WAIT_S = 180.0
#: Pause before asking again after a create found none ready: room for the pool's start (each create that
#: found none starts a sandbox cold beside it).
RETRY_PAUSE_S = 2.0


def workspaces(dirs: ServerDirs) -> set[str]:
    """The sandboxes' workspace dirs (as root each has a quota image beside it, NAME.img), not the one made ahead
    for a create."""
    if not dirs.workspaces.exists():
        return set()
    return {path.name for path in dirs.session_workspaces() if path.is_dir()}


def workspace_holding(dirs: ServerDirs, marker: str) -> Path:
    """The host workspace dir holding the file `marker` (the test wrote it from inside)."""
    found = [dirs.workspaces / key for key in workspaces(dirs) if (dirs.workspaces / key / marker).is_file()]
    assert len(found) == 1, found
    return found[0]


async def create(client: Client, **arguments: object) -> str:
    result = await client.call_tool("create_session", arguments)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))["session_id"]


async def pooled_session(client: Client, dirs: ServerDirs, marker: str) -> tuple[str, Path]:
    """A default create_session that took a pooled sandbox (its workspace existed before the call).

    Until the pool has one ready a create may start cold; such a session is closed and the test
    asks again, within POOL_WAIT_S, then fails: the pool must serve a default create.
    """
    why = "none asked"
    with anyio.move_on_after(POOL_WAIT_S):
        while True:
            before = workspaces(dirs)
            session_id = await create(client)
            reply = text_of(await run(client, f"open({marker!r}, 'w').write('x')", session_id=session_id))
            where = workspace_holding(dirs, marker)
            if where.name in before:
                assert "cell 1]" in reply, reply  # the pool's warm-up cell left no count behind
                return session_id, where
            why = (await call(client, "manage_sessions", action="status", session_id=session_id))["started"]["why"]
            await client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
            await anyio.sleep(RETRY_PAUSE_S)
    pytest.fail(f"no default create_session took a pooled sandbox within {POOL_WAIT_S:g}s; the last said: {why}")


async def test_a_pooled_session_starts_clean(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_POOL_SIZE="1")) as client:
        first, first_dir = await pooled_session(client, dirs, "marker-a")
        first_uid = first_dir.stat().st_uid
        assert not (await run(client, "secret = 41\nopen('left.txt', 'w').write('x')", session_id=first)).is_error
        await client.call_tool("manage_sessions", {"action": "close", "session_id": first})
        second, second_dir = await pooled_session(client, dirs, "marker-b")
        assert second_dir != first_dir
        if os.getuid() == 0:  # a root server gives each sandbox a host uid of its own
            assert second_dir.stat().st_uid != first_uid
        seen = text_of(await run(client, "import os\nprint('secret' in globals(), sorted(os.listdir('.')))",
                                 session_id=second))  # fmt: skip
        assert "False" in seen and "left.txt" not in seen and "marker-a" not in seen, seen


#: A thread that counts into `ticks`, and a variable: what only a memory snapshot brings back.
LIVE_CELL = """
import threading, time
ticks = []
def _tick():
    while True:
        ticks.append(1)
        time.sleep(0.02)
threading.Thread(target=_tick, daemon=True).start()
secret = 41
"""
PROBE = "import time\nbefore = len(ticks)\ntime.sleep(0.3)\nprint(secret + 1, len(ticks) > before)"


async def test_a_pooled_gvisor_session_starts_clean_and_its_memory_is_saved(
    gvisor_image: str,  # noqa: F811
    dirs: ServerDirs,
) -> None:
    env = server_env(dirs, CODERUNNER_BACKEND="gvisor", CODERUNNER_IMAGE=gvisor_image, CODERUNNER_POOL_SIZE="1")
    async with stdio_client(env) as client:
        session, _ = await pooled_session(client, dirs, "marker-gvisor")
        await output(client, LIVE_CELL, session)
        taken = await call(client, "manage_snapshots", action="save", session_id=session, name="pooled")
        assert "memory" in taken and "thread" in taken["memory"], taken
        assert "42 True" in await output(client, PROBE, session)  # the original runs on after its checkpoint
        restored = await call(client, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
        assert restored["session_id"] != session and restored["restored"], restored
        assert "42 True" in await output(client, PROBE, restored["session_id"])


async def test_non_default_options_start_cold(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_POOL_SIZE="1")) as client:
        await pooled_session(client, dirs, "marker-warm")  # the pool works here
        assert await wait_until(lambda: len(workspaces(dirs)) == 2, timeout_s=POOL_WAIT_S), "the pool to refill"
        before = workspaces(dirs)
        # More memory than the pool's sandboxes have (a running sandbox's limits only go down), a name, and
        # both with another run limit (which alone a pooled sandbox is given at take).
        for options in ({"memory_mb": 4096}, {"name": "proj"}, {"network": "none", "timeout_s": 20, "memory_mb": 3072}):
            session_id = await create(client, **options)
            marker = "marker-" + "-".join(options)
            await run(client, f"open({marker!r}, 'w').write('x')", session_id=session_id)
            assert workspace_holding(dirs, marker).name not in before, options


async def test_pool_size_zero_starts_nothing_ahead(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_POOL_SIZE="0")) as client:
        await client.call_tool("manage_sessions", {"action": "list"})
        await anyio.sleep(1.0)  # time a pool would have used to start a sandbox
        assert sandbox_processes_alive(dirs) == [] and workspaces(dirs) == set()
        assert text_of(await run(client, "1 + 1")).startswith("2")


@pytest.mark.parametrize("transport", ["stdio", "streamable-http"])
async def test_stopping_the_server_leaves_nothing_running(dirs: ServerDirs, transport: str) -> None:
    async with open_client(transport, server_env(dirs, CODERUNNER_POOL_SIZE="2")) as client:
        await pooled_session(client, dirs, "marker-stop")
        # One taken, two in the pool (ready or starting): three sandboxes of this server.
        assert await wait_until(lambda: len(workspaces(dirs)) == 3, timeout_s=POOL_WAIT_S)
        assert sandbox_processes_alive(dirs)
    assert await wait_until(lambda: not sandbox_processes_alive(dirs), timeout_s=20), sandbox_processes_alive(dirs)
    assert workspaces(dirs) == set()
