"""The abuse suite's boundary cases against the podman backend: the same arena, attacks and checks.

Two cases are held differently by a container, and are checked for what podman does instead:
- /sys/fs/cgroup is an empty read-only tmpfs (listing it gives [] rather than an error);
- past the memory limit the container's memory cgroup kills the kernel, but on cgroup v1 the engine
  cannot say it was an OOM kill (conmon reports OOMKilled=false), so the reply says "kernel died".
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator

import pytest

from ..conftest import ServerDirs, run, server_env, stdio_client, text_of
from ..test_e2e_podman import OCI_RUNTIME, podman_image  # noqa: F401  (the session's image fixture)
from .conftest import BYSTANDER_VALUE, Arena
from .test_abuse import CASES, Case, assert_still_serving, attack, verdict

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

HELD_DIFFERENTLY = {"filesystem: host devices and /sys", "memory: raising RLIMIT_AS, then allocating past the limit"}
SAME = [case for case in CASES if f"{case.boundary}: {case.name}" not in HELD_DIFFERENTLY]


def _case(name: str) -> Case:
    return next(case for case in CASES if f"{case.boundary}: {case.name}" == name)


@pytest.fixture(scope="module")
async def arena(
    podman_image: str,  # noqa: F811
    abuse_dirs: ServerDirs,
    host_listeners: tuple[int, str],
) -> AsyncIterator[Arena]:
    """The abuse conftest's arena, on podman."""
    env = server_env(
        abuse_dirs,
        CODERUNNER_DISK_MB="64",
        CODERUNNER_MEMORY_MB="1024",
        CODERUNNER_TIMEOUT_S="30",
        CODERUNNER_MAX_SESSIONS="4",
        CODERUNNER_BACKEND="podman",
        CODERUNNER_OCI_RUNTIME=OCI_RUNTIME,
    )
    async with stdio_client(env) as client:
        created = await client.call_tool("create_session", {})
        bystander = json.loads(text_of(created))["session_id"]
        await run(client, f"guarded = {BYSTANDER_VALUE!r}\nopen('bystander.txt', 'w').write('mine')",
                  session_id=bystander)  # fmt: skip
        [workspace] = [path for path in abuse_dirs.workspaces.iterdir() if path.is_dir()]
        yield Arena(client, abuse_dirs, bystander, workspace, *host_listeners)


@pytest.mark.parametrize("case", SAME, ids=[f"{case.boundary}: {case.name}" for case in SAME])
async def test_boundary_holds_on_podman(arena: Arena, case: Case) -> None:
    result = await attack(arena, case)
    case.check(result, arena)
    await assert_still_serving(arena)


async def test_host_devices_and_an_empty_cgroup_tree(arena: Arena) -> None:
    outcome = verdict(await attack(arena, _case("filesystem: host devices and /sys")))
    assert outcome["devs"][0] != "OK" and outcome["kmem"][0] != "OK", outcome
    assert outcome["sys"][0] != "OK" or outcome["sys"][1] == "[]", outcome
    await assert_still_serving(arena)


async def test_memory_past_the_limit_is_bounded_by_the_container(arena: Arena) -> None:
    result = await attack(arena, _case("memory: raising RLIMIT_AS, then allocating past the limit"))
    text = text_of(result)
    assert result.is_error and ("MemoryError" in text or "kernel died" in text), text
    await assert_still_serving(arena)


async def test_container_processes_are_not_root_on_the_host(arena: Arena) -> None:
    """boundary: host identity. The kernel's processes, as the host sees them, are never root."""
    await run(arena.client, "import time\ntime.sleep(0.1)")
    tag = __import__("coderunner.sandbox.container", fromlist=["server_tag"]).server_tag(arena.dirs.runtime)
    names = subprocess.run(
        ["podman", "ps", "--filter", f"label=coderunner.server={tag}", "--format", "{{.Names}}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    assert names
    for name in names:
        users = subprocess.run(
            ["podman", "top", name, "huser", "user"], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()[2:]  # after the two column headers
        assert users and "root" not in users and "0" not in users, (name, users)
    if os.getuid() == 0:
        assert "coderunner-sandbox" in users or "999" in users, users
    await assert_still_serving(arena)
