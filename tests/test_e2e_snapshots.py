"""Snapshots through the MCP client: snapshot, restore, fork, list, delete, keep_state across a restart.

Real servers, real sandboxes, the official SDK client over stdio and HTTP. What comes back is checked
by running code in the restored session, not by reading the reply alone.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import anyio
import pytest
from mcp import Client

from .conftest import (
    REPO,
    SERVER_CMD,
    ServerDirs,
    _await_listening,
    _free_port,
    connect_http,
    http_server,
    memory_client,
    run,
    server_env,
    text_of,
)
from .test_e2e_client_tokens import add_token, call, refused

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: A session's worth of state: a DataFrame, a fitted model, cell-defined function and class, a module
#: alias, a file in the workspace; and three things that cannot travel (an open file, a lock, a thread).
STATE_CELL = """
import threading, time
import numpy as np
import pandas as pd
df = pd.DataFrame({"city": ["Oslo", "Lima", "Pune"], "temp": [4.5, 19.0, 31.25]})
xs = np.linspace(0, 4, 9)
model = np.polynomial.Polynomial.fit(xs, 3 * xs**2 - 2 * xs + 1, 2)
offset = 10
def predict(x):
    return round(float(model(x)) + offset, 6)
class Box:
    def __init__(self, items):
        self.items = list(items)
    def total(self):
        return sum(self.items)
