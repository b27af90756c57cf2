"""Session dirs shared by several servers, with real processes: servers in processes of their own
sweeping one runtime dir, and a loop-mounted workspace image held by another mount namespace.

The rest of the shared dirs' rules (a dir made whole and locked, the sweep removing only what it can
prove dead) run in one process, in the fast suite: tests/unit/test_session_dirs.py, whose helpers
these use.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest

from coderunner.hostfs.workspaces import Workspace
from tests.unit import test_session_dirs as one_process
from tests.unit.test_session_dirs import open_dirs, sweep, whole

#: The concurrency test: servers at once, and sessions each opens (a sweep after every one).
SERVERS = 6
ROUNDS = 25
JOIN_TIMEOUT_S = 300

#: The runtime and workspaces dirs of one server (tests/unit/test_session_dirs.py's fixture).
base = one_process.base


def _server(runtime: Path, workspaces: Path, start: Event, out: Queue[list[str]]) -> None:
    """One server: open a sandbox's dirs, sweep as a starting server does, check its own, close."""
    failures: list[str] = []
    start.wait(60)
    for _ in range(ROUNDS):
        try:
            dirs = open_dirs(runtime, workspaces)
        except Exception as exc:  # a failed start is what this test counts
            failures.append(f"start failed: {exc}")
            continue
        sweep(runtime, workspaces)
        if not whole(dirs):
            failures.append(f"{dirs.key} was removed while live")
        dirs.close()
    out.put(failures)


def test_servers_sharing_a_runtime_dir_never_remove_each_others_live_dirs(
    base: tuple[Path, Path], canary: Path
) -> None:
    runtime, workspaces = base
    os.symlink(canary, runtime / "0000cccc")
    bystander = open_dirs(runtime, workspaces)
    context = multiprocessing.get_context("spawn")
    start, out = context.Event(), context.Queue()
    servers = [context.Process(target=_server, args=(runtime, workspaces, start, out)) for _ in range(SERVERS)]
    for server in servers:
        server.start()
    start.set()
    try:
        results = [out.get(timeout=JOIN_TIMEOUT_S) for _ in servers]
    finally:
        for server in servers:
            server.join(timeout=JOIN_TIMEOUT_S)
            if server.is_alive():
                server.kill()
    failures = [failure for result in results for failure in result]
    assert failures == []
    assert whole(bystander) and (canary / "keep").read_text() == "untouched"
    bystander.close()
    assert os.listdir(runtime) == ["0000cccc"] and os.listdir(workspaces) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="loop-mounted images need root")
def test_a_persistent_image_is_final_when_its_workspace_is_removed(tmp_path: Path) -> None:
    """umount only takes the host's mount away: a sandbox's mount namespace still being torn down holds
    the file system, which writes the image when it lets go. remove() waits for that (bounded), so the
    image is final, and its lock free, only once no mount namespace holds it."""
    from coderunner.hostfs import workspaces as module

    path = tmp_path / "named" / "project"
    path.parent.mkdir(parents=True)
    workspace = Workspace.create(path, 64, True, persistent=True)
    assert workspace.image is not None
    (path / "canary.txt").write_text("kept")
    # A mount namespace holding a copy of the mount for a moment, as a sandbox's being torn down does.
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "2"])
    try:
        time.sleep(0.3)  # its namespace exists
        workspace.remove()
        assert module._loop_released(workspace.image, 0.0), "removed while another namespace held the image"
        assert holder.poll() is not None, "remove returned before the holder let go"
        assert workspace.lock_fd is None
    finally:
        holder.kill()
        holder.wait()
    reopened = Workspace.create(path, 64, True, persistent=True)
    try:
        assert (path / "canary.txt").read_text() == "kept"
    finally:
        reopened.remove()
