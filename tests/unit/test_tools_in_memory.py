"""The tools as a client sees them: the SDK's own client against build_server(manager), in memory.

What is checked is the MCP surface (argument parsing, reply shapes, isError with plain text),
not containment: the manager runs on the fake backend.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.types import CallToolResult, ImageContent, TextContent

from coderunner.oneshot.local import LocalOneShots
from coderunner.server import build_server
from coderunner.sessions import SessionManager
from coderunner.tools import declared_groups

pytestmark = pytest.mark.anyio

WAIT_S = 20.0
GROUPS = declared_groups()


@pytest.fixture
async def client(manager: SessionManager) -> AsyncIterator[Client]:
    async with Client(build_server(manager, LocalOneShots.for_manager(manager)), raise_exceptions=True) as connected:
        yield connected


def text(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


def payload(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, text(result)
    return json.loads(text(result))


async def test_lists_the_configured_tools(client: Client, manager: SessionManager) -> None:
    listed = {tool.name for tool in (await client.list_tools()).tools}
    assert listed == set(GROUPS.selected(manager.settings.tools))
    assert {"run_python", "manage_sessions", "create_session", "read_file"} <= listed


async def test_run_python_keeps_state_and_answers_in_text(client: Client) -> None:
    await client.call_tool("run_python", {"code": "x = 20"})
    result = await client.call_tool("run_python", {"code": "print('sum:', x + 1)\nx * 2"})
    assert not result.is_error
    assert "sum: 21" in text(result) and "40" in text(result)


async def test_a_raising_cell_is_an_error_result_with_the_traceback(client: Client) -> None:
    result = await client.call_tool("run_python", {"code": "1 / 0"})
    assert result.is_error
    assert "ZeroDivisionError" in text(result) and "\x1b[" not in text(result)


async def test_variables_arrive_as_globals(client: Client) -> None:
    result = await client.call_tool("run_python", {"code": "n * 2, name", "variables": '{"n": 21, "name": "a"}'})
    assert not result.is_error and "(42, 'a')" in text(result)
    refused = await client.call_tool("run_python", {"code": "1", "variables": "[1, 2]"})
    assert refused.is_error and "Traceback" not in text(refused)


async def test_a_chart_comes_back_as_an_image(client: Client) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
    result = await client.call_tool("run_python", {"code": code})
    assert not result.is_error, text(result)
    images = [block for block in result.content if isinstance(block, ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"


async def test_a_timeout_interrupts_and_says_the_state_is_kept(client: Client) -> None:
    await client.call_tool("run_python", {"code": "kept = 5"})
    result = await client.call_tool("run_python", {"code": "import time\ntime.sleep(60)", "timeout_s": 1})
    assert "interrupted; the kernel and its state are kept" in text(result)
    assert "5" in text(await client.call_tool("run_python", {"code": "kept"}))


async def test_kernel_reset_clears_state(client: Client) -> None:
    await client.call_tool("run_python", {"code": "kept = 5"})
    reset = payload(await client.call_tool("kernel_reset", {}))
    assert reset["reset"] is True and reset["state_preserved"] is False and reset["kernel"] == "idle"
    assert "False" in text(await client.call_tool("run_python", {"code": "'kept' in dir()"}))


async def test_sessions_are_created_used_listed_and_closed(client: Client) -> None:
    created = payload(await client.call_tool("create_session", {"timeout_s": 9}))
    session_id = created["session_id"]
    assert created["timeout_s"] == 9 and created["default"] is False
    await client.call_tool("run_python", {"code": "where = 'own'", "session_id": session_id})
    own = await client.call_tool("run_python", {"code": "where", "session_id": session_id})
    assert "own" in text(own)
    default = await client.call_tool("run_python", {"code": "'where' in dir()"})
    assert "False" in text(default)
    listed = payload(await client.call_tool("manage_sessions", {"action": "list"}))["sessions"]
    assert {entry["session_id"] for entry in listed} >= {session_id}
    status = payload(await client.call_tool("manage_sessions", {"action": "status", "session_id": session_id}))
    assert status["kernel"] == "idle" and status["restarts"] == 0
    assert payload(await client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})) == {
        "closed": session_id
    }
    gone = await client.call_tool("run_python", {"code": "1", "session_id": session_id})
    assert gone.is_error and "unknown or expired session_id" in text(gone)


async def test_bad_session_arguments_are_plain_errors(client: Client, manager: SessionManager) -> None:
    result = await client.call_tool("manage_sessions", {"action": "close", "session_id": "no-such-session"})
    assert result.is_error and "unknown or expired session_id 'no-such-session'" in text(result)
    named = await client.call_tool("create_session", {"name": "bad name!"})
    assert named.is_error and "use 1-40 letters" in text(named)
    assert manager.list() == []


async def test_files_written_are_seen_by_the_kernel_and_read_back(client: Client) -> None:
    written = payload(await client.call_tool("write_file", {"path": "/workspace/in.txt", "content": "hi"}))
    assert written["path"] == "/workspace/in.txt" and written["bytes"] == 2
    result = await client.call_tool("run_python", {"code": "open('out.txt', 'w').write(open('in.txt').read() * 2)"})
    assert not result.is_error, text(result)
    paths = {entry["path"] for entry in payload(await client.call_tool("read_file", {"path": "/workspace"}))["entries"]}
    assert {"/workspace/in.txt", "/workspace/out.txt"} <= paths
    assert "hihi" in text(await client.call_tool("read_file", {"path": "/workspace/out.txt"}))
    escape = await client.call_tool("read_file", {"path": "/workspace/../etc/passwd"})
    assert escape.is_error


async def test_a_cancelled_call_interrupts_its_cell(client: Client, manager: SessionManager) -> None:
    await client.call_tool("run_python", {"code": "kept = 5"})
    session = await manager.resolve(None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.call_tool, "run_python", {"code": "import time\ntime.sleep(60)", "timeout_s": 120})
        with anyio.fail_after(WAIT_S):
            while not session.busy:
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
    with anyio.fail_after(WAIT_S):
        while session.busy:
            await anyio.sleep(0.02)
    after = await client.call_tool("run_python", {"code": "kept"})
    assert not after.is_error and "5" in text(after) and session.restarts == 0


async def test_execute_code_runs_once_and_reports(client: Client, manager: SessionManager) -> None:
    code = "import sys\nprint(n + 1)\nprint('warn', file=sys.stderr)\nsys.exit(3)"
    failed = await client.call_tool("execute_code", {"language": "python", "code": code, "variables": '{"n": 41}'})
    assert failed.is_error  # a non-zero exit is the program's failure, told as an error
    result = json.loads(text(failed))
    assert result["stdout"].strip() == "42" and "warn" in result["stderr"]
    assert result["exit_code"] == 3 and result["success"] is False and result["timed_out"] is False
    shell = payload(await client.call_tool("execute_code", {"language": "bash", "code": "echo $((6 * 7))"}))
    assert shell["stdout"].strip() == "42" and shell["success"] is True
    assert manager.list() == []  # no session was made for it


async def test_execute_code_kills_a_run_at_its_deadline(client: Client) -> None:
    timed_out = await client.call_tool("execute_code", {"language": "bash", "code": "sleep 60", "timeout_s": 1})
    result = json.loads(text(timed_out))
    assert timed_out.is_error and result["timed_out"] is True and result["success"] is False


async def test_validate_code_checks_syntax_without_running(client: Client) -> None:
    good = await client.call_tool(
        "execute_code", {"check_only": True, "language": "python", "code": "open('ran', 'w')"}
    )
    bad = await client.call_tool("execute_code", {"check_only": True, "language": "python", "code": "def f(:\n  pass"})
    assert not good.is_error and "SyntaxError" not in text(good)
    assert "invalid syntax" in text(bad) or "SyntaxError" in text(bad)


async def test_jobs_through_the_tools_and_another_clients_job_is_unknown(
    client: Client, manager: SessionManager
) -> None:
    started = await client.call_tool(
        "run_python", {"code": "import time\ntime.sleep(1)\nprint('slept')", "detach_after_s": 0}
    )
    job = (started.meta or {})["coderunner/job"]
    assert job["status"] == "running" and f"still running as job {job['job_id']}" in text(started)
    done = await client.call_tool("manage_jobs", {"action": "wait", "job_id": job["job_id"], "timeout_s": WAIT_S})
    assert "slept" in text(done) and (done.meta or {})["coderunner/job"]["status"] == "done"
    assert (done.meta or {})["coderunner/kernel"]["state_preserved"] is True
    listed = payload(await client.call_tool("manage_jobs", {"action": "list"}))["jobs"]
    assert [entry["job_id"] for entry in listed] == [job["job_id"]]
    theirs = await manager.create(owner="tok/client:eve")
    their_job = await theirs.start_run("import time\ntime.sleep(30)", None)
    for action in ("wait", "cancel"):
        refused = await client.call_tool("manage_jobs", {"action": action, "job_id": their_job.job_id})
        assert refused.is_error and f"unknown job_id {their_job.job_id!r}" in text(refused)
        assert theirs.session_id not in text(refused)
    assert (await theirs.read_job(their_job.job_id, take=False)).running
    assert their_job.job_id not in json.dumps(payload(await client.call_tool("manage_jobs", {"action": "list"})))
    await manager.close(theirs.session_id)


async def test_a_client_has_only_so_many_execute_code_jobs_going(make_manager: Any) -> None:
    async with (
        make_manager(max_oneshot_runs_per_client=1) as manager,
        Client(build_server(manager, LocalOneShots.for_manager(manager)), raise_exceptions=True) as client,
    ):
        arguments = {"language": "bash", "code": "sleep 60", "detach_after_s": 0}
        jobs = [await client.call_tool("execute_code", arguments) for _ in range(4)]
        assert all(payload(job).get("status") == "running" for job in jobs)
        refused = await client.call_tool("execute_code", arguments)
        assert refused.is_error and "already has 4 execute_code runs going" in text(refused)
        for job in jobs:
            await client.call_tool("manage_jobs", {"action": "cancel", "job_id": payload(job)["job_id"]})
        again = await client.call_tool("execute_code", {**arguments, "code": "echo ok", "detach_after_s": 30})
        assert payload(again)["stdout"] == "ok\n"


async def test_a_slow_first_start_sends_progress_so_a_client_s_timeout_can_reset(
    make_scripted: Any, kernels: Any
) -> None:
    """On a loaded machine a caller's first run_python waits seconds for its session: progress says so,
    growing, before any cell runs (issue 38: the TypeScript SDK gave up at 60 s without it)."""
    from tests.fakes.kernel import KernelCue

    kernels.cue(KernelCue.HANG_AT_START)
    notes: list[tuple[float, str | None]] = []

    async def noted(progress: float, total: float | None, message: str | None) -> None:
        notes.append((progress, message))

    async with (
        make_scripted(startup_timeout_s=1.5, progress_interval_s=0.2) as manager,
        Client(build_server(manager, LocalOneShots.for_manager(manager)), raise_exceptions=True) as client,
    ):
        result = await client.call_tool("run_python", {"code": "1"}, progress_callback=noted)
    assert result.is_error, text(result)
    assert len(notes) >= 3 and all("starting the session" in (message or "") for _, message in notes), notes
    assert [progress for progress, _ in notes] == sorted(progress for progress, _ in notes), notes


async def test_a_refusal_while_the_session_is_looked_up_is_the_plain_refusal(client: Client) -> None:
    refused = await client.call_tool("run_python", {"code": "1", "session_id": "no-such-session"})
    assert refused.is_error and "unknown or expired session_id" in text(refused), text(refused)
