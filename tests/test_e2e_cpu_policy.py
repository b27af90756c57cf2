"""CPU policy: each session in its own cpu cgroup, all of them below a parent weighted under the server.

A session whose code keeps spinning after its call returned must take only otherwise idle CPU
from the server, bystander sessions and the host's own programs (figures: bench/cpu_spin.py).
The parent is the server's own (coderunner-server-<pid>-<start>): other servers on the machine,
with weights of their own, never change it.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.sandbox.base import TWIN_SUFFIX
from coderunner.sandbox.cgroups import CGROUP_ROOT, CgroupManager, CgroupsUnavailable

from .conftest import ServerDirs, json_of, run, sandbox_processes_alive, server_env, stdio_client, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

SPIN = """
import subprocess, sys
spinners = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(2)]
'spinning'
"""


def _cpu_cgroup(pid: int) -> str | None:
    """The session's cpu cgroup of a sandbox process: its standby kernel's (the session's other sandbox name,
    SandboxSpec.twin) counts as the session's, which it becomes at a reset."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (controllers == "" and CgroupManager.detect().version == 2):
            return path.removesuffix(TWIN_SUFFIX)
    return None


def _server_weight(manager: CgroupManager, group: str) -> str | None:
    """The CPU weight of the server's own parent group of the session `group` (None: v2 without cpu)."""
    if manager.version == 1:
        return (CGROUP_ROOT / "cpu" / group.lstrip("/")).parent.joinpath("cpu.shares").read_text().strip()
    weight = (CGROUP_ROOT / group.lstrip("/")).parent / "cpu.weight"
    return weight.read_text().strip() if weight.exists() else None


def _expected(manager: CgroupManager, weight: int) -> str:
    return str(weight * 1024 // 100) if manager.version == 1 else str(weight)


@contextlib.contextmanager
def _other_server_dirs() -> Iterator[ServerDirs]:
    """Runtime and workspace parents of a second server (as the `dirs` fixture makes them)."""
    root = Path(tempfile.mkdtemp(prefix="crt-", dir="/tmp"))
    root.chmod(0o711)
    try:
        yield ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _session_group(manager: CgroupManager, dirs: ServerDirs) -> str:
    groups = {_cpu_cgroup(pid) for pid in sandbox_processes_alive(dirs)} - {None}
    assert len(groups) == 1, groups
    return str(groups.pop())


async def test_spinning_sessions_run_under_a_low_weight_parent(dirs: ServerDirs) -> None:
    try:
        manager = CgroupManager.detect()
    except CgroupsUnavailable as exc:
        pytest.skip(f"this server could not use cgroups here: {exc}")
    env = server_env(dirs, CODERUNNER_SESSION_CPU_WEIGHT="37")
    async with stdio_client(env) as client:
        assert "spinning" in text_of(await run(client, SPIN))
        pids = sandbox_processes_alive(dirs)
        assert pids, "no sandbox process found"
        groups = {_cpu_cgroup(pid) for pid in pids}
        assert len(groups) == 1 and None not in groups, groups
        group = str(groups.pop())
        assert group.split("/")[-2].startswith("coderunner-server-"), group
        assert _server_weight(manager, group) in (_expected(manager, 37), None)
        if manager.version == 1:
            session = CGROUP_ROOT / "cpu" / group.lstrip("/")
            assert (session / "cpu.shares").read_text().strip() == "1024"  # sessions are equal among themselves
        # The server and a bystander session are still served while it spins.
        created = await client.call_tool("create_session", {})
        assert not created.is_error, text_of(created)
        bystander = json_of(created)
        assert text_of(await run(client, "6 * 7", session_id=bystander["session_id"])).splitlines()[0] == "42"
        assert text_of(await run(client, "[p.kill() for p in spinners]; 'stopped'")).splitlines()[0] == "'stopped'"


async def test_a_second_server_with_another_weight_leaves_the_first_servers_weight(dirs: ServerDirs) -> None:
    """Each server weighs its own parent group: one started later with another setting changes nothing of
    the first's (a shared parent took the weight of whichever server wrote last)."""
    try:
        manager = CgroupManager.detect()
    except CgroupsUnavailable as exc:
        pytest.skip(f"this server could not use cgroups here: {exc}")
    async with stdio_client(server_env(dirs, CODERUNNER_SESSION_CPU_WEIGHT="37")) as first:
        assert text_of(await run(first, "1 + 1")).splitlines()[0] == "2"
        first_group = _session_group(manager, dirs)
        if _server_weight(manager, first_group) is None:
            pytest.skip("the cpu controller is not delegated here: no weights to compare")
        assert _server_weight(manager, first_group) == _expected(manager, 37)
        with _other_server_dirs() as other_dirs:
            async with stdio_client(server_env(other_dirs, CODERUNNER_SESSION_CPU_WEIGHT="50")) as second:
                assert text_of(await run(second, "2 + 2")).splitlines()[0] == "4"
                second_group = _session_group(manager, other_dirs)
                assert second_group.split("/")[-2] != first_group.split("/")[-2], (first_group, second_group)
                assert _server_weight(manager, second_group) == _expected(manager, 50)
                assert _server_weight(manager, first_group) == _expected(manager, 37)
                # A fresh session of the first server still finds its own weight.
                created = await first.call_tool("create_session", {})
                assert not created.is_error, text_of(created)
                assert _server_weight(manager, first_group) == _expected(manager, 37)
                assert _server_weight(manager, second_group) == _expected(manager, 50)
