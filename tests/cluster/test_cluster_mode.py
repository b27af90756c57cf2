"""Cluster mode end to end: front doors (`coderunner serve --ray`) on a real three-node Ray cluster.

Every front door runs inside the cluster's network namespace (nsenter) and is driven by the SDK's
client over stdio, or over HTTP through `coderunner proxy` (also inside the namespace). Sessions are
real bwrap sandboxes with real kernels, started by the node agents (one per worker and settings) on the workers.

The tests of this module share one cluster and run in order: the last one SIGKILLs a worker's
raylet, which takes that node away for good.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.types import CallToolResult

from coderunner.cluster.wire import agent_name
from coderunner.oneshot.ready import READY_IDLE_S
from coderunner.sandbox.handover import handover_path

from ..conftest import SECRET_NAME, SECRET_VALUE, ServerDirs, json_of, server_env, text_of
from ..test_e2e_egress_ux import Asked
from ..test_e2e_server_killed import CANARY, alive, descendants, sandbox_of, with_token
from .conftest import NODE_LABEL, REPO, RayCluster, eventually

pytestmark = pytest.mark.anyio

#: Each session asks for more than half a worker's 2 CPUs, so two sessions never share a worker.
WIDE_CPUS = 1.5


def cluster_env(cluster: RayCluster, dirs: ServerDirs, **extra: str) -> dict[str, str]:
    """A front door's environment: the suite's (with its canary secret), Ray's PATH and the cluster's Ray token."""
    env = server_env(dirs, **extra)
    env["PATH"] = cluster.env["PATH"]
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.update(cluster.auth_env)
    return env


@contextlib.asynccontextmanager
async def front_door(cluster: RayCluster, env: dict[str, str], **client_options: Any) -> AsyncIterator[Client]:
    """A stdio front door in the cluster's namespace, driven by the SDK's client."""
    argv = [*cluster.exec_prefix, sys.executable, "-m", "coderunner.cli", "serve", "--ray", cluster.address]
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=str(REPO))
    async with Client(params, read_timeout_seconds=180, **client_options) as client:
        yield client


async def call(client: Client, tool: str, **arguments: Any) -> CallToolResult:
    return await client.call_tool(tool, arguments)


async def ok(client: Client, tool: str, **arguments: Any) -> CallToolResult:
    result = await call(client, tool, **arguments)
    assert not result.is_error, text_of(result)
    return result


async def standby_ready(client: Client, session_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The session's status once its standby kernel is ready (bounded)."""
    with anyio.fail_after(timeout_s):
        while True:
            status = json_of(await ok(client, "manage_sessions", action="status", session_id=session_id))
            assert status is not None and "standby" in status, status
            if status["standby"]["state"] == "ready":
                return status
            await anyio.sleep(0.5)


def node_name(cluster: RayCluster, node_id: str) -> str:
    return next(name for name, node in cluster.nodes.items() if node.node_id == node_id)


AGENTS = """
import json, ray, sys
ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR')
found = {}
for a in ray.util.list_named_actors(all_namespaces=True):
    if a['namespace'] != 'coderunner':
        continue
    if not a['name'].startswith('agent-'):
        found[a['name']] = None
        continue
    try:
        found[a['name']] = ray.get(ray.get_actor(a['name'], namespace='coderunner').holding.remote(), timeout=30)
    except Exception:
        pass  # it ended meanwhile
print(json.dumps(found))
"""


def agents_held(cluster: RayCluster) -> dict[str, dict[str, Any] | None]:
    """What each named actor of the cluster holds, by name (asked by a driver of our own): a node agent's
    sessions, warm sandboxes ready and creates that took one (NodeAgent.holding); None for any other actor."""
    done = cluster.run_python(AGENTS, cluster.address)
    assert done.returncode == 0, done.stderr[-2000:]
    found: dict[str, dict[str, Any] | None] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def agent_holding(cluster: RayCluster, session_id: str) -> dict[str, Any] | None:
    """What the agent that holds `session_id` holds (NodeAgent.holding), or None if no agent holds it."""
    return next((h for h in agents_held(cluster).values() if h is not None and session_id in h["sessions"]), None)


def named_actors(cluster: RayCluster) -> list[str]:
    """What the cluster still holds: each session open in a node agent (as `session-<id>`) and any named
    actor but the agents (which stay, holding nothing, until no front door visits them: agent.py)."""
    held = agents_held(cluster)
    return [name for name, holds in held.items() if holds is None] + [
        f"session-{session_id}" for holds in held.values() if holds is not None for session_id in holds["sessions"]
    ]


def sandboxes_on(cluster: RayCluster) -> list[int]:
    """bwrap processes alive in the cluster's namespace (every node's sandboxes). A node's kernel template
    (kernel_template) is not counted: it is the node agent's helper and stays with it (as the agents do,
    holding nothing, between front doors); it has a network namespace of its own, so of it only its bwrap
    is seen here, running the template's module."""
    return [
        pid for pid in cluster.netns_pids()
        if _comm(pid) == "bwrap" and TEMPLATE_MODULE not in _cmdline(pid)
    ]  # fmt: skip


#: What a kernel template's bwrap runs (sandbox/bwrap_template.py template_argv).
TEMPLATE_MODULE = b"coderunner_guest.kernel_template"


def described(pids: list[int]) -> list[str]:
    """Each pid with its parent and the start of its command line (what an assertion shows of a leftover)."""
    found = []
    for pid in pids:
        cmdline = _cmdline(pid).replace(b"\0", b" ").decode(errors="replace") or "(gone)"
        found.append(f"{pid} (parent {_ppid(pid)} {_comm(_ppid(pid) or 0)}): {cmdline[:300]}")
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


async def test_sessions_land_on_distinct_nodes_keep_state_and_see_no_host_secret(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        ids, nodes = [], []
        for value in (1, 2):
            made = json_of(await ok(client, "create_session", cpus=WIDE_CPUS))
            assert made is not None
            ids.append(made["session_id"])
            nodes.append(node_name(ray_cluster, made["node"]))
            await ok(client, "run_python", code=f"x = {value}", session_id=made["session_id"])
        assert sorted(nodes) == ["w1", "w2"], nodes  # neither on the head, which offers no bwrap
        for value, session_id in zip((1, 2), ids, strict=True):
            assert f"{value * 10}" in text_of(await ok(client, "run_python", code="x * 10", session_id=session_id))
        leak = await ok(client, "run_python", code=f"import os; print(repr(os.environ.get({SECRET_NAME!r})))",
                        session_id=ids[0])  # fmt: skip
        assert "None" in text_of(leak) and SECRET_VALUE not in text_of(leak)
        # Nor Ray's token, which the front door and every Ray process on the node hold in their environment.
        environment = text_of(await ok(client, "run_python", code="import os; print(dict(os.environ))",
                                       session_id=ids[0]))  # fmt: skip
        assert "PATH" in environment and "RAY_AUTH" not in environment, environment
        assert ray_cluster.env["RAY_AUTH_TOKEN"] not in environment, environment
        # Files, a traceback, and the status, all from the session's node.
        await ok(client, "write_file", path="data/a.txt", content="hello from the front door", session_id=ids[0])
        assert "hello from the front door" in text_of(
            await ok(client, "read_file", path="data/a.txt", session_id=ids[0])
        )
        error = await call(client, "run_python", code="1/0", session_id=ids[0])
        assert error.is_error and "ZeroDivisionError" in text_of(error)
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=ids[1]))
        assert status is not None and node_name(ray_cluster, status["node"]) == nodes[1]
        # A node's session starts its standby kernel at its first reset (a burst of creates pays one kernel
        # each), then swaps to it at the next.
        assert "standby" not in status, status
        await ok(client, "kernel_reset", session_id=ids[1])
        status = await standby_ready(client, ids[1])
        await ok(client, "run_python", code="after = 1", session_id=ids[1])
        await ok(client, "kernel_reset", session_id=ids[1])
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=ids[1]))
        assert status is not None and status["standby"]["swapped_in"] == 1, status
        assert "NameError" in text_of(await call(client, "run_python", code="after", session_id=ids[1]))
        for session_id in ids:
            await ok(client, "manage_sessions", action="close", session_id=session_id)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster)), described(sandboxes_on(ray_cluster))


