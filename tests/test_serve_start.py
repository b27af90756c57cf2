"""What `coderunner serve` tells a person: why it could not start, and how to connect a client when started by hand.

A client that launches a server which dies at once shows its user only "Failed to connect"; the one
line the server wrote on stderr (in the client's MCP log, or in a terminal running the same command)
is the whole explanation, so it must be one clear line, without a traceback. And someone who types
`coderunner serve` in a terminal sees it sit there silently: over stdio it now says what it waits
for and how to connect a client. Each case is a real `serve` process, bounded in time.
"""

from __future__ import annotations

import contextlib
import os
import pty
import selectors
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from coderunner.config import ConfigError
from coderunner.serve import StartError, _start_failures, terminal_hint

from .conftest import REPO, SERVER_CMD, ServerDirs, _free_port, server_env

#: Bound on a server's start (imports, settings, the session host with no warm pool) and on its stop.
START_S = 60
#: The server's close is bounded by SHUTDOWN_TIMEOUT_S (10 s) plus the thread work no cancel reaches. In
#: this session's two clean-clone CI runs a Ctrl-C'd server in a terminal exited 0 but only after more
#: than 20 s, under the suite's own load (not reproduced alone or beside 6 burners): its cause is open
#: and named in the stop's note; the bound is the user's patience, not a figure the test may hide.
STOP_S = 45
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


def test_a_tool_name_that_is_no_tool_is_one_line_naming_the_groups(dirs: ServerDirs) -> None:
    """Checked where the server is built (the settings load before any tool exists), said the same."""
    said = one_line_failure(serve_once(server_env(dirs, CODERUNNER_TOOLS="python,pdf_opz")))
    assert "tools: unknown tool group 'pdf_opz': use all, python" in said, said


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


@contextlib.contextmanager
def in_a_terminal(env: dict[str, str], *flags: str) -> Iterator[subprocess.Popen[bytes]]:
    """`serve` with a pty as its stdin (a person typed it), stdout and stderr pipes; SIGTERM'd on exit."""
    terminal, worker = pty.openpty()
    process = subprocess.Popen(
        [*SERVER_CMD, *flags], env=env, cwd=str(REPO), stdin=worker, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    os.close(worker)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        os.close(terminal)


def read_until(process: subprocess.Popen[bytes], wanted: bytes, timeout_s: float) -> bytes:
    """What the process wrote on stderr until `wanted` appeared (or it exited, or the time ran out)."""
    assert process.stderr is not None
    said = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        while wanted not in said and (left := deadline - time.monotonic()) > 0:
            if selector.select(timeout=min(left, 1.0)):
                chunk = os.read(process.stderr.fileno(), 65536)
                if not chunk:
                    break
                said += chunk
    return said


def test_serve_typed_in_a_terminal_says_what_it_waits_for_and_how_to_connect(dirs: ServerDirs) -> None:
    with in_a_terminal(server_env(dirs)) as process:
        said = read_until(process, b"--transport http", START_S).decode(errors="replace")
        assert process.poll() is None, said  # still serving: the hint is no failure
        process.send_signal(signal.SIGINT)  # Ctrl-C, as the hint says, stops it
        assert process.wait(timeout=STOP_S) in (0, 130)  # 130: interrupted before its handler was up
    assert HINT in said, said
    assert "claude mcp add coderunner -- " in said and " serve" in said
    assert "config CLIENT" in said and "cline" in said and "serve --transport http" in said
    assert ("coderunner: " + HINT) in said  # a plain message, not a log record
    assert process.stdout is not None and process.stdout.read() == b""  # all of it on stderr


def test_a_client_launching_serve_gets_no_hint(dirs: ServerDirs) -> None:
    """stdin a pipe (what every client gives): nothing on stderr but the log."""
    handshake = (
        '{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18",'
        '"capabilities":{},"clientInfo":{"name":"t","version":"0"}}}\n'
    )
    done = subprocess.run(
        SERVER_CMD, env=server_env(dirs), cwd=str(REPO), input=handshake, capture_output=True, text=True, timeout=60
    )
    assert '"id":0' in done.stdout and "serverInfo" in done.stdout, done.stderr[-3000:]
    assert HINT not in done.stderr


def test_http_in_a_terminal_gets_no_stdio_hint(dirs: ServerDirs) -> None:
    port = _free_port()
    with in_a_terminal(server_env(dirs), "--transport", "http", "--port", str(port)) as process:
        said = read_until(process, b"serving MCP over streamable-http", START_S).decode(errors="replace")
        assert "serving MCP over streamable-http" in said, said
        assert f"http://127.0.0.1:{port}/mcp" in said
    assert process.stderr is not None
    said += process.stderr.read().decode(errors="replace")  # and all it wrote until it stopped
    assert HINT not in said


def test_the_hint_names_this_install() -> None:
    hint = terminal_hint()
    assert hint.startswith("coderunner: " + HINT)
    assert "coderunner config CLIENT" in hint or "coderunner.cli config CLIENT" in hint
