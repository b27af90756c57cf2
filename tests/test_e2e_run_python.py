"""run_python through the official MCP client, over stdio and Streamable HTTP, in a real sandbox."""

from __future__ import annotations

import anyio
import pytest
from mcp import Client

from .conftest import ServerDirs, images_of, memory_client, run, run_to_end, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


async def test_state_persists_across_calls(client: Client) -> None:
    first = await run(client, "import math\nradius = 3")
    assert not first.is_error, text_of(first)
    second = await run(client, "print('area', round(math.pi * radius**2, 2))\nradius * 2")
    assert not second.is_error
    assert "area 28.27" in text_of(second)
    assert "6" in text_of(second).splitlines()


async def test_tools_are_listed_with_their_contract(client: Client) -> None:
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert {"run_python", "create_session", "manage_sessions", "manage_jobs"} <= set(tools)
    schema = tools["run_python"].input_schema
    assert schema["required"] == ["code"]
    assert {"code", "session_id", "timeout_s"} <= set(schema["properties"])


async def test_matplotlib_chart_arrives_as_image(client: Client) -> None:
    result = await run(
        client,
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 4, 9])\nplt.show()",
    )
    assert not result.is_error, text_of(result)
    images = images_of(result)
    assert len(images) == 1
    assert images[0].startswith(b"\x89PNG\r\n\x1a\n")
    assert len(images[0]) > 1000


async def test_exception_gives_is_error_with_clean_traceback(client: Client) -> None:
    result = await run(client, "def f():\n    return {}['missing']\nf()")
    assert result.is_error
    text = text_of(result)
    assert "KeyError" in text and "'missing'" in text
    assert "\x1b[" not in text, "ANSI colour codes must be stripped"
    # The session is still usable afterwards.
    assert text_of(await run(client, "40 + 2")).splitlines()[0] == "42"


async def test_stdout_and_stderr_both_reported(client: Client) -> None:
    result = await run(client, "import sys\nprint('to out')\nprint('to err', file=sys.stderr)")
    text = text_of(result)
    assert "to out" in text and "to err" in text


async def test_infinite_loop_is_interrupted_and_state_kept(client: Client) -> None:
    await run(client, "kept = 'still here'")
    result = await run(client, "print('started', flush=True)\nwhile True:\n    pass", timeout_s=2)
    assert result.is_error
    text = text_of(result)
    assert "interrupted" in text and "state are kept" in text
    assert "started" in text, "output produced before the timeout is returned"
    after = await run(client, "kept")
    assert "'still here'" in text_of(after)


#: A cell whose sandbox is starved of CPU by its own processes: six spinners (deaf to SIGINT, gone after
#: 30 s) share the session's small CPU quota with the kernel, so the interrupt waits to be run.
STARVE = """
import multiprocessing, signal, time
def spin():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end = time.time() + 30
    while time.time() < end:
        pass
spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(6)]
for spinner in spinners:
    spinner.start()
kept = 'still here'
"""


async def test_a_cell_starved_of_cpu_is_interrupted_and_keeps_its_state(dirs: ServerDirs) -> None:
    """The interrupt's grace counts time the sandbox could run: a kernel kept waiting for a CPU (here by its
    own spinners under a 0.2 CPU quota; on a loaded machine by everything else) is not restarted for that."""
    async with memory_client(server_env(dirs, CODERUNNER_CPUS="0.2")) as client:
        assert not (await run(client, STARVE)).is_error
        result = await run(client, "while True:\n    pass", timeout_s=2)
        text = text_of(result)
        assert result.is_error and "interrupted" in text and "state are kept" in text, text
        assert "'still here'" in text_of(await run(client, "kept"))


