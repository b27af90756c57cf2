"""Several servers on one runtime dir, starting, sweeping and making sessions at once (issue 25, finding 6).

Claude Desktop, Cursor and Claude Code each start their own stdio server on the same default
runtime and workspace dirs, and each server's start sweeps what it takes for dead. A starting
sandbox's dir used to be visible before its lock, and a sweep removed it ("bwrap: Can't find
source path .../host/etc/passwd"). Here real servers start in waves beside a long-lived bystander
server: every start and every session must work, and the bystander's session (its dirs swept
at by every wave) keeps its state and its workspace file.

The servers do not share a umask either (issue 38, point 4): each client starts its server with
its own. The bystander makes the runtime dir under umask 077 and the waves mix 022, 077 and 027;
the folders a sandbox user passes through (the runtime dir, the guest package, staged mount points)
used to take the umask, and a sandbox then died at start with "Can't find source path
<runtime>/<id>/...: Permission denied" while the server beside it ran on. Nor their version or
settings: one that asks for the runtime dir at 0700 as it starts takes the search bit away from
every other server's sandbox users; the others give it back before their next sandbox needs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest
from mcp import Client, StdioServerParameters

from ..conftest import REPO, SERVER_CMD, ServerDirs, run, server_env, text_of
from .conftest import BYSTANDER_VALUE

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: Servers started at once per wave, and waves (bounded: each server is a whole process on 2 cores).
SERVERS, WAVES = 4, 3
#: The umask each server of a wave starts with (the bystander's is 077).
WAVE_UMASKS = (0o022, 0o077, 0o027, 0o022)
BYSTANDER_UMASK = 0o077
#: Sessions the bystander makes and closes while the others start and sweep.
BYSTANDER_SESSIONS = 12
#: The sweep every server's start runs, in a loop (a storm of starts), until told to stop (bounded).
SWEEP_STORM = """
import sys, time
from pathlib import Path
from coderunner.hostfs.session_dirs import remove_stale_dirs
runtime, workspaces, stop = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
deadline = time.monotonic() + 300
while not stop.exists() and time.monotonic() < deadline:
    if runtime.is_dir():
        remove_stale_dirs(runtime, workspaces, lambda name: None)
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def stdio_client(env: dict[str, str], umask: int) -> Client:
    """A stdio server started as a client starts it, under `umask` (a shell sets it, then execs the server)."""
    command = f'umask {umask:03o} && exec "$0" "$@"'
    params = StdioServerParameters(command="/bin/sh", args=["-c", command, *SERVER_CMD], env=env, cwd=str(REPO))
    return Client(params, read_timeout_seconds=120)


async def one_server(env: dict[str, str], wave: int, index: int, failures: list[str]) -> None:
    """Start, make a session with its own file, run in it and in the default session, close."""
    try:
        async with stdio_client(env, WAVE_UMASKS[index % len(WAVE_UMASKS)]) as client:
            made = await client.call_tool("create_session", {})
            if made.is_error:
                failures.append(f"wave {wave} server {index}: create_session: {text_of(made)}")
                return
            session = json.loads(text_of(made))["session_id"]
            mark = f"w{wave}s{index}"
            wrote = await run(client, f"open('mark.txt', 'w').write({mark!r})\nprint(open('mark.txt').read())",
                              session_id=session)  # fmt: skip
            default = await run(client, "6 * 7")
            if wrote.is_error or mark not in text_of(wrote):
                failures.append(f"wave {wave} server {index}: run: {text_of(wrote)}")
            if default.is_error or "42" not in text_of(default):
                failures.append(f"wave {wave} server {index}: default session: {text_of(default)}")
            await client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    except Exception as exc:  # a server that failed to start is the finding itself
        failures.append(f"wave {wave} server {index}: {type(exc).__name__}: {exc}")


@contextmanager
def sweep_storm(dirs: ServerDirs) -> Iterator[None]:
    """Another process sweeping the shared dirs without pause, as a start does, while the block runs."""
    stop = dirs.root / "stop-sweeping"
    storm = subprocess.Popen(
        [sys.executable, "-c", SWEEP_STORM, str(dirs.runtime), str(dirs.workspaces), str(stop)],
        cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        yield
    finally:
        stop.touch()
        try:
            storm.wait(timeout=30)
        except subprocess.TimeoutExpired:
            storm.kill()
            storm.wait(timeout=10)


async def bystander_sessions(client: object, failures: list[str]) -> None:
    """The bystander server makes and closes sessions throughout: each dir is new while others sweep."""
    for index in range(BYSTANDER_SESSIONS):
        made = await client.call_tool("create_session", {})  # type: ignore[attr-defined]
        if made.is_error:
            failures.append(f"bystander session {index}: {text_of(made)}")
            continue
        session = json.loads(text_of(made))["session_id"]
        done = await run(client, "7 * 6", session_id=session)  # type: ignore[arg-type]
        if done.is_error or "42" not in text_of(done):
            failures.append(f"bystander session {index}: {text_of(done)}")
        await client.call_tool("manage_sessions", {"action": "close", "session_id": session})  # type: ignore[attr-defined]


async def test_servers_sharing_a_runtime_dir_never_break_each_others_sessions(dirs: ServerDirs) -> None:
    # Each server keeps a warm pool too: its sandboxes' dirs are made while the others sweep.
    env = server_env(dirs, CODERUNNER_POOL_SIZE="1", CODERUNNER_MAX_SESSIONS="4")
    failures: list[str] = []
    async with stdio_client(env, BYSTANDER_UMASK) as bystander:
        made = await bystander.call_tool("create_session", {})
        assert not made.is_error, text_of(made)
        kept = json.loads(text_of(made))["session_id"]
        planted = await run(bystander, f"guarded = {BYSTANDER_VALUE!r}\nopen('kept.txt', 'w').write('mine')",
                            session_id=kept)  # fmt: skip
        assert not planted.is_error, text_of(planted)
        with sweep_storm(dirs):
            async with anyio.create_task_group() as outer:
                outer.start_soon(bystander_sessions, bystander, failures)
                for wave in range(WAVES):
                    async with anyio.create_task_group() as group:
                        for index in range(SERVERS):
                            group.start_soon(one_server, env, wave, index, failures)
                    alive = await run(bystander, "guarded, open('kept.txt').read()", session_id=kept)
                    assert not alive.is_error and BYSTANDER_VALUE in text_of(alive) and "mine" in text_of(alive), (
                        f"after wave {wave}: {text_of(alive)}"
                    )
        assert failures == [], "\n".join(failures)
        assert text_of(await run(bystander, "1 + 1")).splitlines()[0] == "2"
        # A server of another version or setting asks for the shared runtime dir at 0700 as it starts,
        # taking away the search bit the bystander's sandbox users pass through: its next session used to
        # die at start ("bwrap: Can't find source path <runtime>/<id>/host/etc/passwd: Permission denied").
        os.chmod(dirs.runtime, 0o700)
        made = await bystander.call_tool("create_session", {"name": "after-flip"})  # a name: never a pooled one
        assert not made.is_error, text_of(made)
        after = await run(bystander, "6 * 7", session_id=json.loads(text_of(made))["session_id"])
        assert not after.is_error and "42" in text_of(after), text_of(after)
