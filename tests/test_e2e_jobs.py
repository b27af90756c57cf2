"""Jobs through the official MCP client, in real sandboxes (the server in memory).

The server detaches after 2 s (CODERUNNER_DETACH_AFTER_S): a longer cell answers with its output
so far and a job id, runs on, and manage_jobs (wait, cancel, list) takes it from there. No timing
assertions: "answered before the end" is shown by what the reply holds (part of the output, a
running job), never by a clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.types import CallToolResult

from .conftest import (
    ServerDirs,
    images_of,
    json_of,
    memory_client,
    run,
    sandbox_processes_alive,
    server_env,
    text_of,
    wait_until,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: Prints `tick i` every `period` seconds, `n` times, then defines `finished`.
TICKING = (
    "import time\nfor i in range({n}):\n    print(f'tick {{i}}', flush=True)\n    time.sleep({period})\nfinished = {n}"
)
#: A cell that runs until stopped, after saying it started.
FOREVER = "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.1)"
#: The same, deaf to SIGINT (the interrupt a cancel sends).
DEAF = (
    "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('started', flush=True)\ntime.sleep(600)"
)


def env(dirs: ServerDirs) -> dict[str, str]:
    return server_env(dirs, CODERUNNER_DETACH_AFTER_S="2")


@pytest.fixture
async def client(dirs: ServerDirs) -> AsyncIterator[Client]:
    async with memory_client(env(dirs)) as connected:
        yield connected


def meta(result: CallToolResult, key: str) -> dict[str, Any]:
    found = (result.meta or {}).get(f"coderunner/{key}")
    assert isinstance(found, dict), (key, result.meta, text_of(result))
    return found


def job_of(result: CallToolResult) -> str:
    job = meta(result, "job")
    assert job["status"] == "running", text_of(result)
    assert f"still running as job {job['job_id']}" in text_of(result)
    return str(job["job_id"])


def ticks(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("tick ")]


async def wait_job(client: Client, job_id: str, timeout_s: float = 30, **options: Any) -> CallToolResult:
    return await client.call_tool(
        "manage_jobs", {"action": "wait", "job_id": job_id, "timeout_s": timeout_s}, **options
    )


async def wait_to_end(client: Client, job_id: str, step_s: float = 30, **options: Any) -> tuple[str, CallToolResult]:
    """wait_job until the job ends: every read's text joined, and the last reply."""
    texts = []
    for _ in range(40):
        reply = await wait_job(client, job_id, step_s, **options)
        texts.append(text_of(reply))
        if meta(reply, "job")["status"] != "running":
            return "\n".join(texts), reply
    raise AssertionError(f"job {job_id} still running")


async def started(client: Client, code: str) -> str:
    """Start `code` in the background; its job id once it printed 'started'."""
    job_id = job_of(await run(client, code, detach_after_s=0))
    seen = ""
    for _ in range(30):
        reply = await wait_job(client, job_id, 2)
        seen += text_of(reply)
        if "started" in seen:
            return job_id
    raise AssertionError(f"job {job_id} never started: {seen}")


async def test_a_long_cell_detaches_with_partial_output_and_wait_job_returns_the_rest_once(client: Client) -> None:
    first = await run(client, TICKING.format(n=15, period=0.4))  # 6 s: well past the 2 s detach
    assert not first.is_error, text_of(first)
    job_id = job_of(first)
    early = ticks(text_of(first))
    assert early and "tick 14" not in early  # part of the output: it answered before the end
    assert meta(first, "kernel")["state_preserved"] is True
    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    rest, last = await wait_to_end(client, job_id, progress_callback=on_progress)
    assert any("tick" in message for message in progress)  # progress carries the latest output
    assert early + ticks(rest) == [f"tick {i}" for i in range(15)]  # every line once, in order
    assert meta(last, "job")["status"] == "done" and not last.is_error
    assert meta(last, "kernel")["state_preserved"] is True and "state kept]" in text_of(last)
    after = await run(client, "finished")
    assert "15" in text_of(after).splitlines() and meta(after, "kernel")["state_preserved"] is True
    listed = json_of(await client.call_tool("manage_jobs", {"action": "list"}))
    assert listed is not None and [job["status"] for job in listed["jobs"]] == ["done"]