async def test_a_second_front_door_finds_and_uses_a_session_the_first_made(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    env = cluster_env(ray_cluster, dirs)
    async with front_door(ray_cluster, env) as first:
        made = json_of(await ok(first, "create_session"))
        assert made is not None
        session_id = made["session_id"]
        await ok(first, "run_python", code="shared = 'made by the first'", session_id=session_id)
        async with front_door(ray_cluster, env) as second:
            seen = await ok(second, "run_python", code="shared", session_id=session_id)
            assert "made by the first" in text_of(seen)
            await ok(second, "run_python", code="shared = 'changed by the second'", session_id=session_id)
        # The second front door is gone; the session is not.
        assert "changed by the second" in text_of(await ok(first, "run_python", code="shared", session_id=session_id))
        await ok(first, "manage_sessions", action="close", session_id=session_id)
        gone = await call(first, "run_python", code="1", session_id=session_id)
        assert gone.is_error and "unknown or expired" in text_of(gone)


async def test_progress_detach_and_cancel_cross_the_cluster(ray_cluster: RayCluster, dirs: ServerDirs) -> None:
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        session_id = json_of(await ok(client, "create_session"))["session_id"]  # type: ignore[index]
        notes: list[str] = []

        async def progress(done: float, total: float | None, message: str | None) -> None:
            notes.append(message or "")

        slow = "import time\nfor i in range(6):\n    print('tick', i, flush=True)\n    time.sleep(0.5)"
        result = await client.call_tool(
            "run_python", {"code": slow, "session_id": session_id}, progress_callback=progress
        )
        assert not result.is_error and "tick 5" in text_of(result)
        assert any("tick" in note for note in notes), notes  # output seen while it ran, from the node
        detached = await ok(client, "run_python", code="import time; time.sleep(60)", session_id=session_id,
                            detach_after_s=1)  # fmt: skip
        job_id = detached.meta["coderunner/job"]["job_id"]  # type: ignore[index]
        began = time.monotonic()
        cancelled = await call(client, "manage_jobs", action="cancel", job_id=job_id)
        assert "interrupted" in text_of(cancelled), text_of(cancelled)
        assert time.monotonic() - began < 30
        assert "2" in text_of(await ok(client, "run_python", code="1 + 1", session_id=session_id))
        await ok(client, "manage_sessions", action="close", session_id=session_id)


async def test_a_run_cancelled_before_its_first_answer_is_interrupted_on_its_node(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """The first answer of a run waits on the node for half a second; a cancel within it still reaches the cell."""
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        session_id = json_of(await ok(client, "create_session"))["session_id"]  # type: ignore[index]
        long_cell = "import time\ntime.sleep(40)\nfinished = True"
        with anyio.move_on_after(0.2):  # the client cancels its call (notifications/cancelled) at once
            await client.call_tool("run_python", {"code": long_cell, "session_id": session_id})
        check = "'finished' in globals()"
        for _ in range(100):  # until the kernel is free again: interrupted, not after its 40 s
            reply = await call(client, "run_python", code=check, session_id=session_id)
            if not reply.is_error:
                break
            assert "busy" in text_of(reply), text_of(reply)
            await anyio.sleep(0.2)
        assert not reply.is_error and "False" in text_of(reply), text_of(reply)
        await ok(client, "manage_sessions", action="close", session_id=session_id)


async def test_guest_tools_idle_reaping_and_big_files_cross_the_cluster(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    env = cluster_env(ray_cluster, dirs, CODERUNNER_IDLE_TIMEOUT_S="6")
    async with front_door(ray_cluster, env) as client:
        session_id = json_of(await ok(client, "create_session"))["session_id"]  # type: ignore[index]
        await ok(client, "run_python", session_id=session_id,
                 code="from PIL import Image; Image.new('RGB', (64, 32), 'red').save('red.png')")  # fmt: skip
        info = await ok(client, "image_ops", input_path="red.png", op="info", session_id=session_id)
        assert "64" in text_of(info) and "32" in text_of(info), text_of(info)
        # A file of several pieces (1 MiB each) both ways, checked byte for byte on the node.
        blob = "".join(f"{i:08d}\n" for i in range(300_000))  # 2.7 MB
        await ok(client, "write_file", path="blob.txt", content=blob, session_id=session_id)
        digest = await ok(client, "run_python", session_id=session_id,
                          code="import hashlib; hashlib.sha256(open('blob.txt','rb').read()).hexdigest()")  # fmt: skip
        assert __import__("hashlib").sha256(blob.encode()).hexdigest() in text_of(digest)
        # Left alone past idle_timeout_s, the node's manager closes it and its actor ends.
        assert await eventually(lambda: f"session-{session_id}" not in named_actors(ray_cluster), 60)
        gone = await call(client, "run_python", code="1", session_id=session_id)
        assert gone.is_error and "unknown or expired" in text_of(gone), text_of(gone)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


#: A file of several pieces (1 MiB each) and not a whole number of them.
BIG_EXPORT = 3 * 2**20 + 123
SAVE_TO_OUTBOX = f"""
import os
open('/mnt/outputs/table.csv', 'w').write('x,y\\n1,2\\n')
os.makedirs('/mnt/outputs/deep', exist_ok=True)
open('/mnt/outputs/deep/big.bin', 'wb').write(bytes(range(256)) * ({BIG_EXPORT} // 256) + b'z' * ({BIG_EXPORT} % 256))
os.symlink(CANARY_PATH, '/mnt/outputs/link.txt')
os.mkfifo('/mnt/outputs/pipe')
'saved'
"""


async def test_what_a_session_saves_to_its_outbox_reaches_the_front_doors_export_folder(
    ray_cluster: RayCluster, dirs: ServerDirs, canary: Path
) -> None:
    """The session lives on a worker node; its files land in the front door's export_dir/<client>, not in
    the node's, byte for byte, within the export limit, and never through a link the sandbox made."""
    exports = dirs.root / "exports"
    env = cluster_env(ray_cluster, dirs, CODERUNNER_EXPORT_DIR=str(exports), CODERUNNER_EXPORT_LIMIT_MB="4")
    async with front_door(ray_cluster, env) as client:
        sid = json_of(await ok(client, "create_session"))["session_id"]  # type: ignore[index]
        code = SAVE_TO_OUTBOX.replace("CANARY_PATH", repr(str(canary / "keep")))
        saved = text_of(await ok(client, "run_python", session_id=sid, code=code))
        [folder] = list(exports.iterdir())
        assert f"copied 2 file(s) from /mnt/outputs to {folder}: table.csv, deep/big.bin;" in saved, saved
        assert "link.txt (not a regular file)" in saved and "pipe (not a regular file)" in saved, saved
        assert (folder / "table.csv").read_text() == "x,y\n1,2\n"
        expected = bytes(range(256)) * (BIG_EXPORT // 256) + b"z" * (BIG_EXPORT % 256)
        assert (folder / "deep" / "big.bin").read_bytes() == expected
        assert sorted(os.listdir(folder)) == ["deep", "table.csv"]
        assert (canary / "keep").read_text() == "untouched"
        # write_file into the outbox leaves at once, as after a run.
        written = json_of(await ok(client, "write_file", path="/mnt/outputs/note.txt", content="hi", session_id=sid))
        assert "copied 1 file(s)" in written["exported"] and (folder / "note.txt").read_text() == "hi"  # type: ignore[index]
        # The export limit (4 MiB, 3 used) is this front door's, counted over the session.
        over = text_of(await ok(client, "run_python", session_id=sid,
                                code=f"open('/mnt/outputs/more.bin', 'wb').write(b'm' * {BIG_EXPORT})"))  # fmt: skip
        assert f"more.bin ({BIG_EXPORT:,} bytes: over the export limit" in over, over
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=sid))
        assert status["mounts"] == [{"sandbox": "/mnt/outputs", "mode": "rw", "exported": "after each call"}], status  # type: ignore[index]
        # What a thread writes after the last call leaves at the close.
        await ok(client, "run_python", session_id=sid, code="import threading\n"
                 "threading.Timer(0.3, lambda: open('/mnt/outputs/late.txt', 'w').write('late')).start()")  # fmt: skip
        await anyio.sleep(1.5)
        await ok(client, "manage_sessions", action="close", session_id=sid)
        assert (folder / "late.txt").read_text() == "late"
        # A one-shot run is a call of some node's agent: its files come back in the call's answer.
        code = "import os; open('/mnt/outputs/once.txt', 'w').write('once'); os.symlink(CANARY, '/mnt/outputs/l')"
        ran = json_of(await ok(client, "execute_code", language="python",
                               code=code.replace("CANARY", repr(str(canary / "keep")))))  # fmt: skip
        assert f"copied 1 file(s) from /mnt/outputs to {folder}: once.txt" in ran["exported"], ran  # type: ignore[index]
        assert "l (not a regular file)" in ran["exported"] and (folder / "once.txt").read_text() == "once", ran  # type: ignore[index]
        assert text_of(await ok(client, "run_python", code="6 * 7")).splitlines()[0] == "42"  # still serving
    on_nodes = [path for name in ("w1", "w2") for path in (ray_cluster.temp_dir / name / "out").rglob("*")]
    assert not on_nodes, on_nodes  # nothing lands in a node's own folder, nor stays there (a one-shot's own)


async def test_snapshots_and_persistent_workspaces_live_on_their_node(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        made = json_of(await ok(client, "create_session", memory_mb=1024))  # three fit on one worker
        assert made is not None
        source, home = made["session_id"], made["node"]
        await ok(client, "run_python", code="kept = [1, 2, 3]\nopen('notes.txt', 'w').write('saved')",
                 session_id=source)  # fmt: skip
        taken = json_of(await ok(client, "manage_snapshots", action="save", session_id=source, name="first"))
        assert taken is not None
        listed = json_of(await ok(client, "manage_snapshots", action="list"))
        assert listed is not None and [entry["snapshot"] for entry in listed["snapshots"]] == [taken["snapshot"]]
        restored = json_of(await ok(client, "manage_snapshots", action="restore", snapshot=taken["snapshot"]))
        assert restored is not None and "kept" in restored["restored"], restored
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=restored["session_id"]))
        assert status is not None and status["node"] == home  # restored where the snapshot is
        back = await ok(client, "run_python", code="print(kept, open('notes.txt').read())",
                        session_id=restored["session_id"])  # fmt: skip
        assert "[1, 2, 3] saved" in text_of(back)
        forked = json_of(await ok(client, "manage_snapshots", action="fork", session_id=source))
        assert forked is not None and "kept" in forked["restored"]
        await ok(client, "manage_snapshots", action="delete", snapshot=taken["snapshot"])
        assert json_of(await ok(client, "manage_snapshots", action="list")) == {"snapshots": []}
        for session_id in (source, restored["session_id"], forked["session_id"]):
            await ok(client, "manage_sessions", action="close", session_id=session_id)
        # A persistent workspace reopens on the node that holds it, with its files.
        first = json_of(await ok(client, "create_session", name="proj", persistent=True))
        assert first is not None
        await ok(client, "write_file", path="keep.txt", content="still here", session_id=first["session_id"])
        await ok(client, "manage_sessions", action="close", session_id=first["session_id"])
        again = json_of(await ok(client, "create_session", name="proj", persistent=True))
        assert again is not None and again["node"] == first["node"]
        assert "still here" in text_of(await ok(client, "read_file", path="keep.txt", session_id=again["session_id"]))
        await ok(client, "manage_sessions", action="close", session_id=again["session_id"])
        listed_workspaces = json_of(await ok(client, "manage_workspaces", action="list"))
        assert listed_workspaces is not None and [w["name"] for w in listed_workspaces["workspaces"]] == ["proj"]
        await ok(client, "manage_workspaces", action="delete", name="proj")
        assert json_of(await ok(client, "manage_workspaces", action="list")) == {"workspaces": []}
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)


