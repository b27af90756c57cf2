"""The stdio wire of a real `coderunner serve`, driven by hand: what it refuses it answers, and a
request written just before stdin closes is answered before the server exits (issue 38, point 6)."""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from coderunner.edge.stdio_wire import MAX_LINE_BYTES

from .conftest import REPO, SERVER_CMD, ServerDirs, server_env

pytestmark = pytest.mark.e2e

#: Bound on each reply the tests wait for, and on the server's exit after stdin closes.
REPLY_TIMEOUT_S = 60
HANDSHAKE = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}


class Wire:
    """A server's stdin and stdout, one JSON line at a time, every read bounded."""

    def __init__(self, server: subprocess.Popen[bytes]) -> None:
        assert server.stdin is not None and server.stdout is not None
        self.server = server
        self.stdin = server.stdin
        self.stdout = server.stdout
        self._pending = b""

    def send(self, line: bytes | dict[str, Any]) -> None:
        data = line if isinstance(line, bytes) else json.dumps(line).encode()
        self.stdin.write(data + b"\n")
        self.stdin.flush()

    def reply(self) -> dict[str, Any] | None:
        """The next line the server writes, parsed; None when it closed stdout."""
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        fd = self.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            assert left > 0, f"no reply within {REPLY_TIMEOUT_S}s"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = self.stdout.raw.read(1 << 16)  # type: ignore[attr-defined]
            if not chunk:
                assert not self._pending, f"a cut line: {self._pending[:200]!r}"
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)


@contextlib.contextmanager
def wire(dirs: ServerDirs) -> Iterator[Wire]:
    server = subprocess.Popen(SERVER_CMD, env=server_env(dirs), cwd=str(REPO), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        talk = Wire(server)
        talk.send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": HANDSHAKE})
        assert (talk.reply() or {}).get("id") == 0
        talk.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        yield talk
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(timeout=10)


def parse_error(reply: dict[str, Any] | None) -> bool:
    return reply is not None and reply.get("id", "absent") is None and reply["error"]["code"] == -32700


def test_a_line_that_is_not_json_or_is_over_the_limit_gets_a_parse_error_and_the_wire_goes_on(
    dirs: ServerDirs,
) -> None:
    with wire(dirs) as talk:
        talk.send(b"this is not json")
        assert parse_error(talk.reply())
        talk.send(b"x" * (MAX_LINE_BYTES + 1))
        said = talk.reply()
        assert parse_error(said) and "MiB" in said["error"]["message"]  # type: ignore[index]
        talk.send(b'{"jsonrpc": "2.0", "unknown": true}')
        invalid = talk.reply()
        assert invalid is not None and invalid["id"] is None and invalid["error"]["code"] == -32600
        talk.send({"jsonrpc": "2.0", "id": 5, "method": "tools/list"})
        listed = talk.reply()
        assert listed is not None and listed["id"] == 5 and "tools" in listed["result"]


def test_a_request_written_just_before_stdin_closes_is_answered_before_the_server_exits(dirs: ServerDirs) -> None:
    with wire(dirs) as talk:
        code = "import time\ntime.sleep(1)\n6 * 7"
        talk.send({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                   "params": {"name": "run_python", "arguments": {"code": code}}})  # fmt: skip
        talk.stdin.close()
        answer = talk.reply()
        assert answer is not None and answer["id"] == 9, answer
        assert "result" in answer and not answer["result"]["isError"], answer
        assert "42" in answer["result"]["content"][0]["text"]
        assert talk.reply() is None
        assert talk.server.wait(timeout=REPLY_TIMEOUT_S) == 0
