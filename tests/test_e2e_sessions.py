"""Session lifecycle tools through the MCP client: handles, limits, status, cleanup."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time

import anyio
import pytest
from mcp import Client

from coderunner.hostfs.sandbox_mounts import START_CLONES_PREFIX

from .conftest import (
    ServerDirs,
    memory_client,
    mounted_under,
    open_client,
    raw_stdio_server,
    run,
    sandbox_processes_alive,
    server_env,
    text_of,
    wait_until,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


async def create(client: Client, **arguments: object) -> dict:  # type: ignore[type-arg]
    result = await client.call_tool("create_session", arguments)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def test_create_status_list_close(client: Client, dirs: ServerDirs) -> None:
    session = await create(client, memory_mb=1024, timeout_s=30)
    sid = session["session_id"]
    assert len(sid) >= 22, "handles are high-entropy"
    assert session["memory_mb"] == 1024
    assert session["network"] == "none" and session["kernel"] == "idle" and session["timeout_s"] == 30

    await run(client, "import numpy as np\nbig = np.ones(10_000_000)", session_id=sid)
    status = json.loads(text_of(await client.call_tool("manage_sessions", {"action": "status", "session_id": sid})))
    assert status["kernel"] == "idle"
    assert status["usage"]["memory_mb"] > 60, status
    assert status["limits"]["memory_mb"]["value"] == 1024
    assert status["limits"]["memory_mb"]["enforced_by"].startswith("RLIMIT_AS")

    listed = json.loads(text_of(await client.call_tool("manage_sessions", {"action": "list"})))
    assert sid in [entry["session_id"] for entry in listed["sessions"]]

    closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": sid})
    assert not closed.is_error
    assert dirs.session_workspaces() == [], "a closed session's workspace is removed"
    gone = await run(client, "1", session_id=sid)
    assert gone.is_error and "unknown or expired session_id" in text_of(gone) and sid in text_of(gone)


async def test_unknown_session_is_a_clear_error(client: Client) -> None:
    result = await run(client, "1", session_id="not-a-real-session")
    assert result.is_error
    assert "unknown or expired session_id 'not-a-real-session'" in text_of(result)
    assert "Traceback" not in text_of(result)


async def test_memory_limit_gives_memory_error_and_kernel_survives(client: Client) -> None:
    sid = (await create(client, memory_mb=512))["session_id"]
    result = await run(client, "hog = bytearray(2 * 1024**3)", session_id=sid)
    assert result.is_error and "MemoryError" in text_of(result)
    assert text_of(await run(client, "'alive'", session_id=sid)).splitlines()[0] == "'alive'"


async def test_invalid_options_are_refused_plainly(client: Client) -> None:
    result = await client.call_tool("create_session", {"network": "carrier-pigeon"})
    expected = "network: Input should be 'none'"  # the only mode within the default ceiling
    assert result.is_error and expected in text_of(result), text_of(result)
    result = await client.call_tool("create_session", {"memory_mb": 64})
    assert result.is_error and "memory_mb: Input should be greater than or equal to 512" in text_of(result)
    result = await client.call_tool("create_session", {"timeout_s": -1})
    assert result.is_error and "timeout_s: Input should be greater than or equal to 1" in text_of(result)


async def test_session_limit(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_MAX_SESSIONS="2")) as client:
        await create(client)
        await create(client)
        refused = await client.call_tool("create_session", {})
        assert refused.is_error and "session limit reached (2 open)" in text_of(refused)


async def test_busy_session_answers_busy_within_the_callers_timeout(client: Client) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, client, "import time\ntime.sleep(4)")
        await anyio.sleep(0.8)
        began = time.monotonic()
        second = await run(client, "1", timeout_s=1)
        assert time.monotonic() - began < 3.5
        assert second.is_error and "busy" in text_of(second)


async def test_stdio_server_exit_leaves_no_sandbox_behind(dirs: ServerDirs) -> None:
    async with open_client("stdio", server_env(dirs)) as client:
        await create(client)
        await run(client, "1")
        assert len(sandbox_processes_alive(dirs)) >= 2
    assert await wait_until(lambda: not sandbox_processes_alive(dirs))
    assert not any(dirs.workspace_entries())


async def test_sigkilled_server_leaves_no_sandbox_and_its_dirs_and_mounts_go_without_a_next_start(
    dirs: ServerDirs,
) -> None:
    """Its watcher ends the sandboxes and its dirs sweeper (hostfs/dirs_sweeper.py) removes its session dirs,
    the capped workspace's mount and loop device with them; a next start still finds a clean slate."""
    env = server_env(dirs)
    with raw_stdio_server(env, [("run_python", {"code": "open('kept.txt', 'w').write('x')"})]) as server:
        assert sandbox_processes_alive(dirs)
        [workspace] = [path for path in dirs.session_workspaces() if path.is_dir()]
        assert (workspace / "kept.txt").exists()
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    assert await wait_until(lambda: not sandbox_processes_alive(dirs)), "sandbox outlived a SIGKILLed server"

    def swept() -> bool:
        return not session_dirs(dirs) and not any(dirs.workspace_entries()) and not mounted_under(dirs.root)

    assert await wait_until(swept, timeout_s=30), (session_dirs(dirs), list(dirs.workspace_entries()))
    async with memory_client(env) as client:  # the next start: the same SessionManager start-up, in memory
        assert text_of(await run(client, "2 + 2")).splitlines()[0] == "4"
        assert len(set(session_dirs(dirs)) - dirs.made_ahead()) == 1  # the default session's (and the next's ahead)


def session_dirs(dirs: ServerDirs) -> list[str]:
    """The runtime dir's sessions' dirs: not the guest, nor a server's start clones dir (start_namespace.py)."""
    return [path.name for path in dirs.runtime.iterdir() if not path.name.startswith(("guest-", START_CLONES_PREFIX))]


