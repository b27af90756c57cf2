"""CPU policy: each session in its own cpu cgroup, all of them below a parent weighted under the server.

A session whose code keeps spinning after its call returned must take only otherwise idle CPU
from the server, bystander sessions and the host's own programs (figures: bench/cpu_spin.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coderunner.sandbox.cgroups import CGROUP_ROOT, CgroupManager, CgroupsUnavailable

from .conftest import ServerDirs, run, sandbox_processes_alive, server_env, stdio_client, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

SPIN = """
import subprocess, sys
spinners = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(2)]
'spinning'
"""


def _cpu_cgroup(pid: int) -> str | None:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (controllers == "" and CgroupManager.detect().version == 2):
            return path
    return None


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
        assert group.split("/")[-2] == "coderunner", group
        if manager.version == 1:
            parent = CGROUP_ROOT / "cpu" / group.lstrip("/")
            assert (parent.parent / "cpu.shares").read_text().strip() == str(37 * 1024 // 100)
            assert (parent / "cpu.shares").read_text().strip() == "1024"  # sessions are equal among themselves
        else:
            parent = CGROUP_ROOT / group.lstrip("/")
            weight = parent.parent / "cpu.weight"
            if weight.exists():
                assert weight.read_text().strip() == "37"
        # The server and a bystander session are still served while it spins.
        created = await client.call_tool("create_session", {})
        assert not created.is_error, text_of(created)
        bystander = created.structured_content or json.loads(text_of(created))
        assert text_of(await run(client, "6 * 7", session_id=bystander["session_id"])).splitlines()[0] == "42"
        assert text_of(await run(client, "[p.kill() for p in spinners]; 'stopped'")).splitlines()[0] == "'stopped'"
