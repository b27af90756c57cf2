"""Each transport once, through a real `coderunner serve` process, and the command line.

The behaviour tests reach the server in memory (tests/conftest.py `client`); here each transport
carries one conversation with what crosses it: state, an error, a chart, progress notifications,
cancellation and, over HTTP, the export folder of an unnamed client (`http`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import anyio
import pytest
from mcp import Client

from .conftest import (
    REPO,
    ServerDirs,
    connect_http,
    http_server,
    images_of,
    run,
    sandbox_processes_alive,
    server_env,
    stdio_client,
    text_of,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


async def converse(client: Client) -> None:
    """One conversation whose every part crosses the transport."""
    await run(client, "base = 20")
    assert text_of(await run(client, "base + 22")).splitlines()[0] == "42"
    failed = await run(client, "1 / 0")
    assert failed.is_error and "ZeroDivisionError" in text_of(failed)
    chart = await run(client, "import matplotlib.pyplot as plt\nplt.bar([1, 2], [3, 4])\nplt.show()")
    assert images_of(chart)[0].startswith(b"\x89PNG")
    seen: list[str | None] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(message)

    ticking = "import time\nfor i in range(6):\n    print(f'step {i}', flush=True)\n    time.sleep(0.3)"
    done = await client.call_tool("run_python", {"code": ticking}, progress_callback=on_progress)
    assert not done.is_error and any(message and "step" in message for message in seen), seen
    with anyio.move_on_after(1.5):
        await run(client, "while True:\n    pass", timeout_s=120)
    # Had the cancellation not crossed, this call would wait behind the cell (busy) instead of answering.
    with anyio.fail_after(30):
        after = await run(client, "base", timeout_s=20)
    assert not after.is_error and "20" in text_of(after).splitlines(), text_of(after)


async def test_stdio_transport_carries_a_conversation(dirs: ServerDirs) -> None:
    async with stdio_client(server_env(dirs)) as client:
        await converse(client)


async def test_streamable_http_transport_carries_a_conversation_and_exports_to_http(dirs: ServerDirs) -> None:
    exports = dirs.root / "out"
    exports.mkdir(mode=0o755)
    with http_server(server_env(dirs, CODERUNNER_EXPORT_DIR=str(exports))) as url:
        async with connect_http(url) as client:
            await converse(client)
            await client.call_tool("write_file", {"path": "result.txt", "content": "done"})
            copied = await client.call_tool("transfer_file", {"direction": "download", "sandbox_path": "result.txt"})
            assert not copied.is_error, text_of(copied)
    # An unnamed HTTP client of the server's token is the client `http` (edge/callers.py).
    assert sorted(path.name for path in exports.iterdir()) == ["http"]
    assert (exports / "http" / "result.txt").read_text() == "done"


async def test_legacy_sse_transport_runs_python_and_returns_charts(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs), transport="sse") as url:
        async with connect_http(url) as client:
            await run(client, "base = 20")
            assert text_of(await run(client, "base + 22")).splitlines()[0] == "42"
            chart = await run(client, "import matplotlib.pyplot as plt\nplt.bar([1, 2], [3, 4])\nplt.show()")
            assert images_of(chart)[0].startswith(b"\x89PNG")


async def test_sigterm_to_http_server_closes_every_sandbox(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        async with connect_http(url) as client:
            await client.call_tool("create_session", {})
            await run(client, "1")
            assert len(sandbox_processes_alive(dirs)) >= 2
    # http_server's exit sent SIGTERM and asserted the process stopped within its bound.
    assert sandbox_processes_alive(dirs) == []
    assert list(dirs.workspace_entries()) == []


def cli(dirs: ServerDirs, *args: str, stdin: str | None = None, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coderunner.cli", *args],
        env=server_env(dirs, **settings),
        cwd=str(REPO),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_run_prints_the_result_and_exit_code(dirs: ServerDirs) -> None:
    done = cli(dirs, "run", "import os\nprint(os.getcwd())\n6 * 7")
    assert done.returncode == 0, done.stderr
    assert "/workspace" in done.stdout and "42" in done.stdout.splitlines()
    failed = cli(dirs, "run", "-", stdin="raise ValueError('bad input')")
    assert failed.returncode == 1 and "ValueError: bad input" in failed.stdout


def test_cli_doctor_passes_here(dirs: ServerDirs) -> None:
    done = cli(dirs, "doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ok  ] sandboxed 1+1" in done.stdout and "FAIL" not in done.stdout
    # No network turned on: the ceiling is none, and no mode above it is checked or suggested.
    assert "[ok  ] network ceiling: none" in done.stdout and "max_network" in done.stdout, done.stdout
    assert "'allowlist' mode" not in done.stdout and "'internet' mode" not in done.stdout, done.stdout
    # With allowed_domains the ceiling is allowlist: it is enforceable here, and still not internet.
    allowing = cli(dirs, "doctor", CODERUNNER_ALLOWED_DOMAINS="python-packages")
    assert allowing.returncode == 0, allowing.stdout + allowing.stderr
    assert "[ok  ] network 'allowlist' mode: enforced on bwrap" in allowing.stdout, allowing.stdout
    assert "python-packages" in allowing.stdout and "'internet' mode" not in allowing.stdout
    # Backends not in use: one line, never a warning; --all checks each, with its fix.
    others = [line for line in done.stdout.splitlines() if "other backend" in line]
    assert len(others) == 1 and others[0].startswith("[ok  ] other backends: ") and "doctor --all" in others[0], others
    every = cli(dirs, "doctor", "--all")
    assert every.returncode == 0 and "other backend podman:" in every.stdout and "other backend apple:" in every.stdout


def test_cli_reports_a_missing_sandbox_environment(dirs: ServerDirs) -> None:
    done = cli(dirs, "--config", os.devnull, "run", "1", "--sandbox-env", str(dirs.root / "nope"))
    assert done.returncode == 1
    assert "run `coderunner setup`" in done.stderr and "Traceback" not in done.stderr
    doctor = subprocess.run(
        [sys.executable, "-m", "coderunner.cli", "doctor"],
        env={**server_env(dirs), "CODERUNNER_SANDBOX_ENV": str(dirs.root / "nope")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert doctor.returncode == 1 and "fix: coderunner setup" in doctor.stdout


def test_a_busy_port_is_one_line_and_starts_no_sandbox(dirs: ServerDirs) -> None:
    """Once "serving ... at" and a page of traceback, with a warm sandbox started first (issue 28)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = cli(dirs, "serve", "--transport", "streamable-http", "--port", str(port), CODERUNNER_POOL_SIZE="1")
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"coderunner: cannot listen on 127.0.0.1:{port}: the port is in use (another server?); "
        "choose another with --port\n"
    )
    assert not sandbox_processes_alive(dirs) and not dirs.runtime.exists()
