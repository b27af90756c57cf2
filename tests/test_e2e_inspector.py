"""A third-party client: the MCP Inspector CLI (npm) lists the tools and runs Python, over HTTP and stdio."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO, SERVER_CMD, TEST_TOKEN, ServerDirs, http_server, server_env

pytestmark = [pytest.mark.e2e]

INSPECTOR_DIR = Path(__file__).parent / "inspector"
INSPECTOR = INSPECTOR_DIR / "node_modules" / ".bin" / "mcp-inspector"
NPM_TIMEOUT_S = 600
CALL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def inspector() -> Path:
    """The pinned Inspector (tests/inspector/package-lock.json), installed from npm on first use."""
    if not INSPECTOR.exists():
        npm = shutil.which("npm")
        assert npm, "the Inspector test needs Node.js and npm (Debian: apt-get install nodejs npm)"
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=INSPECTOR_DIR,
            check=True,
            timeout=NPM_TIMEOUT_S,
        )
    return INSPECTOR


def inspect(inspector: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(inspector), "--cli", *args],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
    )


def test_inspector_over_streamable_http_with_the_token(inspector: Path, dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        auth = ["--header", f"Authorization: Bearer {TEST_TOKEN}"]
        listed = inspect(inspector, url, *auth, "--method", "tools/list")
        assert listed.returncode == 0, listed.stderr
        names = {tool["name"] for tool in json.loads(listed.stdout)["tools"]}
        assert {"run_python", "manage_sessions", "create_session", "read_file"} <= names

        called = inspect(
            inspector, url, *auth, "--method", "tools/call", "--tool-name", "run_python",
            "--tool-arg", "code=import sys; print(sys.prefix); 6 * 7",
        )  # fmt: skip
        assert called.returncode == 0, called.stderr
        reply = json.loads(called.stdout)
        assert reply["isError"] is False
        text = reply["content"][0]["text"]
        assert "42" in text.splitlines() and "/opt/coderunner/env" in text  # ran inside the sandbox

        refused = inspect(inspector, url, "--method", "tools/list")
        assert refused.returncode != 0 and "run_python" not in refused.stdout


def test_inspector_over_stdio(inspector: Path, dirs: ServerDirs) -> None:
    env_flags = [flag for key, value in server_env(dirs).items() for flag in ("-e", f"{key}={value}")]
    called = inspect(
        inspector, *env_flags, "--method", "tools/call", "--tool-name", "run_python",
        "--tool-arg", "code=sum(range(10))", "--", *SERVER_CMD,
    )  # fmt: skip
    assert called.returncode == 0, called.stderr
    reply = json.loads(called.stdout)
    assert reply["isError"] is False and reply["content"][0]["text"].splitlines()[0] == "45"
