"""A SIGKILLed node agent's watcher hands what it kept to a successor, and ends it if none comes (handover.py).

Real processes, no bwrap (tests/cluster has the whole path): a stand-in server uses the real PidWatcher, told to
hand over on its death, and holds two "sandboxes": one kept (a record and a pipe's write end, as a session's gate)
and one not (a pool's or a template's). SIGKILLed, its watcher must end the unkept one at once and keep the other
alive for the grace period only: a process of another uid cannot take it, the first of the server's own uid gets
its record and fds and, once it answered "taken", holds it alone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.sandbox import pid_watcher
from coderunner.sandbox.handover import handover_path, receive, taken

from .test_pid_watcher import REPO, with_token

#: Bound on the watcher ending what it ended (unkept at once; kept ones at the end of the grace).
GONE_WITHIN_S = 10.0

SERVER = """
import os, subprocess, sys, time
from pathlib import Path
from coderunner.sandbox.bwrap_watch import process_watch
token, path, grace = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
watcher = process_watch().watcher
watcher.hand_over_on_exit(path, grace)
def spawn(tag):
    return subprocess.Popen(["/bin/sh", "-c", "sleep 900; true", token + tag], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
outer, init = spawn("-kept-outer"), spawn("-kept-init")
entry = watcher.add(os.pidfd_open(outer.pid), [], [])
watcher.add_init(entry, os.pidfd_open(init.pid))
gate_read, gate_write = os.pipe()
watcher.keep(entry, "record of " + token, [gate_write])
watcher.add(os.pidfd_open(spawn("-unkept").pid), [], [])
print("ready", outer.pid, init.pid, flush=True)
time.sleep(900)
"""


def start_server(token: str, path: Path, grace_s: float) -> tuple[subprocess.Popen[str], int, int]:
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, token, str(path), str(grace_s)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    words = server.stdout.readline().split()
    assert words[:1] == ["ready"], words
    return server, int(words[1]), int(words[2])


def wait_for(check: object, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def kill_all(token: str) -> None:
    for pid in with_token(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def handover_dir(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)  # another uid reaches it, to be refused by the hand-over dir itself
    return tmp_path


@pytest.mark.skipif(os.getuid() != 0, reason="another uid's connect is tried as root only")
def test_a_successor_takes_what_was_kept_and_nothing_else_survives(handover_dir: Path) -> None:
    token = f"handover-{secrets.token_hex(6)}"
    path = handover_path(handover_dir, "agent-test")
    server, outer_pid, init_pid = start_server(token, path, grace_s=30)
    try:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        assert wait_for(lambda: not with_token(token + "-unkept"), GONE_WITHIN_S), "the unkept sandbox lived on"
        assert wait_for(path.exists, GONE_WITHIN_S), "the watcher did not wait for a successor"
        # Another uid: refused by the hand-over dir (0700, the server's), and the kept sandbox waits on.
        stranger = subprocess.run(
            [sys.executable, "-c", "import os, socket, sys; os.setgid(65534); os.setuid(65534); "
             "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(sys.argv[1])", str(path)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert stranger.returncode != 0 and "PermissionError" in stranger.stderr, stranger.stderr
        assert len(with_token(token + "-kept")) == 2
        got = receive(path)
        assert got is not None
        sock, handed = got
        assert [entry.record for entry in handed] == [f"record of {token}"]
        entry = handed[0]
        assert pid_watcher.pid_of(entry.outer) == outer_pid
        assert [pid_watcher.pid_of(fd) for fd in entry.inits] == [init_pid]
        assert len(entry.fds) == 1 and os.fstat(entry.fds[0]).st_mode & 0o170000 == 0o010000  # the gate's pipe
        taken(sock)
        assert wait_for(lambda: not path.exists(), GONE_WITHIN_S), "the old watcher stayed after its sandbox was taken"
        time.sleep(1.0)
        assert len(with_token(token + "-kept")) == 2, "what was taken was ended"
        for fd in (entry.outer, *entry.inits):
            signal.pidfd_send_signal(fd, signal.SIGKILL)  # the successor ends it by the handles it came with
        assert wait_for(lambda: not with_token(token + "-kept"), GONE_WITHIN_S)
        entry.close()
    finally:
        server.kill()
        kill_all(token)


@contextlib.contextmanager
def killed_server(handover_dir: Path, name: str, grace_s: float) -> Iterator[tuple[str, Path]]:
    """A stand-in server SIGKILLed, its unkept sandbox already ended: (its token, its watcher's socket path)."""
    token = f"handover-{secrets.token_hex(6)}"
    path = handover_path(handover_dir, name)
    server, _, _ = start_server(token, path, grace_s)
    try:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        assert wait_for(lambda: not with_token(token + "-unkept"), GONE_WITHIN_S)
        yield token, path
    finally:
        server.kill()
        kill_all(token)


def test_with_no_successor_in_time_the_kept_sandbox_ends(handover_dir: Path) -> None:
    with killed_server(handover_dir, "agent-test-2", grace_s=1.5) as (token, path):
        assert wait_for(lambda: not with_token(token + "-kept"), GONE_WITHIN_S), "the kept sandbox outlived the grace"
        assert wait_for(lambda: not path.exists(), GONE_WITHIN_S)
        assert receive(path) is None  # nobody waits there any more: a successor starts with nothing


def test_a_successor_that_hangs_up_before_taking_leaves_the_sandbox_to_end(handover_dir: Path) -> None:
    with killed_server(handover_dir, "agent-test-3", grace_s=1.5) as (token, path):
        assert wait_for(path.exists, GONE_WITHIN_S)
        got = receive(path)
        assert got is not None
        sock, handed = got
        sock.close()  # no "taken": the successor died half-way
        for entry in handed:
            entry.close()
        assert wait_for(lambda: not with_token(token + "-kept"), GONE_WITHIN_S), "a sandbox nobody took lived on"
