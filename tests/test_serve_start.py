"""What `coderunner serve` tells a person when it could not start.

A client that launches a server which dies at once shows its user only "Failed to connect"; the one
line the server wrote on stderr (in the client's MCP log, or in a terminal running the same command)
is the whole explanation, so it must be one clear line, without a traceback. Each case is a real
`serve` process, bounded in time.
"""

from __future__ import annotations

import socket
import subprocess

import pytest

from coderunner.config import ConfigError
from coderunner.serve import StartError, _start_failures

from .conftest import REPO, SERVER_CMD, ServerDirs, server_env

#: Bound on a server's start (imports, settings, the session host with no warm pool) and on its stop.
START_S = 60
STOP_S = 20
HINT = "waiting for an MCP client"


def serve_once(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    """`serve` as a client launches it (stdin and stdout pipes), expected to stop by itself."""
    return subprocess.run(
        [*SERVER_CMD, *flags], env=env, cwd=str(REPO), input="", capture_output=True, text=True, timeout=START_S
    )


def one_line_failure(done: subprocess.CompletedProcess[str], code: int = 1) -> str:
    assert done.returncode == code, (done.returncode, done.stderr[-3000:])
    assert done.stdout == ""  # nothing on the MCP channel
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith("coderunner: ")
    return done.stderr


def test_a_folder_it_cannot_make_is_one_line_naming_it(dirs: ServerDirs) -> None:
    """A runtime dir that cannot be made ended in a page of traceback."""
    said = one_line_failure(serve_once(server_env(dirs, CODERUNNER_RUNTIME_DIR="/proc/coderunner-no-such-dir")))
    assert "/proc/coderunner-no-such-dir" in said and "cannot start" in said


def test_a_bad_setting_is_one_line_naming_it(dirs: ServerDirs) -> None:
    said = one_line_failure(serve_once(server_env(dirs, CODERUNNER_MEMORY_MB="lots")), code=2)
    assert "memory_mb" in said


def test_a_missing_sandbox_environment_is_one_line_with_its_fix(dirs: ServerDirs) -> None:
    said = one_line_failure(serve_once(server_env(dirs, CODERUNNER_SANDBOX_ENV=str(dirs.root / "no-env"))))
    assert "coderunner setup" in said


def test_a_port_in_use_is_one_line_naming_the_flag(dirs: ServerDirs) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        said = one_line_failure(serve_once(server_env(dirs), "--transport", "http", "--port", str(port)))
    assert "in use" in said and "--port" in said


def test_a_start_failure_inside_a_task_group_is_still_its_own_line() -> None:
    with pytest.raises(StartError) as caught, _start_failures():
        raise ExceptionGroup("start", [ConfigError("cluster mode needs Ray:\n  pip install 'coderunner[ray]'")])
    assert str(caught.value) == "cluster mode needs Ray: pip install 'coderunner[ray]'"
    denied = r"^the server cannot start: Permission denied: /x \(PermissionError;"
    with pytest.raises(StartError, match=denied), _start_failures():
        raise PermissionError(13, "Permission denied", "/x")
    with pytest.raises(KeyboardInterrupt), _start_failures():  # not a failure: the user stopped it
        raise KeyboardInterrupt