async def test_one_shot_runs_are_calls_of_the_node_agents_and_the_next_is_served_warm(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """execute_code runs in a sandbox of a node agent, as on one machine: output, stdin, exit code, a syntax
    check, a detached run cancelled. After a run the agent starts a sandbox ahead for the next with the same
    options, and placement sends that next run to it; one no run takes is dropped (READY_IDLE_S), so
    nothing is left on any node."""
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        ran = json_of(await ok(client, "execute_code", language="python", code="import sys; print(6 * 7); "
                               "print(sys.stdin.read())", stdin="fed in"))  # fmt: skip
        assert ran is not None and ran["stdout"] == "42\nfed in\n" and ran["exit_code"] == 0, ran
        failed = json_of(await call(client, "execute_code", language="python", code="raise SystemExit(3)"))
        assert failed is not None and failed["exit_code"] == 3
        checked = json_of(await ok(client, "execute_code", check_only=True, language="python", code="def f(:\n pass"))
        assert checked is not None and checked["valid"] is False and checked["errors"][0]["line"] == 1
        slow = await ok(client, "execute_code", language="python", code="import time; time.sleep(60)",
                        detach_after_s=1)  # fmt: skip
        job_id = json_of(slow)["job_id"]  # type: ignore[index]
        began = time.monotonic()
        await call(client, "manage_jobs", action="cancel", job_id=job_id)
        assert time.monotonic() - began < 30

        def runs_taken() -> int:
            """Runs that took a sandbox started ahead, over every agent."""
            return sum(
                held["runs"]["runs_taken"] for held in agents_held(ray_cluster).values() if held and held["runs"]
            )

        taken = runs_taken()
        for _ in range(3):
            again = json_of(await ok(client, "execute_code", language="python", code="print('again')"))
            assert again is not None and again["stdout"] == "again\n", again
        assert runs_taken() > taken, agents_held(ray_cluster)  # a run took a sandbox started ahead on its agent
    assert await eventually(lambda: not sandboxes_on(ray_cluster), READY_IDLE_S + 60), described(
        sandboxes_on(ray_cluster)
    )


async def test_a_create_claims_a_warm_session_from_a_node_pool(ray_cluster: RayCluster, dirs: ServerDirs) -> None:
    env = cluster_env(ray_cluster, dirs, CODERUNNER_POOL_SIZE="1")
    try:
        async with front_door(ray_cluster, env) as client:
            # Each worker's agent keeps one warm sandbox (its manager's own pool of one).
            assert await eventually(lambda: _warm(ray_cluster) == [1, 1], 120), agents_held(ray_cluster)
            made = json_of(await ok(client, "create_session"))
            assert made is not None and _taken(ray_cluster) == 1  # claimed, not started cold
            assert "2" in text_of(await ok(client, "run_python", code="1 + 1", session_id=made["session_id"]))
            # Its pool starts a replacement; the claimed one is the caller's alone.
            assert await eventually(lambda: _warm(ray_cluster) == [1, 1], 120), agents_held(ray_cluster)
            # A named session's workspace is its own from the start: never a warm sandbox (warm_take.py).
            other = json_of(await ok(client, "create_session", name="its-own"))
            assert other is not None and _taken(ray_cluster) == 1 and _warm(ray_cluster) == [1, 1]  # started cold
            for session_id in (made["session_id"], other["session_id"]):
                await ok(client, "manage_sessions", action="close", session_id=session_id)
    finally:
        _stop_pools(ray_cluster)
    assert await eventually(lambda: not named_actors(ray_cluster), 60), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


def _agents(cluster: RayCluster, key: str | None = None) -> list[dict[str, Any]]:
    """The node agents' holdings (of the settings `key` only, if given), in node order."""
    found = [held for held in agents_held(cluster).values() if held is not None and key in (None, held["key"])]
    return sorted(found, key=lambda held: str(held["node"]))


def _warm(cluster: RayCluster, key: str | None = None) -> list[int]:
    """Warm sandboxes ready in each agent that keeps a pool (of the settings `key` only, if given)."""
    return [int(held["warm"]) for held in _agents(cluster, key) if held["pool_size"] > 0]


def _taken(cluster: RayCluster, key: str | None = None) -> int:
    return sum(int(held["taken"]) for held in _agents(cluster, key))


def _stop_pools(cluster: RayCluster) -> None:
    """Agents (and their warm pools) outlive front doors (they are the cluster's): this test ends them."""
    done = cluster.run_python(
        "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR')\n"
        "for a in ray.util.list_named_actors(all_namespaces=True):\n"
        "    if a['namespace'] == 'coderunner':\n"
        "        ray.kill(ray.get_actor(a['name'], namespace='coderunner'), no_restart=True)\n",
        cluster.address,
    )
    assert done.returncode == 0, done.stderr[-2000:]


async def test_a_session_no_node_can_hold_is_refused_clearly(ray_cluster: RayCluster, dirs: ServerDirs) -> None:
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        refused = await call(client, "create_session", memory_mb=64 * 1024)
        text = text_of(refused)
        assert refused.is_error and "no node of the cluster can hold this session" in text, text
        assert "65,536 MiB" in text and "backends: bwrap" in text  # what was asked, and what there is
        assert "2" in text_of(await ok(client, "run_python", code="1 + 1"))  # the front door still serves
        await call(client, "manage_sessions", action="close", session_id="")


async def test_a_front_door_with_mounts_not_declared_shared_refuses_to_start(
    ray_cluster: RayCluster, dirs: ServerDirs, tmp_path: Path
) -> None:
    """A node binds a mount from its own disk: unless the user declares the folder shared, no front door starts."""
    (tmp_path / "data").mkdir()
    argv = [*ray_cluster.exec_prefix, sys.executable, "-m", "coderunner.cli", "serve", "--ray", ray_cluster.address,
            "--mount", f"{tmp_path / 'data'}:/data"]  # fmt: skip
    env = cluster_env(ray_cluster, dirs)
    started = subprocess.run(argv, env=env, cwd=str(REPO), stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert started.returncode != 0, started.stderr
    assert "cluster mode refuses mounts" in started.stderr and "set mounts_shared = true" in started.stderr, (
        started.stderr
    )


async def test_a_shared_mount_missing_on_the_node_fails_the_create_naming_node_and_path(
    ray_cluster: RayCluster, dirs: ServerDirs, tmp_path: Path
) -> None:
    """Declared shared but absent where the session lands: the create says which node lacks which folder."""
    source = tmp_path / "shared"
    source.mkdir()  # the front door checks its mounts at start; the node finds it gone at the create
    mounts = json.dumps([f"{source}:/data"])
    env = cluster_env(ray_cluster, dirs, CODERUNNER_MOUNTS=mounts, CODERUNNER_MOUNTS_SHARED="true")
    async with front_door(ray_cluster, env) as client:
        source.rmdir()
        refused = await call(client, "create_session")
        text = text_of(refused)
        assert refused.is_error and "could not start on node" in text, text
        assert f"mount source {source} does not exist" in text and "Error(" not in text, text


async def test_node_labels_hold_a_front_doors_sessions_to_the_labelled_nodes(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    held = cluster_env(
        ray_cluster, dirs, CODERUNNER_POOL_SIZE="0", CODERUNNER_RAY_NODE_LABELS=f'{{"{NODE_LABEL}": "w2"}}'
    )
    async with front_door(ray_cluster, held) as client:
        ids = []
        for _ in range(2):  # each fits on either worker: Ray alone would spread or pick either
            made = json_of(await ok(client, "create_session", cpus=0.5))
            assert made is not None and node_name(ray_cluster, made["node"]) == "w2", made
            ids.append(made["session_id"])
        assert "2" in text_of(await ok(client, "run_python", code="1 + 1", session_id=ids[0]))
        for session_id in ids:
            await ok(client, "manage_sessions", action="close", session_id=session_id)
    nowhere = cluster_env(
        ray_cluster, dirs, CODERUNNER_POOL_SIZE="0", CODERUNNER_RAY_NODE_LABELS=f'{{"{NODE_LABEL}": "w9"}}'
    )
    async with front_door(ray_cluster, nowhere) as client:
        refused = await call(client, "create_session")
        text = text_of(refused)
        assert refused.is_error and f"a node labelled {NODE_LABEL}=w9" in text, text
        assert f"labels: {NODE_LABEL}=w1" in text and f"labels: {NODE_LABEL}=w2" in text  # what there is
        # Refused by the check (not after waiting PLACE_S for a node that never comes), saying how to add one.
        assert "no node of the cluster can hold this session" in text and "ray start --labels" in text
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster)), described(sandboxes_on(ray_cluster))


FETCH = """
import time, urllib.request, urllib.error
time.sleep({pause})
try:
    urllib.request.urlopen("http://{host}/", timeout=30)
except urllib.error.HTTPError as error:
    print("HTTP", error.code)
"""


async def test_an_allowlist_sessions_denials_reach_the_reply_and_status_from_its_node(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """The node's proxy decides; the front door's reply names what was denied and how to allow it."""
    env = cluster_env(ray_cluster, dirs, CODERUNNER_ALLOWED_DOMAINS='["a.example.org", "b.example.org"]')
    async with front_door(ray_cluster, env) as client:
        made = json_of(await ok(client, "create_session", network="allowlist", allow=["a.example.org"]))
        assert made is not None
        session_id = made["session_id"]
        # A quick cell (its whole answer in the first call) and a slow one (read by the pump after).
        for host, pause in (("b.example.org", 0), ("outside.example.net", 1.5)):
            reply = text_of(await ok(client, "run_python", code=FETCH.format(host=host, pause=pause),
                                     session_id=session_id))  # fmt: skip
            assert "HTTP 403" in reply, reply
            assert f"[network: denied {host}:80 (" in reply, reply
        assert "b.example.org" not in reply, reply  # a reply names only the hosts denied during its call
        quiet = text_of(await ok(client, "run_python", code="1 + 1", session_id=session_id))
        assert "[network:" not in quiet, quiet
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=session_id))
        assert status is not None and "egress" in status, status
        egress = status["egress"]
        assert egress["allowed_hosts"] == ["a.example.org"] and egress["totals"]["denied"] == 2, egress
        assert [row["host"] for row in egress["recent"]] == ["b.example.org", "outside.example.net"], egress
        await ok(client, "manage_sessions", action="close", session_id=session_id)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)