box = Box([1, 2, 3])
open("notes.txt", "w").write("written before the snapshot")
handle = open("notes.txt")
guard = threading.Lock()
worker = threading.Thread(target=time.sleep, args=(600,), daemon=True)
worker.start()
"""
CHECK_CELL = (
    "print(df['temp'].sum(), predict(2), box.total(), type(box).__name__, np.__name__, open('notes.txt').read())"
)
EXPECTED = "54.75 19.0 6 Box numpy written before the snapshot"


async def output(client: Client, code: str, session_id: str) -> str:
    result = await run(client, code, session_id=session_id)
    assert not result.is_error, text_of(result)
    return text_of(result)


async def test_snapshot_and_restore_bring_back_data_model_function_class_and_files(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs)) as client:
        original = (await call(client, "create_session"))["session_id"]
        await output(client, STATE_CELL, original)
        taken = await call(client, "manage_snapshots", action="save", session_id=original, name="before")
        assert {"df", "model", "predict", "Box", "box", "offset"} <= set(taken["variables"]), taken
        assert "np" in taken["modules"] and "pd" in taken["modules"]
        not_saved = "\n".join(taken["not_saved"])
        for expected in ("handle: an open file handle", "guard: a lock", "worker: a thread"):
            assert expected in not_saved, not_saved
        assert taken["workspace"]["files"] >= 1 and taken["never_carried"]

        restored = await call(client, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
        new = restored["session_id"]
        assert new != original
        assert {"df", "model", "predict", "box"} <= set(restored["restored"])
        assert any(line.startswith("handle: ") for line in restored["not_restored"]), restored
        assert EXPECTED in await output(client, CHECK_CELL, new)
        assert "False" in await output(client, "print('handle' in dir())", new), "what did not travel is absent"

        # The original runs on, untouched; listing and status name the snapshot.
        assert EXPECTED in await output(client, CHECK_CELL, original)
        listed = await call(client, "manage_snapshots", action="list")
        assert [entry["snapshot"] for entry in listed["snapshots"]] == [taken["snapshot"]]
        assert listed["snapshots"][0]["name"] == "before"
        status = await call(client, "manage_sessions", action="status", session_id=original)
        assert status["snapshots"] == [taken["snapshot"]]
        assert (await call(client, "manage_sessions", action="status", session_id=new))["restored_from"] == taken[
            "snapshot"
        ]

        await call(client, "manage_snapshots", action="delete", snapshot=taken["snapshot"])
        assert (await call(client, "manage_snapshots", action="list"))["snapshots"] == []
        assert "no snapshot" in await refused(client, "manage_snapshots", action="restore", snapshot=taken["snapshot"])


async def test_fork_gives_two_sessions_that_diverge(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs)) as client:
        original = (await call(client, "create_session"))["session_id"]
        await output(client, "path = ['start']\nopen('shared.txt', 'w').write('start')", original)
        forked = await call(client, "manage_snapshots", action="fork", session_id=original)
        fork = forked["session_id"]
        assert forked["forked_from"] == original and "path" in forked["restored"]

        await output(client, "path.append('fork')\nopen('shared.txt', 'a').write('+fork')\nopen('own.txt', 'w')", fork)
        await output(client, "path.append('original')\nopen('shared.txt', 'a').write('+original')", original)
        look = "import os\nprint(path, open('shared.txt').read(), os.path.exists('own.txt'))"
        fork_view, original_view = await output(client, look, fork), await output(client, look, original)
        assert "['start', 'fork'] start+fork True" in fork_view
        assert "['start', 'original'] start+original False" in original_view
        # A fork's snapshot is only the means: it is not kept.
        assert (await call(client, "manage_snapshots", action="list"))["snapshots"] == []


async def test_keep_state_brings_variables_back_after_a_server_restart(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    persistent = {"name": "analysis", "persistent": True, "keep_state": True}
    async with memory_client(env) as client:
        first = await call(client, "create_session", **persistent)
        assert first["keep_state"] is True and "state" not in first, "nothing saved yet: nothing loaded"
        await output(client, STATE_CELL, first["session_id"])
        # The server stops: the session closes and saves its state on the way out.

    async with memory_client(env) as client:
        again = await call(client, "create_session", **persistent)
        assert {"df", "model", "predict", "box"} <= set(again["state"]["restored"]), again
        assert any(line.startswith("guard: a lock") for line in again["state"]["not_restored"]), again
        assert EXPECTED in await output(client, CHECK_CELL, again["session_id"])
        await output(client, "offset = 20", again["session_id"])
        closed = await call(client, "manage_sessions", action="close", session_id=again["session_id"])
        assert closed["state"].startswith("kernel state saved"), closed

    async with memory_client(env) as client:
        third = await call(client, "create_session", **persistent)
        assert "29.0" in await output(client, "print(predict(2))", third["session_id"]), "the later state was kept"
        # Without keep_state the same workspace opens with its files and a fresh kernel.
        await call(client, "manage_sessions", action="close", session_id=third["session_id"])
        plain = await call(client, "create_session", name="analysis", persistent=True)
        assert "state" not in plain
        assert "False" in await output(client, "print('df' in dir(), open('notes.txt').read())", plain["session_id"])


async def test_keep_state_survives_a_killed_server_once_saved_while_idle(dirs: ServerDirs) -> None:
    """A reboot or SIGKILL gives no chance to save at close: an idle session saved on its own before."""
    env = server_env(dirs, CODERUNNER_KEEP_STATE_SAVE_IDLE_S="1")
    persistent = {"name": "crashy", "persistent": True, "keep_state": True}
    port = _free_port()
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [*SERVER_CMD, "--transport", "streamable-http", "--port", str(port)],
            env=env, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            _await_listening(server, port, log)
            async with connect_http(f"http://127.0.0.1:{port}/mcp") as client:
                sid = (await call(client, "create_session", **persistent))["session_id"]
                await output(client, "fitted = [1, 2, 3]\ndef total():\n    return sum(fitted)", sid)
                with anyio.fail_after(60):
                    while not (
                        note := (await call(client, "manage_sessions", action="status", session_id=sid)).get(
                            "state_note"
                        )
                        or ""
                    ):
                        await anyio.sleep(0.2)
                assert note.startswith("kernel state saved at"), note
                await anyio.sleep(3)  # idle, nothing new ran: nothing is saved again
                assert (await call(client, "manage_sessions", action="status", session_id=sid)).get(
                    "state_note"
                ) == note
        finally:
            server.kill()
            server.wait(timeout=10)

    # The same client (the same token) on a new server: its named workspace and its saved state.
    with http_server(env) as url:
        async with connect_http(url) as client:
            again = await call(client, "create_session", **persistent)
            assert {"fitted", "total"} <= set(again["state"]["restored"]), again
            assert (await output(client, "print(total())", again["session_id"])).splitlines()[0] == "6"


async def test_keep_state_needs_a_persistent_session(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs)) as client:
        assert "keep_state needs persistent=true" in await refused(client, "create_session", keep_state=True)


async def test_a_snapshot_belongs_to_the_client_that_made_it(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    bob_token = add_token(env, "bob")
    with http_server(env) as url:
        async with connect_http(url) as alice, connect_http(url, token=bob_token) as bob:
            session = (await call(alice, "create_session"))["session_id"]
            await output(alice, "secret_plan = 'alice only'", session)
            taken = await call(alice, "manage_snapshots", action="save", session_id=session)
            answer = await refused(bob, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
            assert "no snapshot" in answer and "alice only" not in answer
            assert (await call(bob, "manage_snapshots", action="list"))["snapshots"] == []
            assert "no snapshot" in await refused(bob, "manage_snapshots", action="delete", snapshot=taken["snapshot"])
            assert "unknown or expired session_id" in await refused(
                bob, "manage_snapshots", action="save", session_id=session
            )
            # Alice's snapshot is whole, and hers to restore.
            restored = await call(alice, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
            assert "alice only" in await output(alice, "print(secret_plan)", restored["session_id"])


async def test_a_snapshot_past_its_size_cap_is_refused_and_nothing_is_kept(dirs: ServerDirs) -> None:
    env = server_env(dirs, CODERUNNER_SNAPSHOT_LIMIT_MB="2")
    async with memory_client(env) as client:
        session = (await call(client, "create_session"))["session_id"]
        await output(client, "big = bytes(3 * 2**20)\nsmall = 1", session)
        answer = await refused(client, "manage_snapshots", action="save", session_id=session)
        assert "snapshot_limit_mb" in answer and "big" in answer, answer
        await output(client, "del big\nopen('large.bin', 'wb').write(bytes(3 * 2**20))", session)
        answer = await refused(client, "manage_snapshots", action="save", session_id=session)
        assert "snapshot_limit_mb" in answer, answer
        assert (await call(client, "manage_snapshots", action="list"))["snapshots"] == []
        store = Path(dirs.root) / "snapshots"
        assert not [path for path in store.rglob("*") if path.is_file() and path.stat().st_size > 2**20]
        # The session goes on, its state intact, and nothing of the attempt is left in its workspace.
        assert "1 False" in await output(
            client, "import os\nprint(small, os.path.exists('.coderunner/snapshot'))", session
        )
