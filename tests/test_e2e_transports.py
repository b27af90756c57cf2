"""Transports and the command line beyond the shared stdio/HTTP scenarios."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import (
    REPO,
    ServerDirs,
    connect_http,
    http_server,
    images_of,
    run,
    sandbox_processes_alive,
    server_env,
    text_of,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


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
    assert list(dirs.workspaces.iterdir()) == []


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


def test_cli_reports_a_missing_sandbox_environment(dirs: ServerDirs) -> None:
    done = cli(dirs, "--config", str(dirs.root / "none.toml"), "run", "1", "--sandbox-env", str(dirs.root / "nope"))
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
