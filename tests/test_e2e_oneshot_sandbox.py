"""What cheap one-shot runs rely on, through a real server: a tmpfs workspace with its cap held, the
seccomp filter (compiled once per server) applied to every run, and bash started without a launcher.

This module's server starts each run's sandbox on the run's path (oneshot_ready off): the cold path a
run takes when no sandbox was started ahead for it. test_e2e_oneshot_ready.py runs the same checks
on sandboxes started ahead (the default)."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from mcp import Client

from coderunner.hostfs.sandbox_mounts import START_CLONES_PREFIX

from .conftest import ServerDirs, json_of, memory_client, server_env, text_of, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]
root_only = pytest.mark.skipif(os.getuid() != 0, reason="a capped workspace needs root (a mount)")

#: The workspace cap the test server is given, in MiB.
DISK_MB = 32


@pytest.fixture
async def client(dirs: ServerDirs) -> AsyncIterator[Client]:
    env = server_env(dirs, CODERUNNER_DISK_MB=str(DISK_MB), CODERUNNER_ONESHOT_READY="0")
    async with memory_client(env) as connected:
        yield connected


async def execute(client: Client, language: str, code: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool("execute_code", {"language": language, "code": code, **arguments})
    payload = json_of(result)
    assert payload is not None, text_of(result)
    return payload


def host_mounts_under(path: os.PathLike[str]) -> list[str]:
    """Mount points under `path`, but a live server's own start clones dir (start_namespace.py; a start's
    clones below it are counted)."""
    with open("/proc/self/mountinfo") as handle:
        points = [line.split()[4] for line in handle]
    return [point for point in points if point.startswith(str(path)) and not is_start_clones_dir(point)]


def is_start_clones_dir(point: str) -> bool:
    return os.path.basename(point).startswith(START_CLONES_PREFIX)


def run_mounts_under(dirs: ServerDirs) -> list[str]:
    """Mounts under the server's dirs but the workspace made ahead for a session's create."""
    ahead = {str(dirs.workspaces / key) for key in dirs.made_ahead()}
    return [point for point in host_mounts_under(dirs.root) if point not in ahead]


#: Prints the workspace's mount line as the sandbox sees it, then tries to write past the cap.
FILL = (
    "grep ' /workspace ' /proc/self/mountinfo\n"
    "head -c 48M /dev/zero > /workspace/big; echo rc=$?\n"
    "echo size=$(stat -c %s /workspace/big)\n"
    "echo small > /workspace/after; cat /workspace/after\n"
)


@root_only
async def test_a_one_shot_workspace_is_a_capped_tmpfs_and_leaves_no_mount(client: Client, dirs: ServerDirs) -> None:
    done = await execute(client, "bash", FILL)
    out = done["stdout"]
    mount_line = out.splitlines()[0]
    assert " - tmpfs " in mount_line and "nosuid" in mount_line and "nodev" in mount_line, out
    assert f"size={DISK_MB * 1024}k" in mount_line, out
    assert "No space left on device" in done["stderr"], done
    assert "rc=1" in out
    size = int(re.search(r"size=(\d+)", out.split("rc=")[1]).group(1))  # type: ignore[union-attr]
    assert size <= DISK_MB * 2**20
    # The cap is on this run's tmpfs: once the file is gone there is room again (nothing outlived the run).
    again = await execute(client, "bash", "echo fresh > /workspace/f && ls /workspace")
    assert again["stdout"] == "f\n" and again["success"], again
    # A run's dirs go just after its reply.
    # (The workspace a session's create would take, made ahead, stays: it is no run's.)
    assert await wait_until(lambda: run_mounts_under(dirs) == [], timeout_s=10)
    assert await wait_until(lambda: dirs.session_workspaces() == [], timeout_s=10)


@root_only
async def test_the_tmpfs_workspace_is_never_larger_than_the_memory_limit(dirs: ServerDirs) -> None:
    """RAM-backed: a run's workspace can hold no more than the memory it may use."""
    async with memory_client(server_env(dirs, CODERUNNER_DISK_MB="4096", CODERUNNER_ONESHOT_READY="0")) as client:
        done = await execute(client, "bash", "grep ' /workspace ' /proc/self/mountinfo", memory_mb=600)
    assert "size=614400k" in done["stdout"], done


