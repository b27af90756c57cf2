"""kernel_reset through the MCP client, on the session's standby kernel (sessions/standby.py), in real sandboxes.

What a reset promised before the standby it still keeps: a fresh namespace, the workspace files and the
session's installed packages, a running cell stopped; a reset with no standby ready starts one cold; and
closing leaves nothing behind (processes, dirs, cgroups). Each test checks, through manage_sessions status, which
path its reset took, so that a standby that is never used cannot pass for one that works.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.types import CallToolResult

from coderunner.sandbox.cgroups import CgroupManager, CgroupsUnavailable

from .conftest import ServerDirs, memory_client, run, sandbox_processes_alive, server_env, text_of, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


async def status(client: Client, session_id: str) -> dict[str, Any]:
    result = await client.call_tool("manage_sessions", {"action": "status", "session_id": session_id})
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def standby_ready(client: Client, session_id: str) -> dict[str, Any]:
    """The session's status once its standby kernel is ready (bounded: a start takes well under a second)."""
    with anyio.fail_after(60):
        while (found := await status(client, session_id))["standby"]["state"] != "ready":
            await anyio.sleep(0.1)
    return found


async def create(client: Client, **arguments: object) -> str:
    result = await client.call_tool("create_session", arguments)
    assert not result.is_error, text_of(result)
    return str(json.loads(text_of(result))["session_id"])


async def reset(client: Client, session_id: str) -> CallToolResult:
    result = await client.call_tool("kernel_reset", {"session_id": session_id})
    assert not result.is_error, text_of(result)
    return result


async def value(client: Client, session_id: str, code: str) -> str:
    result = await run(client, code, session_id=session_id)
    assert not result.is_error, text_of(result)
    return text_of(result).splitlines()[0]


def generation(result: CallToolResult) -> dict[str, Any]:
    found = (result.meta or {}).get("coderunner/kernel")
    assert isinstance(found, dict), result.meta
    return found


async def test_a_reset_swaps_to_the_standby_with_a_fresh_namespace_and_the_files_kept(client: Client) -> None:
    sid = await create(client)
    await value(client, sid, "import json as renamed\nkept = 41\nopen('kept.txt', 'w').write('file survives')")
    before = await standby_ready(client, sid)
    assert before["standby"]["memory_mb"], before  # what it holds is shown beside the kernel's own
    swapped = await reset(client, sid)
    assert generation(swapped) == {"generation": before["kernel_generation"] + 1, "state_preserved": False}
    for name in ("kept", "renamed"):
        gone = await run(client, name, session_id=sid)
        assert gone.is_error and "NameError" in text_of(gone), text_of(gone)
    assert await value(client, sid, "open('kept.txt').read()") == "'file survives'"
    after = await status(client, sid)
    assert after["standby"]["swapped_in"] == 1 and after["restarts"] == 1, after
    # Another is started for the next reset, and that one is fresh too.
    await value(client, sid, "kept = 42")
    await standby_ready(client, sid)
    await reset(client, sid)
    gone = await run(client, "kept", session_id=sid)
    assert gone.is_error and "NameError" in text_of(gone), text_of(gone)
    assert (await status(client, sid))["standby"]["swapped_in"] == 2


async def test_a_package_installed_after_the_standby_started_is_found_after_the_reset(client: Client) -> None:
    """The standby started before the package folder existed; its import system had looked there (and
    cached that it was missing). install_packages writes to that folder; here the old kernel does, as pip would."""
    sid = await create(client)
    await standby_ready(client, sid)
    install = (
        "import os\n"
        "os.makedirs('/workspace/.coderunner/site-packages/late_pkg', exist_ok=True)\n"
        "open('/workspace/.coderunner/site-packages/late_pkg/__init__.py', 'w').write('ANSWER = 42\\n')\n"
    )
    await value(client, sid, install + "'installed'")
    await reset(client, sid)
    assert (await status(client, sid))["standby"]["swapped_in"] == 1
    assert await value(client, sid, "import late_pkg; late_pkg.ANSWER") == "42"


async def test_a_reset_during_a_running_cell_stops_it_and_swaps(client: Client) -> None:
    sid = await create(client)
    await value(client, sid, "before = 1")
    replies: list[CallToolResult] = []

    async def runaway() -> None:
        replies.append(await run(client, "while True:\n    pass", session_id=sid, timeout_s=120))

    async with anyio.create_task_group() as tg:
        tg.start_soon(runaway)
        # A call running for a while leaves room for the standby's start beside it.
        await standby_ready(client, sid)
        with anyio.fail_after(30):
            await reset(client, sid)
    assert replies[0].is_error and "stopped by a kernel reset: state lost" in text_of(replies[0])
    assert (await status(client, sid))["standby"]["swapped_in"] == 1
    gone = await run(client, "before", session_id=sid)
    assert gone.is_error and "NameError" in text_of(gone), text_of(gone)