async def test_closing_a_session_mid_run_ends_the_run_and_its_sandbox(client: Client, dirs: ServerDirs) -> None:
    sid = (await create(client))["session_id"]
    replies: list = []

    async def long_run() -> None:
        replies.append(await run(client, "import time\ntime.sleep(600)", session_id=sid, timeout_s=300))

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_run)
        await anyio.sleep(1.0)
        with anyio.fail_after(30):
            closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": sid})
    assert not closed.is_error
    assert replies[0].is_error and "closed during this call" in text_of(replies[0])
    assert await wait_until(lambda: not sandbox_processes_alive(dirs))
    assert text_of(await run(client, "3 * 3")).splitlines()[0] == "9"


async def test_idle_sessions_are_reaped(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_IDLE_TIMEOUT_S="2")) as client:
        sid = (await create(client))["session_id"]
        await run(client, "1", session_id=sid)
        await anyio.sleep(4.5)
        gone = await run(client, "1", session_id=sid)
        assert gone.is_error and "unknown or expired session_id" in text_of(gone)
        assert [p for p in dirs.session_workspaces() if p.is_dir()] == []
        assert text_of(await run(client, "'fresh default'")).splitlines()[0] == "'fresh default'"


async def test_status_reports_usage_against_limits(client: Client) -> None:
    sid = (await create(client))["session_id"]
    await run(
        client,
        "import numpy as np\nkeep = np.ones(20_000_000)\nopen('blob', 'wb').write(b'x' * 5_000_000)",
        session_id=sid,
    )
    status = json.loads(text_of(await client.call_tool("manage_sessions", {"action": "status", "session_id": sid})))
    usage, limits = status["usage"], status["limits"]
    assert usage["memory_mb"] > 150 and limits["memory_mb"]["value"] == 2048
    assert usage["disk_mb"] >= 4.5 and limits["disk_mb"]["value"] == 2048
    if limits["pids"]["enforced_by"] and "cgroup" in limits["pids"]["enforced_by"]:
        assert 5 <= usage["pids"] <= limits["pids"]["value"]
    assert status["idle_s"] >= 0


async def test_sandbox_killed_from_outside_gives_clear_error_and_fresh_kernel(client: Client, dirs: ServerDirs) -> None:
    sid = (await create(client))["session_id"]
    await run(client, "before = 1", session_id=sid)
    target = set(sandbox_processes_alive(dirs))  # only this session exists yet
    survivor = (await create(client))["session_id"]
    await run(client, "other = 2", session_id=survivor)

    async def kill_sandbox_soon() -> None:
        await anyio.sleep(1.0)
        for pid in target:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_sandbox_soon)
        result = await run(client, "import time\ntime.sleep(30)", session_id=sid)
    assert result.is_error and "kernel died" in text_of(result) and "fresh kernel is ready" in text_of(result)
    assert text_of(await run(client, "2 + 2", session_id=sid)).splitlines()[0] == "4"
    assert text_of(await run(client, "other", session_id=survivor)).splitlines()[0] == "2"


async def test_closing_a_session_while_its_kernel_restarts_stops_the_start_cleanly(
    client: Client, dirs: ServerDirs
) -> None:
    """A close during a kernel reset's fresh start: the start is cancelled, not left to work in
    dirs closed under it (its reply was an OSError EBADF from a closed dir fd)."""
    session = await create(client)
    sid = session["session_id"]
    generation = json.loads(
        text_of(await client.call_tool("manage_sessions", {"action": "status", "session_id": sid}))
    )["kernel_generation"]
    replies: dict[str, object] = {}

    async def reset() -> None:
        replies["reset"] = await client.call_tool("kernel_reset", {"session_id": sid})

    async with anyio.create_task_group() as tg:
        tg.start_soon(reset)
        # A new generation and no live kernel: the fresh one is starting (about a second).
        with anyio.fail_after(30):
            while "reset" not in replies:
                status = json.loads(
                    text_of(await client.call_tool("manage_sessions", {"action": "status", "session_id": sid}))
                )
                if status["kernel_generation"] > generation and status["kernel"] == "dead":
                    break
        closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": sid})
    assert not closed.is_error, text_of(closed)
    reset_reply = replies["reset"]
    assert isinstance(reset_reply, type(closed))
    reset_text = text_of(reset_reply)
    assert "Errno" not in reset_text and "Bad file descriptor" not in reset_text, reset_text
    if reset_reply.is_error:  # the usual case: the start was under way when the close came
        assert f"session {sid} was closed" in reset_text, reset_text
    assert await wait_until(lambda: not sandbox_processes_alive(dirs)), "a sandbox outlived its closed session"
    assert not dirs.session_workspaces(), "the closed session's workspace is left"
    assert text_of(await run(client, "6 * 7")).splitlines()[0] == "42"


async def test_a_removed_guest_copy_is_put_back_before_the_next_sandbox_starts(dirs: ServerDirs) -> None:
    """Something outside the server (a /tmp cleaner, a user's rm) removes the guest package's copy from the
    runtime dir: the next session still starts, and so does every one after it."""
    async with memory_client(server_env(dirs)) as client:
        assert text_of(await run(client, "6 * 7")).splitlines()[0] == "42"
        [guest] = [path for path in dirs.runtime.iterdir() if path.name.startswith("guest-")]
        shutil.rmtree(guest)
        for _ in range(2):
            session = await create(client)
            reply = await run(client, "6 * 7", session_id=session["session_id"])
            assert not reply.is_error and text_of(reply).splitlines()[0] == "42", text_of(reply)
        assert guest.is_dir()