async def test_every_one_shot_runs_under_the_seccomp_filter(client: Client) -> None:
    """unshare(0) changes nothing and succeeds anywhere but under the filter (which refuses unshare
    outright): EPERM in each run proves the filter compiled once is handed to every sandbox."""
    probe = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); print(libc.unshare(0), ctypes.get_errno())"
    for language, code in (
        ("python", probe),
        ("bash", f'python -c "{probe}"'),
        ("python", probe),
        ("bash", f'python -c "{probe}"'),
    ):
        done = await execute(client, language, code)
        assert done["stdout"].split() == ["-1", "1"], done  # EPERM


async def test_bash_runs_directly_and_its_variables_leave_no_trace(client: Client) -> None:
    code = (
        'echo "[${PYTHONPATH-unset}] [${BASH_ENV-unset}] [$greeting] [$n]"\n'
        "echo $(cat /proc/$PPID/comm) $(cat /proc/$$/comm)\n"
        "bash -c 'echo \"child [${greeting}] [${BASH_ENV-unset}]\"'\n"
        'echo tampered > "$0" 2>/dev/null && echo WROTE || echo read-only\n'
    )
    done = await execute(client, "bash", code, variables='{"greeting": "it\'s $(id) `id`", "n": 7}')
    lines = done["stdout"].splitlines()
    assert lines[0] == "[unset] [unset] [it's $(id) `id`] [7]", done
    assert lines[1] == "sandbox-init bash", done  # no launcher between the sandbox's pid 1 and the script
    assert lines[2] == "child [it's $(id) `id`] [unset]"
    assert lines[3] == "read-only"
    plain = await execute(client, "bash", 'echo "[${PYTHONPATH-unset}] [${BASH_ENV-unset}]"')
    assert plain["stdout"] == "[unset] [unset]\n"


async def test_a_bash_script_sees_no_trace_of_how_its_sandbox_was_started(client: Client) -> None:
    """No arguments, jobs, open fds or names beyond its own, also when it runs in a sandbox started
    ahead (test_e2e_oneshot_ready.py collects this), where bash waited beside a launcher it killed."""
    await execute(client, "bash", "true")  # with oneshot_ready, the next run takes a sandbox started ahead
    code = (
        'echo "$# [$*] $0"\n'
        "jobs\n"
        "ls -C -w 200 /proc/$$/fd\n"  # no pipeline: bash would hold its pipe until tr is forked
        "compgen -v | grep -E '^(_cr_|COPROC)' || echo no names\n"
        'read -r line; echo "[$line]"\n'
    )
    done = await execute(client, "bash", code, stdin="bash\nmore")
    lines = done["stdout"].splitlines()
    assert re.fullmatch(r"0 \[\] /\S+/main\.sh", lines[0]), done
    assert [line.split() for line in lines[1:]] == [["0", "1", "2"], ["no", "names"], ["[bash]"]], done
    assert done["stderr"] == "" and done["exit_code"] == 0, done


@root_only
async def test_a_run_cut_short_by_the_server_stopping_leaves_no_mount(dirs: ServerDirs) -> None:
    """Cancelled mid-run (its client went, the server stops): its workspace and outbox still go."""
    async with memory_client(server_env(dirs)) as client, anyio.create_task_group() as tg:
        tg.start_soon(client.call_tool, "execute_code", {"language": "bash", "code": "sleep 30", "timeout_s": 60})
        assert await wait_until(lambda: bool(run_mounts_under(dirs)), timeout_s=10)
        tg.cancel_scope.cancel()
    assert await wait_until(lambda: not host_mounts_under(dirs.root), timeout_s=10), host_mounts_under(dirs.root)
