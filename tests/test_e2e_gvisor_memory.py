"""gVisor memory snapshots through the MCP client: what no pickle can carry comes back.

On the gvisor backend manage_snapshots save, restore and fork checkpoint the whole
sandbox with runsc. These run a real server on gvisor and the SDK client over stdio, and check by
running code in each session: a running thread keeps counting in a local variable only it holds,
an open file handle reads on, a lock is still a lock; the original runs on after its checkpoint;
a fork diverges from its original; and a checkpoint past the size cap keeps nothing.
"""

from __future__ import annotations

import os
import shutil
import signal

import anyio
import pytest

from .conftest import (
    ServerDirs,
    clean_after_dead_servers,
    mounted_under,
    raw_stdio_server,
    server_env,
    stdio_client,
    text_of,
)
from .test_e2e_client_tokens import call, refused
from .test_e2e_podman import podman_image  # noqa: F401  (the session's image fixture)
from .test_e2e_snapshots import output

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: A thread counts in `n`, a variable only it holds, and appends each count to `counts`; a file
#: stays open mid-read; a lock is held; a DataFrame sits beside them.
STATE_CELL = """
import threading, time
import pandas as pd
counts = []
def _count():
    n = 0
    while True:
        n += 1
        if len(counts) < 100_000:
            counts.append(n)
        time.sleep(0.02)
worker = threading.Thread(target=_count, daemon=True, name="counter")
worker.start()
open("lines.txt", "w").write("one\\ntwo\\nthree\\n")
handle = open("lines.txt")
first = handle.readline()
guard = threading.Lock()
guard.acquire()
df = pd.DataFrame({"x": [1, 2, 3]})
time.sleep(0.3)
"""
#: The thread's count went on from where it was (never restarted: the list is exactly 1..n), the
#: handle reads its next line, the lock is still held.
PROBE = """
import time
before = len(counts)
time.sleep(0.5)
after = len(counts)
print("alive", worker.is_alive(), after > before, counts == list(range(1, len(counts) + 1)))
print("file", first.strip(), handle.readline().strip())
print("lock", guard.locked(), int(df['x'].sum()))
"""


@pytest.fixture(scope="module")
def gvisor_image(podman_image: str) -> str:  # noqa: F811
    if shutil.which("runsc") is None:
        pytest.fail("runsc is not installed: run ./install.sh (it installs runsc for the gvisor backend)")
    return podman_image


async def test_a_thread_an_open_file_and_a_lock_survive_snapshot_restore_and_fork(
    gvisor_image: str, dirs: ServerDirs
) -> None:
    env = server_env(dirs, CODERUNNER_BACKEND="gvisor", CODERUNNER_IMAGE=gvisor_image)
    async with stdio_client(env) as client:
        original = (await call(client, "create_session"))["session_id"]
        await output(client, STATE_CELL, original)
        taken = await call(client, "manage_snapshots", action="save", session_id=original, name="live")
        assert "memory" in taken and "thread" in taken["memory"], taken
        assert taken["workspace"]["files"] >= 1 and taken["size_mb"] > 0, taken
        listed = (await call(client, "manage_snapshots", action="list"))["snapshots"]
        assert [entry["snapshot"] for entry in listed] == [taken["snapshot"]] and listed[0][
            "variables"
        ] == "all (memory)"

        # The original was stopped, saved and carried on: its thread still counts.
        seen = await output(client, PROBE, original)
        assert "alive True True True" in seen and "file one two" in seen and "lock True 6" in seen, seen

        restored = await call(client, "manage_snapshots", action="restore", snapshot=taken["snapshot"])
        copy = restored["session_id"]
        assert copy != original and restored["restored"] and "not_restored" not in restored, restored
        seen = await output(client, PROBE, copy)
        # The restored copy read "two" at the snapshot's point too: the file handle's offset came back.
        assert "alive True True True" in seen and "file one two" in seen and "lock True 6" in seen, seen
        status = await call(client, "manage_sessions", action="status", session_id=copy)
        assert status["restored_from"] == taken["snapshot"], status

        # A fork: both go on alone, in memory and in files.
        forked = await call(client, "manage_snapshots", action="fork", session_id=copy)
        fork = forked["session_id"]
        assert forked["forked_from"] == copy
        await output(client, "df.loc[3] = [100]\nopen('lines.txt', 'a').write('fork\\n')", fork)
        look = "print('sum', int(df['x'].sum()), open('lines.txt').read().split())"
        assert "sum 106 ['one', 'two', 'three', 'fork']" in await output(client, look, fork)
        assert "sum 6 ['one', 'two', 'three']" in await output(client, look, copy)

        # The restored copy answers a plain call as any session does, and a reset starts it clean.
        await call(client, "kernel_reset", session_id=copy)
        assert "False" in await output(client, "print('counts' in dir())", copy)


async def test_a_memory_snapshot_past_the_size_cap_is_refused_and_the_session_runs_on(
    gvisor_image: str, dirs: ServerDirs
) -> None:
    env = server_env(
        dirs, CODERUNNER_BACKEND="gvisor", CODERUNNER_IMAGE=gvisor_image, CODERUNNER_SNAPSHOT_LIMIT_MB="64"
    )
    async with stdio_client(env) as client:
        session = (await call(client, "create_session"))["session_id"]
        # Random bytes (runsc compresses its image: an idle kernel's comes to about 14 MB).
        await output(client, "import numpy as np\nbig = np.random.default_rng(1).random(100 * 2**20 // 8)", session)
        refusal = await refused(client, "manage_snapshots", action="save", session_id=session)
        assert "size cap" in refusal and "64 MiB" in refusal, refusal
        assert (await call(client, "manage_snapshots", action="list"))["snapshots"] == []
        # The session carried on after the refused snapshot.
        result = await client.call_tool("run_python", {"code": "print(big.size)", "session_id": session})
        assert not result.is_error and str(100 * 2**20 // 8) in text_of(result), text_of(result)


async def test_a_sigkilled_gvisor_servers_runsc_state_and_mounts_go_at_the_next_start(
    gvisor_image: str, dirs: ServerDirs
) -> None:
    """A SIGKILLed gVisor server leaves runsc state and a rootfs mount; its next start (a gVisor backend's: the
    tests' clean_after_dead_servers makes the one the dead server ran) removes both, after its dirs sweeper took
    the dirs. CI once found such a mount left: the helper had made a bwrap backend, which knows nothing of runsc."""
    env = server_env(dirs, CODERUNNER_BACKEND="gvisor", CODERUNNER_IMAGE=gvisor_image)
    with raw_stdio_server(env, [("run_python", {"code": "open('kept.txt', 'w').write('x')"})]) as server:
        assert mounted_under(dirs.root), "a gVisor session mounts its rootfs and workspace"
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    await anyio.sleep(3)  # past a sweeper's first two sweeps (0.5 s, then 2 s)
    assert clean_after_dead_servers(dirs) == []