async def test_the_user_is_asked_about_a_host_across_the_cluster(ray_cluster: RayCluster, dirs: ServerDirs) -> None:
    """A host inside the user's ceiling but outside the session's list: the node's proxy asks, the front
    door puts it to its client (elicitation), and the answer decides on the node."""
    asked = Asked()
    env = cluster_env(
        ray_cluster, dirs, CODERUNNER_ALLOWED_DOMAINS='["a.example.org", "b.example.org", "c.example.org"]'
    )
    async with front_door(ray_cluster, env, mode="legacy", elicitation_callback=asked) as client:
        made = json_of(await ok(client, "create_session", network="allowlist", allow=["a.example.org"]))
        assert made is not None
        session_id = made["session_id"]
        asked.answer = "decline"
        declined = text_of(await ok(client, "run_python", code=FETCH.format(host="b.example.org", pause=0),
                                    session_id=session_id))  # fmt: skip
        assert len(asked.messages) == 1 and "b.example.org:80" in asked.messages[0], (asked.messages, declined)
        assert "HTTP 403" in declined and "[network: denied b.example.org:80 (the user declined)]" in declined, declined
        asked.answer = "accept"
        await call(client, "run_python", code=FETCH.format(host="c.example.org", pause=1), session_id=session_id)
        assert len(asked.messages) == 2 and "c.example.org:80" in asked.messages[1], asked.messages
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=session_id))
        assert status is not None and status["egress"]["allowed_hosts"] == ["a.example.org", "c.example.org"], status
        # b was declined for this session: not asked again.
        await call(client, "run_python", code=FETCH.format(host="b.example.org", pause=0), session_id=session_id)
        assert len(asked.messages) == 2, asked.messages
        await ok(client, "manage_sessions", action="close", session_id=session_id)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)