async def test_code_ignoring_sigint_is_restarted_and_reply_says_state_lost(client: Client) -> None:
    await run(client, "doomed = 1")
    result = await run(
        client,
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('sleeping', flush=True)\n"
        "time.sleep(600)",
        timeout_s=2,
    )
    assert result.is_error
    text = text_of(result)
    assert "restarted" in text and "state lost" in text
    assert "sleeping" in text
    after = await run(client, "doomed")
    assert after.is_error and "NameError" in text_of(after)
    assert text_of(await run(client, "2 * 21")).splitlines()[0] == "42"


async def test_kernel_killed_from_inside_gives_clear_error_then_works(client: Client) -> None:
    await run(client, "lost = True")
    result = await run(client, "import os\nos.kill(os.getpid(), 9)")
    assert result.is_error
    text = text_of(result)
    assert "kernel died" in text and "state lost" in text and "fresh kernel is ready" in text
    again = await run(client, "1 + 1")
    assert not again.is_error and text_of(again).splitlines()[0] == "2"
    assert "NameError" in text_of(await run(client, "lost"))


async def test_huge_output_keeps_head_and_tail_and_spills_to_workspace(client: Client) -> None:
    replies = await run_to_end(client, "for i in range(200_000):\n    print(f'line {i}')")
    assert not any(reply.is_error for reply in replies)
    texts = [text_of(reply) for reply in replies]
    assert all(len(text) < 30_000 for text in texts), [len(text) for text in texts]
    text = "\n".join(texts)
    assert "line 199999" in texts[-1]
    if len(replies) == 1:  # one reply keeps the head too; a job's replies each show the newest output
        assert "line 0\n" in text and "characters omitted; full output: /workspace/.coderunner/output-" in text
    path = text.split("full output: ")[1].split(" (read_file offset=")[0]
    assert path.startswith("/workspace/.coderunner/output-"), path
    check = await run(client, f"lines = open({path!r}).read().splitlines()\nlen(lines), lines[0], lines[-1]")
    assert "(200000, 'line 0', 'line 199999')" in text_of(check)


async def test_progress_notifications_carry_output_so_far(client: Client) -> None:
    seen: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, message))

    result = await client.call_tool(
        "run_python",
        {"code": "import time\nfor i in range(8):\n    print(f'step {i}', flush=True)\n    time.sleep(0.25)"},
        progress_callback=on_progress,
    )
    assert not result.is_error
    assert len(seen) >= 2
    assert any(message and "step" in message for _, message in seen)
    assert [p for p, _ in seen] == sorted(p for p, _ in seen)


async def test_client_cancellation_interrupts_the_running_cell(client: Client) -> None:
    await run(client, "survivor = 7")
    with anyio.move_on_after(1.5):
        await run(client, "while True:\n    pass", timeout_s=120)
    # Had the cell kept running, this call would wait behind it (busy) instead of answering.
    with anyio.fail_after(30):
        after = await run(client, "survivor", timeout_s=20)
    assert not after.is_error, text_of(after)
    assert "7" in text_of(after).splitlines()


async def test_kernel_reset_clears_state_but_keeps_files(client: Client) -> None:
    await run(client, "value = 99\nopen('kept.txt', 'w').write('file survives')")
    reset = await client.call_tool("kernel_reset", {})
    assert not reset.is_error, text_of(reset)
    after = await run(client, "value")
    assert after.is_error and "NameError" in text_of(after)
    assert "file survives" in text_of(await run(client, "open('kept.txt').read()"))


async def test_kernel_reset_stops_a_running_cell(client: Client) -> None:
    await run(client, "before = 1")
    replies: list = []

    async def runaway(code: str) -> None:
        replies.append(await run(client, code, timeout_s=120))

    for code in (
        "while True:\n    pass",
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)",
    ):
        replies.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(runaway, code)
            await anyio.sleep(1.0)
            with anyio.fail_after(30):
                reset = await client.call_tool("kernel_reset", {})
        assert not reset.is_error, text_of(reset)
        assert replies[0].is_error and "stopped by a kernel reset: state lost" in text_of(replies[0])
        assert "NameError" in text_of(await run(client, "before"))
        await run(client, "before = 1")