async def test_a_second_reset_right_after_the_first_starts_a_kernel_cold_and_is_just_as_fresh(
    client: Client,
) -> None:
    sid = await create(client)
    await standby_ready(client, sid)
    await value(client, sid, "first = 1")
    one = await reset(client, sid)
    await value(client, sid, "second = 2")
    two = await reset(client, sid)  # the next standby waits for a quiet moment after the swap: none ready
    assert generation(two)["generation"] == generation(one)["generation"] + 1
    for name in ("first", "second"):
        gone = await run(client, name, session_id=sid)
        assert gone.is_error and "NameError" in text_of(gone), text_of(gone)
    after = await status(client, sid)
    assert after["restarts"] == 2 and after["standby"]["swapped_in"] == 1, after
    # The cold kernel gets a standby of its own in turn.
    await standby_ready(client, sid)
    await reset(client, sid)
    assert (await status(client, sid))["standby"]["swapped_in"] == 2


async def test_no_kernel_key_is_where_another_sandbox_of_the_session_can_read_it(
    client: Client, dirs: ServerDirs
) -> None:
    """The live kernel and its standby share the session's host/ and run/ dirs: a connection file there
    would let the live kernel's code drive the standby (and so outlive the reset)."""
    sid = await create(client)
    await standby_ready(client, sid)
    probe = (
        "import os, json\n"
        f"roots = [os.path.join({str(dirs.runtime)!r}, d) for d in os.listdir({str(dirs.runtime)!r})]\n"
        "found = []\n"
        "for root in roots:\n"
        "    for n in range(20):\n"
        "        for path in (f'{root}/host/kernel-{n}.json', f'{root}/run/kernel-{n}.json'):\n"
        "            try:\n"
        "                found.append(json.load(open(path))['key'])\n"
        "            except OSError:\n"
        "                pass\n"
        "own = json.load(open('/run/kernel/connection.json'))['key']\n"
        "print(found, len(own))"
    )
    assert await value(client, sid, probe) == "[] 64"
    old_key = await value(client, sid, "print(__import__('json').load(open('/run/kernel/connection.json'))['key'])")
    await reset(client, sid)
    new_key = await value(client, sid, "print(__import__('json').load(open('/run/kernel/connection.json'))['key'])")
    assert len(new_key) == 64 and new_key != old_key


def session_keys(dirs: ServerDirs) -> list[str]:
    """The names of the sessions' dirs in the runtime dir (and of their sandboxes), not those made ahead."""
    return [entry.name for entry in dirs.session_runtime_dirs() if re.fullmatch("[0-9a-f]{8}", entry.name)]


def session_key(dirs: ServerDirs) -> str:
    (key,) = session_keys(dirs)
    return key


def session_cgroups(key: str) -> set[str]:
    """Which of a session's two sandbox names have a cgroup (in any controller, any server's parent group)."""
    try:
        manager = CgroupManager.detect()
    except CgroupsUnavailable:
        return set()
    return {
        name
        for parent in manager.parents.values()
        for group in parent.glob(f"{manager.prefix}-server-*")
        for name in (key, f"{key}-b")
        if (group / name).is_dir()
    }


async def test_closing_after_a_reset_leaves_nothing(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs)) as client:
        sid = await create(client)
        await standby_ready(client, sid)
        await reset(client, sid)
        await standby_ready(client, sid)  # the live kernel and a new standby: two sandboxes
        assert len(sandbox_processes_alive(dirs)) >= 2
        key = session_key(dirs)
        groups = session_cgroups(key)
        if groups:  # a server that makes cgroups: the live kernel's and the standby's, each its own
            assert len(groups) == 2, groups
        closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": sid})
        assert not closed.is_error, text_of(closed)
        assert await wait_until(lambda: not sandbox_processes_alive(dirs)), "a sandbox outlived its closed session"
        assert not (dirs.runtime / key).exists(), "the closed session's dirs are left"
        assert not dirs.session_workspaces(), "the closed session's workspace is left"
        assert not session_cgroups(key), session_cgroups(key)


async def test_closing_while_the_standby_starts_leaves_nothing(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs)) as client:
        for _ in range(3):
            sid = await create(client)
            with anyio.fail_after(30):
                while (await status(client, sid))["standby"]["state"] != "starting":
                    await anyio.sleep(0.02)
            await anyio.sleep(0.55)  # past its start delay: its sandbox is being started
            closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": sid})
            assert not closed.is_error, text_of(closed)
            assert await wait_until(lambda: not sandbox_processes_alive(dirs)), "a standby outlived its session"
            assert not dirs.session_workspaces(), "the closed session's workspace is left"
            assert not session_keys(dirs), "the closed session's dirs are left"


async def test_with_the_setting_off_no_standby_is_kept_and_a_reset_still_works(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_RESET_STANDBY="0")) as client:
        sid = await create(client)
        assert "standby" not in await status(client, sid)
        await value(client, sid, "kept = 1")
        await anyio.sleep(1.0)  # past a standby's start delay
        assert len(session_cgroups(session_key(dirs))) <= 1  # (none where the server makes no cgroups)
        await reset(client, sid)
        gone = await run(client, "kept", session_id=sid)
        assert gone.is_error and "NameError" in text_of(gone), text_of(gone)