async def test_the_user_is_asked_during_guest_tools_and_installs_across_the_cluster(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """install_packages and browser_navigate are one actor call each: their node's proxy asks through a read of
    its own, put to the user as during run_python, and the answer decides on the node (and is in its audit)."""
    asked = Asked()
    audit = dirs.root / "egress.jsonl"
    ceiling = '["a.example.org", "c.example.org", "python-packages"]'
    env = cluster_env(ray_cluster, dirs, CODERUNNER_ALLOWED_DOMAINS=ceiling, CODERUNNER_EGRESS_AUDIT_LOG=str(audit))
    async with front_door(ray_cluster, env, mode="legacy", elicitation_callback=asked) as client:
        made = json_of(await ok(client, "create_session", network="allowlist", allow=["a.example.org"]))
        assert made is not None
        session_id = made["session_id"]
        asked.answer = "decline"
        refused = await call(client, "install_packages", packages=["six"], session_id=session_id)
        # pip's index host is put to the user before pip runs; declined, the install stops there.
        assert len(asked.messages) == 1 and ":443" in asked.messages[0], (asked.messages, text_of(refused))
        index_host = asked.messages[0].split(" wants to connect to ")[1].split(":")[0]
        assert refused.is_error and f"[network: denied {index_host}:443 (the user declined)]" in text_of(refused)
        asked.answer = "accept"
        await call(client, "browser_navigate", url="http://c.example.org/", session_id=session_id)
        assert len(asked.messages) == 2 and "c.example.org:80" in asked.messages[1], asked.messages
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=session_id))
        assert status is not None and status["egress"]["allowed_hosts"] == ["a.example.org", "c.example.org"], status
        # The declined host is not asked about again, in this call or the next.
        again = await call(client, "install_packages", packages=["six"], session_id=session_id)
        assert again.is_error and len(asked.messages) == 2, (asked.messages, text_of(again))
        await ok(client, "manage_sessions", action="close", session_id=session_id)

    def declined_in_audit() -> bool:
        rows = [json.loads(line) for line in audit.read_text().splitlines()] if audit.exists() else []
        return any(row["host"] == index_host and not row["allowed"] and "declined" in row["reason"] for row in rows)

    assert await eventually(declined_in_audit), audit.read_text() if audit.exists() else "no audit file"
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)


