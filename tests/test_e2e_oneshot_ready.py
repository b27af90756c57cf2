"""execute_code with `oneshot_ready` on (the default): a sandbox started ahead for each run, used once.

The scenarios of test_e2e_execute_code.py that exercise a run's sandbox are collected again here,
under this module's `client` (oneshot_ready set explicitly), so the same assertions hold for a
sandbox that was started before its program was known. The tests below add what is particular
to it: the default takes one, nothing of one run reaches the next, it holds only room left under
max_sessions and the memory budget (a session takes it back), and it goes away with the server.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup
from mcp import Client

from coderunner.config import Settings
from coderunner.hostfs.blank_images import BLANK
from coderunner.oneshot.local import LocalOneShots
from coderunner.oneshot.program import LAUNCHER
from coderunner.sandbox import SandboxSpec, make_backend
from coderunner.sessions.manager import SessionManager
from coderunner.vocabulary.sandbox_request import SandboxRequest

from .conftest import ServerDirs, json_of, memory_client, sandbox_processes_alive, server_env, text_of, wait_until
from .test_e2e_execute_code import (
    test_a_fork_bomb_is_contained_and_the_server_serves,  # noqa: F401
    test_each_language_reads_stdin_sees_variables_and_reports_its_exit_code,  # noqa: F401
    test_memory_limits_hold_per_language,  # noqa: F401
    test_memory_peak_is_measured,  # noqa: F401
    test_network_flag,  # noqa: F401
    test_output_is_bounded,  # noqa: F401
    test_the_host_environment_never_reaches_a_one_shot_run,  # noqa: F401
    test_variables_of_every_json_type_arrive_as_data,  # noqa: F401
)
from .test_e2e_oneshot_sandbox import (
    host_mounts_under,
    test_a_bash_script_sees_no_trace_of_how_its_sandbox_was_started,  # noqa: F401
    test_bash_runs_directly_and_its_variables_leave_no_trace,  # noqa: F401
    test_every_one_shot_runs_under_the_seccomp_filter,  # noqa: F401
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


@pytest.fixture
async def client(dirs: ServerDirs) -> AsyncIterator[Client]:
    # As test_e2e_execute_code's client: the user allows network 'internet' (test_network_flag).
    env = server_env(dirs, CODERUNNER_ONESHOT_READY="1", CODERUNNER_MAX_NETWORK="internet")
    async with memory_client(env) as connected:
        yield connected


async def execute(client: Client, language: str, code: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool("execute_code", {"language": language, "code": code, **arguments})
    payload = json_of(result)
    assert payload is not None, text_of(result)
    return payload


#: Leaves a mark everywhere a run may write, and a process behind; prints what an earlier run left.
TRACES = (
    "ls -A /workspace /tmp /dev/shm | tr '\\n' ' '; echo\n"
    "pgrep -f 'sleep 301' >/dev/null && echo LINGERING || echo none\n"
    "touch /workspace/mark /tmp/mark /dev/shm/mark\n"
    "nohup sleep 301 >/dev/null 2>&1 &\n"
    "cat; echo\n"
)


async def test_nothing_of_one_run_reaches_the_next(client: Client) -> None:
    """Every run gets a sandbox of its own, even one started while the previous run went on."""
    for index in range(4):
        done = await execute(client, "bash", TRACES, stdin=f"run {index}")
        lines = done["stdout"].splitlines()
        assert "mark" not in lines[0], done
        assert lines[1] == "none" and lines[2] == f"run {index}", done
    # A different language, and different options (a sandbox started ahead must match them).
    marks = "import os; print([d for d in ('/workspace', '/tmp', '/dev/shm') if 'mark' in os.listdir(d)])"
    python = await execute(client, "python", marks, memory_mb=700)
    assert python["stdout"] == "[]\n" and python["limits"]["memory_mb"] == 700, python
    again = await execute(client, "python", marks)
    assert again["stdout"] == "[]\n", again


async def test_a_timeout_counts_from_the_program_and_leaves_only_the_next_sandbox(
    client: Client, dirs: ServerDirs
) -> None:
    await execute(client, "bash", "echo warm")  # now a sandbox waits for the next run
    done = await execute(client, "python", "while True:\n    pass", timeout_s=1.5)
    assert done["timed_out"] is True and done["exit_code"] is None
    assert "timed out after 1.5s" in done["stderr"]
    # The run's sandbox is gone; the one started ahead for the next run is the only one left.
    assert await wait_until(lambda: len(sandbox_processes_alive(dirs)) <= 2, timeout_s=10)
    quick = await execute(client, "python", "print('next')")
    assert quick["stdout"] == "next\n" and quick["success"]


async def test_the_sandbox_started_ahead_goes_away_with_the_server(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_ONESHOT_READY="1")) as client:
        done = await execute(client, "python", "print(6 * 7)")
        assert done["stdout"] == "42\n"
        assert await wait_until(lambda: bool(sandbox_processes_alive(dirs)), timeout_s=10)
    assert await wait_until(lambda: not sandbox_processes_alive(dirs), timeout_s=10)
    assert not [entry for entry in dirs.runtime.iterdir() if entry.is_dir() and not entry.name.startswith("guest")]
    assert list(dirs.workspace_entries()) == []


async def test_a_program_reads_all_of_its_stdin_after_the_header(client: Client) -> None:
    """The sandbox learns its language from the first line; the program must still get every byte."""
    payload = "python\nbash\n" + "x" * 200_000 + "\nlast"
    digest = hashlib.sha256(payload.encode()).hexdigest()
    reader = "import sys, hashlib; data = sys.stdin.buffer.read(); print(len(data), hashlib.sha256(data).hexdigest())"
    for language, code in (("python", reader), ("bash", f'python -c "{reader}"')):
        done = await execute(client, language, code, stdin=payload)
        assert done["stdout"].split() == [str(len(payload)), digest], (language, done)


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cro-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_a_run_takes_the_sandbox_started_ahead_and_each_is_used_once(root: Path) -> None:
    """In process, with the real backend: which sandboxes were started, and for what."""
    settings = Settings(runtime_dir=root / "r", workspaces_dir=root / "w", token_file=root / "token",
                        export_dir=None, oneshot_ready=True, pool_size=0)  # fmt: skip
    backend = make_backend(settings)
    started: list[str] = []
    spawn = backend.spawn

    async def recording(spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool = False) -> Any:
        # [..., python, -P, -c, launcher, mode, ...]: the launcher's mode ("run" or "wait"), else the program.
        started.append(argv[argv.index(LAUNCHER) + 1] if LAUNCHER in argv else argv[0])
        return await spawn(spec, argv, task_group, pipes=pipes)

    backend.spawn = recording  # type: ignore[method-assign]
    async with SessionManager(settings, backend) as manager:
        options, oneshot = manager.options(), LocalOneShots.for_manager(manager).runner
        results = [
            await oneshot.run("python", "print(1)", options),
            await oneshot.run("bash", "echo 2", options),
            await oneshot.run("javascript", "console.log(3)", options, stdin=b"in"),
            await oneshot.run("python", "print(4)", manager.options(SandboxRequest(timeout_s=5))),
        ]
        assert [result.stdout for result in results] == ["1\n", "2\n", "3\n", "4\n"]
        assert all(result.success for result in results)
        # Only the first run started its own sandbox; each later one took the one started ahead
        # (a different timeout is still the same sandbox), and each was used once.
        assert [kind for kind in started if kind != "wait"] == ["run"], started
        assert started[:4] == ["run", "wait", "wait", "wait"], started
        # Other limits need another sandbox: this run starts its own and the one waiting is dropped.
        other = await oneshot.run("python", "print(5)", manager.options(SandboxRequest(memory_mb=700)))
        assert other.stdout == "5\n" and started.count("run") == 2, started
    assert [entry.name for entry in settings.runtime_dir.iterdir() if not entry.name.startswith("guest")] == []
    assert [entry for entry in settings.workspaces_dir.iterdir() if not BLANK.fullmatch(entry.name)] == []


async def test_a_run_refused_before_its_program_starts_leaves_no_sandbox(client: Client, dirs: ServerDirs) -> None:
    """A sandbox started ahead is killed too when the run fails before handing it the program."""
    await execute(client, "bash", "echo warm")
    result = await client.call_tool(
        "execute_code", {"language": "bash", "code": "echo $v", "variables": json.dumps({"v": "a\u0000b"})}
    )
    assert result.is_error and "NUL character" in text_of(result), text_of(result)
    # Only the sandbox started ahead for the next run is left (bwrap and its pid 1).
    assert await wait_until(lambda: len(sandbox_processes_alive(dirs)) <= 2, timeout_s=10)
    assert await wait_until(lambda: len(dirs.session_runtime_dirs()) <= 1, timeout_s=10)
    done = await execute(client, "bash", "echo fine")
    assert done["stdout"] == "fine\n"


async def ahead(client: Client) -> dict[str, int]:
    """What the server reports of its sandboxes started ahead (get_capabilities)."""
    result = await client.call_tool("get_capabilities", {})
    counts = json.loads(text_of(result))["sandbox"]["oneshot_ready"]
    assert counts is not None, "oneshot_ready is off"
    return dict(counts)


async def wait_for_ahead(client: Client, **wanted: int) -> dict[str, int]:
    """The counts once they show `wanted` (bounded: a start may be slow on a loaded machine)."""
    found: dict[str, int] = {}
    for _ in range(200):
        found = await ahead(client)
        if all(found[name] == value for name, value in wanted.items()):
            return found
        await anyio.sleep(0.1)
    raise AssertionError(f"never {wanted}: {found}")


async def test_by_default_a_run_takes_a_sandbox_started_ahead(dirs: ServerDirs) -> None:
    """No setting: the first run starts its own sandbox, the next takes the one started after it."""
    async with memory_client(server_env(dirs)) as client:
        assert await ahead(client) == {"ready": 0, "starting": 0, "runs_taken": 0, "runs_cold": 0, "dropped": 0}
        first = await execute(client, "python", "print(1)")
        assert first["stdout"] == "1\n"
        await wait_for_ahead(client, ready=1, runs_cold=1)
        second = await execute(client, "bash", "echo 2")
        assert second["stdout"] == "2\n"
        counts = await ahead(client)
        assert counts["runs_taken"] == 1 and counts["runs_cold"] == 1, counts


async def test_a_sandbox_started_ahead_gives_its_room_to_a_session_and_nothing_is_left(dirs: ServerDirs) -> None:
    """max_sessions 1: the sandbox started ahead holds the only room until a session wants it; the
    create takes it back (never fails), runs start their own meanwhile, and the room comes back."""
    async with memory_client(server_env(dirs, CODERUNNER_MAX_SESSIONS="1")) as client:
        await execute(client, "bash", "echo warm")
        await wait_for_ahead(client, ready=1)
        created = await client.call_tool("create_session", {})
        assert not created.is_error, text_of(created)
        session_id = json.loads(text_of(created))["session_id"]
        counts = await ahead(client)
        assert counts["ready"] == 0 and counts["starting"] == 0 and counts["dropped"] == 1, counts
        # The session holds the room: a run starts its own sandbox, and none is started after it.
        done = await execute(client, "bash", "echo cold")
        assert done["stdout"] == "cold\n"
        counts = await ahead(client)
        assert counts["runs_cold"] == 2 and counts["ready"] == 0 and counts["starting"] == 0, counts
        ran = await client.call_tool("run_python", {"code": "print(6 * 7)", "session_id": session_id})
        assert "42" in text_of(ran), text_of(ran)
        closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
        assert not closed.is_error, text_of(closed)
        await execute(client, "bash", "echo again")
        await wait_for_ahead(client, ready=1)
    assert await wait_until(lambda: not sandbox_processes_alive(dirs), timeout_s=10)
    assert await wait_until(lambda: not host_mounts_under(dirs.root), timeout_s=10), host_mounts_under(dirs.root)
    assert not [entry for entry in dirs.runtime.iterdir() if entry.is_dir() and not entry.name.startswith("guest")]
    assert list(dirs.workspace_entries()) == []


async def test_no_sandbox_is_started_ahead_beyond_the_memory_budget(root: Path) -> None:
    """pool_memory_mb is the idle sandboxes' budget, the one-shot ones' too: with none, none starts."""
    settings = Settings(runtime_dir=root / "r", workspaces_dir=root / "w", token_file=root / "token",
                        export_dir=None, pool_size=0, pool_memory_mb=0)  # fmt: skip
    async with SessionManager(settings, make_backend(settings)) as manager:
        oneshot = LocalOneShots.for_manager(manager).runner
        assert oneshot.ready  # the default
        for _ in range(2):
            done = await oneshot.run("bash", "echo hi", manager.options())
            assert done.stdout == "hi\n"
            assert oneshot.ahead.held == 0
        assert oneshot.ahead.stats().runs_cold == 2