async def test_a_second_run_during_a_job_is_told_busy_while_file_tools_and_status_work(client: Client) -> None:
    job_id = await started(client, FOREVER)
    busy = await run(client, "1 + 1")
    assert busy.is_error
    assert f"busy with job {job_id} (running" in text_of(busy) and "manage_jobs (wait or cancel)" in text_of(busy)
    listed = await client.call_tool("read_file", {"path": "/workspace"})
    assert not listed.is_error, text_of(listed)
    status = json_of(await client.call_tool("manage_sessions", {"action": "status"}))
    assert status is not None and status["job"]["job_id"] == job_id and status["job"]["status"] == "running"
    cancelled = await client.call_tool("manage_jobs", {"action": "cancel", "job_id": job_id})
    assert meta(cancelled, "job")["status"] == "interrupted"


async def test_cancel_job_interrupts_and_keeps_state(client: Client) -> None:
    await run(client, "kept = 7")
    job_id = await started(client, FOREVER)
    cancelled = await client.call_tool("manage_jobs", {"action": "cancel", "job_id": job_id})
    assert "interrupted; the kernel and its state are kept" in text_of(cancelled)
    assert meta(cancelled, "job")["status"] == "interrupted"
    assert meta(cancelled, "kernel")["state_preserved"] is True
    after = await run(client, "kept")
    assert "7" in text_of(after).splitlines() and meta(after, "kernel")["state_preserved"] is True


async def test_cancel_job_restarts_a_kernel_that_ignores_the_interrupt_and_says_state_was_lost(client: Client) -> None:
    await run(client, "kept = 7")
    before = meta(await run(client, "1"), "kernel")["generation"]
    job_id = await started(client, DEAF)
    cancelled = await client.call_tool("manage_jobs", {"action": "cancel", "job_id": job_id})
    assert "kernel restarted; state lost" in text_of(cancelled)
    kernel = meta(cancelled, "kernel")
    assert kernel == {"generation": before + 1, "state_preserved": False}
    assert "state lost" in text_of(cancelled).splitlines()[-1]
    after = await run(client, "'kept' in dir()")
    assert "False" in text_of(after) and meta(after, "kernel")["state_preserved"] is True


async def test_a_job_that_kills_its_kernel_reports_lost(client: Client) -> None:
    job_id = job_of(await run(client, "import os, time\ntime.sleep(3)\nos._exit(9)"))
    _, last = await wait_to_end(client, job_id)
    assert meta(last, "job")["status"] == "lost" and last.is_error
    assert "kernel died" in text_of(last) and meta(last, "kernel")["state_preserved"] is False
    assert "2" in text_of(await run(client, "1 + 1")).splitlines()


async def test_a_chart_drawn_in_a_job_arrives_through_wait_job(client: Client) -> None:
    code = (
        "import time\nimport matplotlib.pyplot as plt\ntime.sleep(3)\n"
        "fig, ax = plt.subplots()\nax.plot([1, 4, 9])\nplt.show()\nprint('drawn')"
    )
    job_id = job_of(await run(client, code))
    _, last = await wait_to_end(client, job_id)
    assert meta(last, "job")["status"] == "done", text_of(last)
    pngs = images_of(last)
    assert len(pngs) == 1 and pngs[0].startswith(b"\x89PNG")


async def test_kernel_reset_says_its_new_generation_and_that_state_was_lost(client: Client) -> None:
    before = meta(await run(client, "x = 1"), "kernel")
    reset = await client.call_tool("kernel_reset", {})
    assert json_of(reset) is not None
    assert json_of(reset)["state_preserved"] is False
    assert meta(reset, "kernel") == {"generation": before["generation"] + 1, "state_preserved": False}
    assert meta(await run(client, "1"), "kernel")["state_preserved"] is True