async def test_an_allowlist_one_shot_runs_denials_reach_the_reply_from_its_node(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """execute_code runs in a node agent: its node's proxy decides, and the reply's `network` line names what it denied,
    as on one machine. A one-shot run's list is the whole ceiling, so nobody is asked: a host inside
    allowed_domains is let through, one outside is denied, and the node's audit holds both decisions."""
    asked = Asked()
    asked.answer = "accept"
    audit = dirs.root / "egress-oneshot.jsonl"
    env = cluster_env(ray_cluster, dirs, CODERUNNER_ALLOWED_DOMAINS='["a.example.org"]',
                      CODERUNNER_EGRESS_AUDIT_LOG=str(audit))  # fmt: skip
    async with front_door(ray_cluster, env, mode="legacy", elicitation_callback=asked) as client:
        code = FETCH.format(host="outside.example.net", pause=0)
        ran = json_of(await ok(client, "execute_code", language="python", code=code, network="allowlist"))
        assert ran is not None and "HTTP 403" in ran["stdout"], ran
        assert ran["network"].startswith("network: denied outside.example.net:80 (not in the user's allowed_domains")
        assert not asked.messages, asked.messages
        # A host inside allowed_domains is in the run's list: let through unasked (its name resolves nowhere
        # in the test's network, so the proxy answers 5xx, with no denial line).
        inside = json_of(await call(client, "execute_code", language="python", code=FETCH.format(host="a.example.org",
                                    pause=0), network="allowlist"))  # fmt: skip
        assert inside is not None and "HTTP 5" in inside["stdout"] and "network" not in inside, inside
        assert not asked.messages, asked.messages
        quiet = json_of(await ok(client, "execute_code", language="python", code="print(1)", network="allowlist"))
        assert quiet is not None and "network" not in quiet, quiet
        offline = json_of(await call(client, "execute_code", language="python", code=code, network="none"))
        # No denial line (no proxy there), but the network being off is said where the code failed for it.
        assert offline is not None and offline["exit_code"] != 0, offline
        assert offline.get("network", "").startswith("network is off in this run (network 'none')"), offline

    def decided_in_audit() -> bool:
        rows = [json.loads(line) for line in audit.read_text().splitlines()] if audit.exists() else []
        hosts = {(row["host"], row["allowed"]) for row in rows}
        return ("outside.example.net", False) in hosts and ("a.example.org", True) in hosts

    assert await eventually(decided_in_audit), audit.read_text() if audit.exists() else "no audit file"
    # The 'none' run's agent started a sandbox ahead for the next such run: dropped when none takes it.
    assert await eventually(lambda: not sandboxes_on(ray_cluster), READY_IDLE_S + 60), described(
        sandboxes_on(ray_cluster)
    )


#: Sessions opened at once through one front door in the many-sessions test (0.1 CPU, 512 MiB each: eight
#: fit on a worker's 4 GiB).
MANY = 10


async def test_many_sessions_share_one_agent_per_node_and_each_keeps_its_own_state(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        made: list[dict[str, Any]] = []

        async def create() -> None:
            opened = json_of(await ok(client, "create_session", memory_mb=512))
            assert opened is not None
            made.append(opened)

        async with anyio.create_task_group() as group:
            for _ in range(MANY):
                group.start_soon(create)
        ids = [opened["session_id"] for opened in made]
        for number, session_id in enumerate(ids):
            await ok(client, "run_python", code=f"mine = {number}", session_id=session_id)
        for number, session_id in enumerate(ids):
            assert f"{number * 3}" in text_of(await ok(client, "run_python", code="mine * 3", session_id=session_id))
        # One agent per worker holds them all (no actor per session), and each id names its agent's node.
        held = _agents(ray_cluster, ids[0].rsplit("-", 1)[1])  # this front door's settings key
        assert sorted(node_name(ray_cluster, agent["node"]) for agent in held) == ["w1", "w2"], held
        assert sorted(sid for agent in held for sid in agent["sessions"]) == sorted(ids), held
        for agent in held:
            assert all(sid.split("-")[-2] == agent["node"][:12] for sid in agent["sessions"]), agent
        assert {node_name(ray_cluster, opened["node"]) for opened in made} == {"w1", "w2"}  # spread by load
        assert max(len(agent["sessions"]) for agent in held) >= MANY // 2
        # Their calls went by the agents' session channels (a create's open, each run), not by Ray's actor calls.
        assert sum(agent["channel_calls"] for agent in held) >= 2 * MANY, held
        for session_id in ids:
            await ok(client, "manage_sessions", action="close", session_id=session_id)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


async def sessions_sharing_an_agent(client: Client) -> tuple[list[tuple[str, str]], str, list[str]]:
    """Three sessions (id, node), two workers: the node at least two of them share, and those (its agent's)."""
    ids = []
    for _ in range(3):
        made = json_of(await ok(client, "create_session", cpus=0.5, memory_mb=512))
        assert made is not None
        ids.append((made["session_id"], made["node"]))
    node = max({where for _, where in ids}, key=lambda where: sum(w == where for _, w in ids))
    mates = [other for other, where in ids if where == node]
    assert len(mates) >= 2, ids
    return ids, node, mates


async def test_a_node_agent_sigkilled_hands_its_sessions_to_the_next_which_keeps_their_state(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """Its sessions' sandboxes and kernels are processes of their own: killed outright while its sessions hold
    state and one runs a cell, the agent's watcher keeps what the agent kept (sessions/adoption.py) and waits for
    the node's next agent, which the front door starts at the call that found the agent dead. Every session comes
    back with its variables; the cell went on in its kernel; the call under way says what happened; the canary's
    sandbox never stopped; a session on the other node is unharmed; and closing them all leaves nothing."""
    canary = f"canary-{secrets.token_hex(6)}"
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        ids, node, mates = await sessions_sharing_an_agent(client)
        for other, _ in ids:
            await ok(client, "run_python", code="kept = 'yes'", session_id=other)
        await ok(client, "run_python", session_id=mates[0], code=CANARY.format(token=canary))
        assert await eventually(lambda: len(with_token(canary)) == 1), "the canary did not start"
        sandbox = sandbox_of(canary)  # from the topmost bwrap above it: the kernel template's, for a forked kernel
        stat = Path(f"/proc/{next(iter(sandbox))}/stat").read_text().rpartition(")")[2].split()
        agent = int(stat[1])
        assert "NodeAgent" in Path(f"/proc/{agent}/cmdline").read_text(errors="replace"), agent
        (canary_pid,) = with_token(canary)
        kept = {pid: started for pid, started in sandbox.items() if pid in (canary_pid, _ppid(canary_pid))}
        assert len(kept) == 2, (kept, described(list(sandbox)))  # the canary and its kernel
        # Where the dead agent's watcher will wait for its successor: a socket no sandbox may reach.
        key = next(holds["key"] for holds in agents_held(ray_cluster).values() if holds and holds["pid"] == agent)
        socket_path = handover_path(ray_cluster.temp_dir / node_name(ray_cluster, node) / "run", agent_name(node, key))
        under_way: dict[str, CallToolResult] = {}

        async def slow_cell() -> None:  # runs on through the kill, trying the watcher's socket all the while
            code = REACH_FOR.format(path=str(socket_path)) + "late = 'ran on'"
            under_way["run"] = await call(client, "run_python", session_id=mates[1], code=code)

        async with anyio.create_task_group() as group:
            group.start_soon(slow_cell)
            await anyio.sleep(1.5)
            os.kill(agent, signal.SIGKILL)
            with anyio.fail_after(10):
                while not socket_path.exists():  # the watcher waits there for the next agent
                    await anyio.sleep(0.01)
        said = text_of(under_way["run"])
        assert under_way["run"].is_error and "took the session over" in said and "kernel, variables" in said, said
        assert alive(kept) == list(kept), "the kept session's kernel stopped"
        for other, _ in ids:
            assert "'yes'" in text_of(await ok(client, "run_python", code="kept", session_id=other))
        assert "'ran on'" in text_of(await ok(client, "run_python", code="late", session_id=mates[1]))
        tried = text_of(await ok(client, "run_python", code="sorted(reached)", session_id=mates[1]))
        assert "FileNotFoundError" in tried and "CONNECTED" not in tried, tried  # never found from the sandbox
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=mates[0]))
        assert status is not None and "adopted" in json.dumps(status), status
        held = {holds["pid"]: holds for holds in agents_held(ray_cluster).values() if holds is not None}
        heir = next(holds for holds in held.values() if set(mates) <= set(holds["sessions"]))
        assert heir["pid"] != agent
        assert not Path(f"/proc/{agent}").exists()
        assert set(heir["kept"].values()) == {"kept"}, heir["kept"]
        os.kill(heir["pid"], signal.SIGKILL)  # and again: the heir kept what it took over
        await anyio.sleep(1.0)
        answers: list[str] = []

        async def ask(other: str) -> None:  # all at once: every call waits for the take-over, not only the first
            answers.append(text_of(await ok(client, "run_python", code="kept", session_id=other)))

        async with anyio.create_task_group() as group:
            for other in mates:
                group.start_soon(ask, other)
        assert len(answers) == len(mates) and all("'yes'" in answer for answer in answers), answers
        for other, _ in ids:
            await ok(client, "manage_sessions", action="close", session_id=other)
    assert not with_token(canary)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


async def test_an_allowlist_session_outlives_its_agent_with_its_proxy_and_the_users_decisions(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """An allowlist session's proxy ran in its agent: killed outright, the agent's watcher keeps the proxy's socket
    (listening) with the session, and the next agent serves it with the session's list and what the user decided
    since (a host allowed, one declined: neither asked again). A fetch made while no agent served the socket waits
    in its backlog and is answered by the next one; the kernel keeps its variables."""
    asked = Asked()
    ceiling = '["a.example.org", "b.example.org", "c.example.org"]'
    env = cluster_env(ray_cluster, dirs, CODERUNNER_ALLOWED_DOMAINS=ceiling)
    async with front_door(ray_cluster, env, mode="legacy", elicitation_callback=asked) as client:
        made = json_of(await ok(client, "create_session", network="allowlist", allow=["a.example.org"]))
        assert made is not None
        session_id = made["session_id"]
        await ok(client, "run_python", code="kept = 'yes'", session_id=session_id)
        asked.answer = "decline"
        await call(client, "run_python", code=FETCH.format(host="b.example.org", pause=0), session_id=session_id)
        asked.answer = "accept"
        await call(client, "run_python", code=FETCH.format(host="c.example.org", pause=0), session_id=session_id)
        assert len(asked.messages) == 2, asked.messages
        holds = agent_holding(ray_cluster, session_id)
        assert holds is not None, "no agent holds the session"
        assert holds["kept"] == {session_id: "kept"}, holds["kept"]
        under_way: dict[str, CallToolResult] = {}

        async def fetch_across_the_kill() -> None:  # its fetch is made while no agent serves the proxy's socket
            code = "late = 'no answer'\n" + FETCH.format(host="outside.example.net", pause=2).replace(
                'print("HTTP", error.code)', 'late = f"HTTP {error.code}"'
            )
            under_way["run"] = await call(client, "run_python", session_id=session_id, code=code)

        async with anyio.create_task_group() as group:
            group.start_soon(fetch_across_the_kill)
            await anyio.sleep(1.0)
            os.kill(holds["pid"], signal.SIGKILL)
        said = text_of(under_way["run"])
        assert under_way["run"].is_error and "took the session over" in said, said
        assert "'yes'" in text_of(await ok(client, "run_python", code="kept", session_id=session_id))
        late = "late"
        with anyio.fail_after(60):
            while "no answer" in (late := text_of(await ok(client, "run_python", code="late", session_id=session_id))):
                await anyio.sleep(0.5)
        assert "HTTP 403" in late, late  # the next agent's proxy answered the fetch the dead one never took
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=session_id))
        assert status is not None and status["egress"]["allowed_hosts"] == ["a.example.org", "c.example.org"], status
        assert "adopted" in json.dumps(status), status
        again = text_of(await call(client, "run_python", code=FETCH.format(host="b.example.org", pause=0),
                                   session_id=session_id))  # fmt: skip
        assert "HTTP 403" in again, again
        assert len(asked.messages) == 2, asked.messages  # neither host asked about again
        status = json_of(await ok(client, "manage_sessions", action="status", session_id=session_id))
        assert status is not None and "declined" in json.dumps(status["egress"]["recent"][-1]), status["egress"]
        heir = agent_holding(ray_cluster, session_id)
        assert heir is not None, "no next agent holds the session"
        assert heir["pid"] != holds["pid"] and heir["kept"] == {session_id: "kept"}, heir
        await ok(client, "manage_sessions", action="close", session_id=session_id)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


async def test_a_persistent_workspace_outlives_its_agent_and_stays_locked_to_its_session(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """A named session's workspace has a lock of its own, kept with the rest: after its agent is killed outright
    the next agent holds it (a second session of that name is refused meanwhile), the kernel and the files are as
    they were, and closing it keeps the files for the next session of that name."""
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        made = json_of(await ok(client, "create_session", name="kept-proj", persistent=True))
        assert made is not None
        session_id = made["session_id"]
        await ok(client, "run_python", session_id=session_id,
                 code="kept = 'yes'\nopen('notes.txt', 'w').write('written before')")  # fmt: skip
        holds = agent_holding(ray_cluster, session_id)
        assert holds is not None, "no agent holds the session"
        assert holds["kept"] == {session_id: "kept"}, holds["kept"]
        os.kill(holds["pid"], signal.SIGKILL)
        await anyio.sleep(1.0)
        back = text_of(
            await ok(client, "run_python", session_id=session_id, code="print(kept, open('notes.txt').read())")
        )
        assert "yes written before" in back, back
        twin = await call(client, "create_session", name="kept-proj", persistent=True)
        assert twin.is_error and "in use" in text_of(twin), text_of(twin)
        heir = agent_holding(ray_cluster, session_id)
        assert heir is not None, "no next agent holds the session"
        assert heir["pid"] != holds["pid"] and heir["kept"] == {session_id: "kept"}, heir
        await ok(client, "manage_sessions", action="close", session_id=session_id)
        again = json_of(await ok(client, "create_session", name="kept-proj", persistent=True))
        assert again is not None and again["node"] == made["node"], (again, made)
        reread = text_of(await ok(client, "read_file", path="notes.txt", session_id=again["session_id"]))
        assert "written before" in reread, reread
        await ok(client, "manage_sessions", action="close", session_id=again["session_id"])
        await ok(client, "manage_workspaces", action="delete", name="kept-proj")
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


#: A cell that tries, for 4 s, to connect to a dead agent's hand-over socket by its host path (`reached`: what
#: each try raised, or CONNECTED).
REACH_FOR = """
import socket, time
reached, end = set(), time.time() + 4
while time.time() < end:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect({path!r})
        reached.add("CONNECTED")
    except OSError as exc:
        reached.add(type(exc).__name__)
    finally:
        probe.close()
    time.sleep(0.02)
"""


async def test_a_node_agent_with_no_front_door_left_ends_its_sessions_after_the_grace(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """A dead agent's watcher waits agent_handover_s for the next agent, no longer: with no front door left to
    start one, its kept sandboxes end by their pidfds, and a front door that comes later finds no such session."""
    canary = f"canary-{secrets.token_hex(6)}"
    env = cluster_env(ray_cluster, dirs, CODERUNNER_AGENT_HANDOVER_S="2")
    async with front_door(ray_cluster, env) as client:
        made = json_of(await ok(client, "create_session", cpus=0.5, memory_mb=512))
        assert made is not None
        session_id = made["session_id"]
        await ok(client, "run_python", session_id=session_id, code=CANARY.format(token=canary))
        assert await eventually(lambda: len(with_token(canary)) == 1), "the canary did not start"
    sandbox = sandbox_of(canary)  # the session stays on its node: create_session's sessions outlive a front door
    stat = Path(f"/proc/{next(iter(sandbox))}/stat").read_text().rpartition(")")[2].split()
    os.kill(int(stat[1]), signal.SIGKILL)
    assert await eventually(lambda: not alive(sandbox), 30), described(alive(sandbox))
    async with front_door(ray_cluster, env) as client:
        gone = await call(client, "run_python", session_id=session_id, code="1 + 1")
        assert gone.is_error and "unknown or expired session_id" in text_of(gone), text_of(gone)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


async def test_a_node_agents_death_is_noticed_and_its_idle_sessions_taken_over_without_a_call(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """The front door keeps a call waiting on each agent it holds sessions on (agent_link.py's life watch): when
    the agent dies, it starts the node's next agent at once, which takes the sessions over within the grace,
    though nobody calls them. Past the grace, their state is still there."""
    grace_s = 12.0
    env = cluster_env(ray_cluster, dirs, CODERUNNER_AGENT_HANDOVER_S=str(grace_s))
    async with front_door(ray_cluster, env) as client:
        made = json_of(await ok(client, "create_session", cpus=0.5, memory_mb=512))
        assert made is not None
        session_id = made["session_id"]
        await ok(client, "run_python", session_id=session_id, code="kept = 'yes'")
        holds = agent_holding(ray_cluster, session_id)
        assert holds is not None, "no agent holds the session"
        killed = anyio.current_time()
        os.kill(holds["pid"], signal.SIGKILL)

        def heir_holds_it() -> bool:
            heir = agent_holding(ray_cluster, session_id)
            return heir is not None and heir["pid"] != holds["pid"]

        assert await eventually(heir_holds_it, grace_s), "no next agent took the session over without a call"
        await anyio.sleep_until(killed + grace_s + 2)  # past the grace: a session only the watcher held would be gone
        assert "'yes'" in text_of(await ok(client, "run_python", code="kept", session_id=session_id))
        await ok(client, "manage_sessions", action="close", session_id=session_id)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


async def test_a_node_agent_sigkilled_without_hand_over_loses_its_sessions_clearly_and_leaves_nothing(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """With agent_handover_s 0, an agent is its sandboxes' server: killed outright, its watcher kills them by the
    pidfds it holds (sandbox/bwrap_watch.py), each init ends with its gate, and nothing of them is left; every
    session it held answers "lost", and the next session on that node gets a new agent."""
    canary = f"canary-{secrets.token_hex(6)}"
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs, CODERUNNER_AGENT_HANDOVER_S="0")) as client:
        ids, _, mates = await sessions_sharing_an_agent(client)
        session_id = mates[0]
        for other in mates:
            await ok(client, "run_python", code="kept = 'yes'", session_id=other)
        await ok(client, "run_python", session_id=session_id, code=CANARY.format(token=canary))
        assert await eventually(lambda: len(with_token(canary)) == 1), "the canary did not start"
        sandbox = sandbox_of(canary)
        outer = next(iter(sandbox))
        stat = Path(f"/proc/{outer}/stat").read_text().rpartition(")")[2].split()
        agent = int(stat[1])
        assert "NodeAgent" in Path(f"/proc/{agent}/cmdline").read_text(errors="replace"), agent
        its_own = descendants(agent)
        assert len([pid for pid in its_own if _comm(pid) == "bwrap"]) >= len(mates), its_own
        os.kill(agent, signal.SIGKILL)
        assert await eventually(lambda: not alive(its_own), 60), alive(its_own)
        assert not with_token(canary)
        for other in mates:
            gone = await call(client, "run_python", session_id=other, code="kept")
            # "with the agent of node N" (or "with node N" when Ray first calls it unavailable): never a hang.
            assert gone.is_error and f"session {other} was lost with" in text_of(gone), text_of(gone)
        again = json_of(await ok(client, "create_session", cpus=0.5, memory_mb=512))  # a new agent where needed
        assert again is not None
        assert "2" in text_of(await ok(client, "run_python", code="1 + 1", session_id=again["session_id"]))
        for other, _ in ids:
            if other not in mates:
                await ok(client, "manage_sessions", action="close", session_id=other)
        await ok(client, "manage_sessions", action="close", session_id=again["session_id"])
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


@contextlib.contextmanager
def http_front_door(cluster: RayCluster, env: dict[str, str], port: int, log: Path) -> Any:
    argv = [*cluster.exec_prefix, sys.executable, "-m", "coderunner.cli", "serve", "--ray", cluster.address,
            "--transport", "streamable-http", "--port", str(port)]  # fmt: skip
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.asynccontextmanager
async def through_proxy(cluster: RayCluster, env: dict[str, str], port: int, token: str) -> AsyncIterator[Client]:
    """The SDK's client on `coderunner proxy`, which speaks HTTP to a front door inside the namespace."""
    argv = [*cluster.exec_prefix, sys.executable, "-m", "coderunner.cli", "proxy",
            f"http://127.0.0.1:{port}/mcp", "--token", token]  # fmt: skip
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=str(REPO))
    async with Client(params, read_timeout_seconds=180) as client:
        yield client


def token_cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "coderunner.cli", "token", *args], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def initialize_status(cluster: RayCluster, port: int, token: str) -> int:
    """The HTTP status a front door in the namespace gives an initialize request with `token`."""
    done = cluster.run_python(
        """
import json, sys, urllib.error, urllib.request
body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18",
        "capabilities": {}, "clientInfo": {"name": "probe", "version": "0"}}}
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/mcp", json.dumps(body).encode(), method="POST",
    headers={"Authorization": "Bearer " + sys.argv[2], "Content-Type": "application/json",
             "Accept": "application/json, text/event-stream"})
try:
    print(urllib.request.urlopen(request, timeout=30).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
""",
        str(port), token, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1])