async def test_execute_code_detaches_and_its_job_holds_the_whole_result(client: Client) -> None:
    code = "import sys, time\nprint('out', flush=True)\nprint('err', file=sys.stderr)\ntime.sleep(4)\nsys.exit(3)"
    first = await client.call_tool("execute_code", {"language": "python", "code": code})
    assert json_of(first) is not None and json_of(first)["status"] == "running"
    job_id = json_of(first)["job_id"]
    for _ in range(10):
        last = await wait_job(client, job_id)
        if json_of(last) is not None and json_of(last)["status"] != "running":
            break
    result = json_of(last)
    assert result is not None and result["status"] == "error" and last.is_error
    assert result["stdout"] == "out\n" and "err" in result["stderr"]
    assert result["exit_code"] == 3 and result["timed_out"] is False


async def test_closing_the_session_ends_its_job_and_tells_the_waiter(dirs: ServerDirs) -> None:
    async with memory_client(env(dirs)) as client:
        created = json_of(await client.call_tool("create_session", {}))
        assert created is not None
        session_id = created["session_id"]
        first = await run(client, FOREVER, session_id=session_id, detach_after_s=0)
        job_id = job_of(first)
        replies: list[CallToolResult] = []

        async def waiter() -> None:
            replies.append(await wait_job(client, job_id, 120))

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(1)
            closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
            assert not closed.is_error, text_of(closed)
        assert meta(replies[0], "job")["status"] == "lost"
        assert "the session was closed" in text_of(replies[0])
        gone = await wait_job(client, job_id, 1)
        assert gone.is_error and f"unknown job_id {job_id!r}" in text_of(gone)
        assert await wait_until(lambda: len(sandbox_processes_alive(dirs)) <= 1, 20)  # only the default's, if any


async def test_a_client_with_a_shorter_timeout_than_the_job_still_gets_the_whole_result(dirs: ServerDirs) -> None:
    # A client whose own read timeout is 5 s (openai-agents' default).
    async with memory_client(env(dirs), read_timeout_seconds=5) as client:
        # The kernel is up first (its start, on a loaded machine, may take longer than this client waits,
        # and longer than the 2 s after which a call goes on as a job: then that job ends first).
        warm = await client.call_tool("run_python", {"code": "1"}, read_timeout_seconds=120)
        if (warm.meta or {}).get("coderunner/job", {}).get("status") == "running":
            await wait_to_end(client, job_of(warm), step_s=2)
        first = await run(client, TICKING.format(n=12, period=0.6))  # 7.2 s: past the client's 5 s
        job_id = job_of(first)
        rest, last = await wait_to_end(client, job_id, step_s=2)
        assert ticks(text_of(first)) + ticks(rest) == [f"tick {i}" for i in range(12)]
        assert meta(last, "job")["status"] == "done"


async def test_a_server_that_stops_ends_every_job(dirs: ServerDirs) -> None:
    async with memory_client(env(dirs)) as client:
        await started(client, FOREVER)
        oneshot = await client.call_tool("execute_code", {"language": "bash", "code": "sleep 600", "detach_after_s": 0})
        assert json_of(oneshot) is not None and json_of(oneshot)["status"] == "running"
        assert await wait_until(lambda: len(sandbox_processes_alive(dirs)) >= 2, 30)
    assert await wait_until(lambda: sandbox_processes_alive(dirs) == [], 20), sandbox_processes_alive(dirs)


async def test_cancel_job_kills_a_one_shot_run(client: Client, dirs: ServerDirs) -> None:
    first = await client.call_tool("execute_code", {"language": "bash", "code": "sleep 600", "detach_after_s": 0})
    assert json_of(first) is not None
    job_id = json_of(first)["job_id"]
    assert await wait_until(lambda: len(sandbox_processes_alive(dirs)) >= 1, 30)
    cancelled = await client.call_tool("manage_jobs", {"action": "cancel", "job_id": job_id})
    assert cancelled.is_error and json_of(cancelled) is not None
    assert json_of(cancelled)["status"] == "interrupted"
    assert "its sandbox was killed" in json_of(cancelled)["note"]
    assert await wait_until(lambda: sandbox_processes_alive(dirs) == [], 20), sandbox_processes_alive(dirs)
    listed = json_of(await client.call_tool("manage_jobs", {"action": "list"}))
    assert listed is not None and [(job["job_id"], job["kind"]) for job in listed["jobs"]] == [(job_id, "execute_code")]