async def refusal(client: Client, tool: str, **arguments: Any) -> str:
    """What a refused call says: the proxy relays the front door's 401 as an error (an exception or an
    error result, as the client spells it); a call that went through fails the test."""
    try:
        result = await call(client, tool, **arguments)
    except Exception as exc:  # the SDK's error for a JSON-RPC error answer
        return str(exc)
    assert result.is_error, f"a revoked token's call went through: {text_of(result)}"
    return text_of(result)


async def test_a_revoked_token_is_refused_by_every_front_door(ray_cluster: RayCluster, dirs: ServerDirs) -> None:
    env = cluster_env(ray_cluster, dirs)
    env.pop("CODERUNNER_TOKEN")  # the token file and its per-client tokens, shared by both front doors
    token = token_cli(env, "add", "agent").splitlines()[-1]
    ports = (18761, 18762)
    with contextlib.ExitStack() as stack:
        for port in ports:
            stack.enter_context(http_front_door(ray_cluster, env, port, dirs.root / f"door-{port}.log"))
        assert await eventually(lambda: all(_listening(ray_cluster, port) for port in ports), 90), [
            (dirs.root / f"door-{port}.log").read_text()[-2000:] for port in ports
        ]
        async with through_proxy(ray_cluster, env, ports[0], token) as first:
            session_id = json_of(await ok(first, "create_session"))["session_id"]  # type: ignore[index]
            await ok(first, "run_python", code="owned = 1", session_id=session_id)
            async with through_proxy(ray_cluster, env, ports[1], token) as second:
                assert "1" in text_of(await ok(second, "run_python", code="owned", session_id=session_id))
                assert [initialize_status(ray_cluster, port, token) for port in ports] == [200, 200]
                token_cli(env, "revoke", "agent")
                assert [initialize_status(ray_cluster, port, token) for port in ports] == [401, 401]
                for door in (first, second):
                    assert "owned" not in await refusal(door, "run_python", code="owned", session_id=session_id)
        # A new token for the same client reaches the same session through either front door.
        renewed = token_cli(env, "add", "agent").splitlines()[-1]
        async with through_proxy(ray_cluster, env, ports[1], renewed) as again:
            assert "1" in text_of(await ok(again, "run_python", code="owned", session_id=session_id))
            await ok(again, "manage_sessions", action="close", session_id=session_id)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)


async def test_a_front_door_killed_mid_call_leaves_its_session_running_and_whole_for_another(
    ray_cluster: RayCluster, dirs: ServerDirs
) -> None:
    """A front door is only a way in: SIGKILLed while a cell of its session runs, the cell still ends on its
    node, the session keeps its state and the cell's effect, another front door goes on with it, a bystander
    session is unharmed, and closing both leaves nothing on any node."""
    env = cluster_env(ray_cluster, dirs)
    env.pop("CODERUNNER_TOKEN")
    token = token_cli(env, "add", "killed-door").splitlines()[-1]
    ports = (18763, 18764)
    logs = [dirs.root / f"door-{port}.log" for port in ports]
    with contextlib.ExitStack() as stack:
        doomed = stack.enter_context(http_front_door(ray_cluster, env, ports[0], logs[0]))
        stack.enter_context(http_front_door(ray_cluster, env, ports[1], logs[1]))
        assert await eventually(lambda: all(_listening(ray_cluster, port) for port in ports), 90), [
            log.read_text()[-2000:] for log in logs
        ]
        async with through_proxy(ray_cluster, env, ports[1], token) as survivor:
            bystander = json_of(await ok(survivor, "create_session"))["session_id"]  # type: ignore[index]
            await ok(survivor, "run_python", code="mine = 'bystander'", session_id=bystander)
            async with through_proxy(ray_cluster, env, ports[0], token) as first, anyio.create_task_group() as tasks:
                session_id = json_of(await ok(first, "create_session"))["session_id"]  # type: ignore[index]
                await ok(first, "run_python", code="kept = 'before'", session_id=session_id)
                slow = "import time\ntime.sleep(8)\nkept = 'after the front door died'"

                async def slow_cell() -> None:
                    await call(first, "run_python", code=slow, session_id=session_id)

                tasks.start_soon(slow_cell)

                async def running() -> bool:
                    status = json_of(await ok(survivor, "manage_sessions", action="status", session_id=session_id))
                    return bool(status and status["kernel"] == "busy")

                with anyio.fail_after(60):
                    while not await running():
                        await anyio.sleep(0.2)
                doomed.kill()  # SIGKILL: no goodbye to its node agent
                doomed.wait(timeout=30)
                tasks.cancel_scope.cancel()  # its client's call has nobody to answer it
            seen: list[str] = []
            with anyio.fail_after(120):
                while not seen or "after the front door died" not in seen[-1]:
                    answer = await call(survivor, "run_python", code="kept", session_id=session_id)
                    seen.append(text_of(answer))
                    assert not answer.is_error or "busy" in seen[-1], seen  # busy while the cell ends, then its effect
                    await anyio.sleep(0.5)
            assert "bystander" in text_of(await ok(survivor, "run_python", code="mine", session_id=bystander))
            for held in (session_id, bystander):
                await ok(survivor, "manage_sessions", action="close", session_id=held)
    assert await eventually(lambda: not named_actors(ray_cluster)), named_actors(ray_cluster)
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


async def test_a_lost_node_says_so_while_other_nodes_serve(ray_cluster: RayCluster, dirs: ServerDirs) -> None:
    async with front_door(ray_cluster, cluster_env(ray_cluster, dirs)) as client:
        by_node: dict[str, str] = {}
        for _ in range(2):
            made = json_of(await ok(client, "create_session", cpus=WIDE_CPUS))
            assert made is not None
            by_node[node_name(ray_cluster, made["node"])] = made["session_id"]
        assert sorted(by_node) == ["w1", "w2"]
        for session_id in by_node.values():
            await ok(client, "run_python", code="kept = 'yes'", session_id=session_id)
        ray_cluster.kill_raylet("w2")
        # Its actor may answer a moment longer (calls go worker to worker, not through the raylet);
        # then every call says the session was lost with its node. Each call is bounded: never a hang.
        began, answers = time.monotonic(), []
        while time.monotonic() - began < 120:
            asked = time.monotonic()
            answer = await call(client, "run_python", code="kept", session_id=by_node["w2"])
            answers.append((round(time.monotonic() - asked, 1), answer.is_error, text_of(answer)[:200]))
            if answer.is_error:
                break
            await anyio.sleep(1.0)
        assert answers[-1][1] and "lost with node" in answers[-1][2], answers
        assert max(took for took, _, _ in answers) < 60, answers
        assert "yes" in text_of(await ok(client, "run_python", code="kept", session_id=by_node["w1"]))
        await ok(client, "manage_sessions", action="close", session_id=by_node["w1"])
    assert await eventually(lambda: not sandboxes_on(ray_cluster), 60), described(sandboxes_on(ray_cluster))


def _listening(cluster: RayCluster, port: int) -> bool:
    done = cluster.run_python(
        "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2)", str(port),
        timeout=30,
    )  # fmt: skip
    return done.returncode == 0
