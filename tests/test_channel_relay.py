"""The gVisor channel relay (guest/channel_relay.py) and kernel boot (guest/kernel_boot.py), on the
host: a real relay process with a real ipykernel behind it, a real jupyter_client in front.

The relay is not pid 1 here; it makes itself the kernel's subreaper so that reaping is tested too.
State numbering under test: every announcement counts up from 1 ("open 1" at start, then
"closed 2" on USR1, "open 3" on USR2, ...).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient

from coderunner.config import Settings
from coderunner.guest.channel_relay import MAX_CONNECTIONS
from coderunner.sandbox.common import RELAY_STATE, RELAY_STATE_MAX_BYTES
from tests.fakes.backend import kernel_python

GUEST = Path(__file__).resolve().parents[1] / "src" / "coderunner" / "guest"
RELAY = GUEST / "channel_relay.py"
PORTS = {"shell_port": 41001, "iopub_port": 41002, "stdin_port": 41003, "control_port": 41004, "hb_port": 41005}
#: Bound on every wait here (a shared, slow machine); never a timing assertion.
WAIT_S = 90.0


@pytest.fixture(scope="module")
def python() -> Path:
    found = kernel_python(Settings().sandbox_env)
    if found is None:
        pytest.fail("no interpreter with ipykernel: run `coderunner setup`")
    return found


@dataclass
class Arena:
    """A run dir (the sandbox's, where the relay binds), a host dir (the connection file) and the
    host's own sock dir it claims the sockets into, as the product does."""

    root: Path
    python: Path
    key: str

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def sock(self) -> Path:
        return self.root / "sock"

    @property
    def connection_file(self) -> Path:
        return self.root / "host" / "kernel-0.json"

    def kernel_argv(self, *program: str) -> list[str]:
        """The host's kernel command (kernel.py's shape, behind a prlimit prefix), or `program`."""
        if not program:
            program = ("-m", "ipykernel_launcher")
        return [
            "/usr/bin/prlimit", "--nproc=4096", "--",
            str(self.python), *program, "-f", str(self.connection_file),
            "--HistoryManager.hist_file=:memory:",
        ]  # fmt: skip

    def start(self, *program: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(self.root / "lib")}
        argv = [str(self.python), "-I", "-S", str(RELAY), "--run-dir", str(self.run), "--", *self.kernel_argv(*program)]
        stderr = (self.root / "relay.err").open("wb")
        try:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr)
        finally:
            stderr.close()

    def stderr(self) -> str:
        return (self.root / "relay.err").read_text(errors="replace")

    def state(self) -> str | None:
        try:
            with (self.run / RELAY_STATE).open("rb") as state:
                return state.read(RELAY_STATE_MAX_BYTES).decode()
        except FileNotFoundError:
            return None

    def wait_state(self, expected: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while (said := self.state()) != expected:
            if time.monotonic() > deadline:
                pytest.fail(f"relay said {said!r}, not {expected!r}; its stderr: {self.stderr()}")
            time.sleep(0.01)

    def names(self) -> list[str]:
        return [f"k0-{port}" for port in PORTS.values()]

    def claim(self) -> None:
        """Rename the relay's fresh sockets into sock/ (over dead ones of an earlier bind)."""
        for name in self.names():
            assert stat.S_ISSOCK(os.lstat(self.run / name).st_mode)
            os.rename(self.run / name, self.sock / name)

    def client(self) -> BlockingKernelClient:
        client = BlockingKernelClient()
        client.load_connection_info(
            {
                **PORTS,
                "transport": "ipc",
                "ip": str(self.sock / "k0"),
                "key": self.key,
                "signature_scheme": "hmac-sha256",
            }
        )
        client.start_channels()
        client.wait_for_ready(timeout=WAIT_S)
        return client


@pytest.fixture
def arena(python: Path) -> Iterator[Arena]:
    root = Path(tempfile.mkdtemp(prefix="crr-", dir="/tmp"))  # unix socket paths: at most 107 bytes
    try:
        for name in ("run", "sock", "host", "lib"):
            (root / name).mkdir()
        (root / "lib" / "coderunner_guest").symlink_to(GUEST)
        key = secrets.token_hex(16)
        info = {**PORTS, "transport": "ipc", "ip": str(root / "run" / "k0"), "key": key,
                "signature_scheme": "hmac-sha256", "kernel_name": ""}  # fmt: skip
        (root / "host" / "kernel-0.json").write_text(json.dumps(info))
        yield Arena(root, python, key)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def relays() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Relays a test started; each is killed (its process group too) if the test left it running."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for relay in started:
        if relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            try:
                relay.wait(timeout=30)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait(timeout=30)


def run(client: BlockingKernelClient, code: str) -> tuple[dict[str, Any], list[str]]:
    """Execute `code`; its reply content and what it printed or returned, in order."""
    out: list[str] = []

    def hook(message: dict[str, Any]) -> None:
        content = message["content"]
        if message["msg_type"] == "stream":
            out.append(content["text"])
        elif message["msg_type"] == "execute_result":
            out.append(content["data"]["text/plain"])

    reply = client.execute_interactive(code, timeout=WAIT_S, output_hook=hook)
    return reply["content"], out


def value(client: BlockingKernelClient, code: str) -> str:
    content, out = run(client, code)
    assert content["status"] == "ok", content
    return "".join(out)


def refuses(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        return False


def dropped(connection: socket.socket) -> bool:
    """The peer closed it: EOF, or a reset (the relay closes with our bytes unread)."""
    connection.settimeout(WAIT_S)
    try:
        return connection.recv(16) == b""
    except ConnectionResetError:
        return True


def test_close_and_reopen_keep_the_kernel(arena: Arena, relays: list[subprocess.Popen[bytes]]) -> None:
    relays.append(relay := arena.start())
    arena.wait_state("open 1\n")
    arena.claim()
    client = arena.client()
    assert value(client, "1+1") == "2"
    assert value(client, "kept = 41") == ""

    relay.send_signal(signal.SIGUSR1)
    arena.wait_state("closed 2\n")
    for name in arena.names():
        assert refuses(arena.sock / name), name
    client.stop_channels()

    relay.send_signal(signal.SIGUSR2)
    arena.wait_state("open 3\n")
    arena.claim()  # over the dead sockets: the host connects to the same paths again
    again = arena.client()
    assert value(again, "1+1") == "2"
    assert value(again, "kept + 1") == "42"
    again.stop_channels()
    assert relay.poll() is None


def test_reopen_fails_while_a_path_is_taken(arena: Arena, relays: list[subprocess.Popen[bytes]]) -> None:
    """A relay whose kernel never binds bounds its connections, closes, fails clearly, opens again."""
    relays.append(relay := arena.start("-c", "import time; time.sleep(600)"))
    arena.wait_state("open 1\n")
    extra = 4
    early = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(MAX_CONNECTIONS + extra)]
    try:
        for each in early:  # the relay keeps dialing the absent kernel for each
            each.connect(str(arena.run / arena.names()[0]))
            each.sendall(b"hello")
        deadline = time.monotonic() + WAIT_S
        while len(ready := select.select(early, [], [], 1)[0]) < extra and time.monotonic() < deadline:
            pass
        assert len(ready) == extra  # the connections past the bound are dropped at once
        assert all(dropped(each) for each in ready)
        relay.send_signal(signal.SIGUSR1)
        arena.wait_state("closed 2\n")
        assert all(dropped(each) for each in early)  # the relay dropped every other one
    finally:
        for each in early:
            each.close()
    relay.send_signal(signal.SIGUSR2)  # the dead socket files are still in run/
    arena.wait_state("failed 3\n")
    assert "cannot bind" in arena.stderr()
    for name in arena.names():
        os.unlink(arena.run / name)
    relay.send_signal(signal.SIGUSR2)
    arena.wait_state("open 4\n")
    assert not refuses(arena.run / arena.names()[0])
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(timeout=WAIT_S) == 128 + signal.SIGTERM


def test_forked_output_reaches_iopub_and_no_tcp_socket(arena: Arena, relays: list[subprocess.Popen[bytes]]) -> None:
    relays.append(arena.start())
    arena.wait_state("open 1\n")
    arena.claim()
    client = arena.client()
    code = (
        "import os\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    print('from the forked child', flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(child, 0)\n"
    )
    content, out = run(client, code)
    assert content["status"] == "ok", content
    deadline = time.monotonic() + WAIT_S  # the child's output may trail the parent's idle
    while "from the forked child" not in "".join(out) and time.monotonic() < deadline:
        try:
            message = client.get_iopub_msg(timeout=1)
        except Exception:  # queue.Empty
            continue
        if message["msg_type"] == "stream":
            out.append(message["content"]["text"])
    assert "from the forked child" in "".join(out)
    tcp_sockets = (
        "import os\n"
        "mine = set()\n"
        "for fd in os.listdir('/proc/self/fd'):\n"
        "    try:\n"
        "        mine.add(os.readlink(f'/proc/self/fd/{fd}'))\n"
        "    except OSError:\n"
        "        pass  # the listing's own fd\n"
        "tcp = set()\n"
        "for table in ('/proc/net/tcp', '/proc/net/tcp6'):\n"
        "    for line in open(table).read().splitlines()[1:]:\n"
        "        tcp.add(f'socket:[{line.split()[9]}]')\n"
        "print(len(mine & tcp), sum(item.startswith('socket:') for item in mine))\n"
    )
    held_tcp, held_sockets = value(client, tcp_sockets).split()
    assert held_tcp == "0"
    assert int(held_sockets) > 5  # the probe does see the kernel's (ipc) sockets
    client.stop_channels()


def test_kernel_exit_ends_the_relay_with_its_status(arena: Arena, relays: list[subprocess.Popen[bytes]]) -> None:
    relays.append(relay := arena.start("-c", "import sys; sys.exit(3)"))
    assert relay.wait(timeout=WAIT_S) == 3
    relays.append(killed := arena.start("-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert killed.wait(timeout=WAIT_S) == 128 + signal.SIGKILL


def test_a_real_kernel_ending_ends_the_relay(arena: Arena, relays: list[subprocess.Popen[bytes]]) -> None:
    """os._exit in a cell, not a shutdown_request: ipykernel 7.4's own exit after one now and then
    takes 10 s (direct too), and about 1 in 60 through the relay hangs in a blocking zmq send or
    aborts (stock launcher and kernel_boot alike). The product kills the sandbox, never asks."""
    relays.append(relay := arena.start())
    arena.wait_state("open 1\n")
    arena.claim()
    client = arena.client()
    client.execute("import os; os._exit(5)")
    assert relay.wait(timeout=WAIT_S) == 5
    client.stop_channels()


def test_sigterm_ends_relay_and_kernel(arena: Arena, relays: list[subprocess.Popen[bytes]]) -> None:
    relays.append(relay := arena.start())
    arena.wait_state("open 1\n")
    arena.claim()
    client = arena.client()
    kernel, group = value(client, "import os; os.getpid(), os.getpgid(0)").strip("()").split(", ")
    assert kernel == group  # its own process group, so an interrupt reaches its children too
    client.stop_channels()
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(timeout=WAIT_S) == 128 + signal.SIGTERM
    assert not Path(f"/proc/{kernel}").exists()  # ended and reaped by the relay


def test_orphans_of_the_kernel_are_reaped(arena: Arena, relays: list[subprocess.Popen[bytes]]) -> None:
    relays.append(relay := arena.start())
    arena.wait_state("open 1\n")
    arena.claim()
    client = arena.client()
    orphan = int(
        value(
            client,
            "import subprocess\n"
            "subprocess.check_output(['sh', '-c', 'sleep 300 >/dev/null 2>&1 & echo $!']).decode().strip()",
        ).strip("'")
    )
    parent = Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1]
    assert int(parent) == relay.pid  # re-parented to the relay, as to pid 1 in the sandbox
    os.kill(orphan, signal.SIGTERM)
    deadline = time.monotonic() + WAIT_S
    while Path(f"/proc/{orphan}").exists():  # a zombie keeps its /proc entry until reaped
        assert time.monotonic() < deadline, "the relay did not reap the kernel's orphan"
        time.sleep(0.05)
    client.stop_channels()


def test_a_command_without_connection_file_is_refused(arena: Arena) -> None:
    done = subprocess.run(
        [str(arena.python), "-I", "-S", str(RELAY), "--run-dir", str(arena.run), "--", "true"],
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert done.returncode == 2
    assert "channel relay: the kernel command has no '-f CONNECTION_FILE'" in done.stderr


@pytest.mark.parametrize("broken", [False, True])
def test_kernel_boot_falls_back_to_the_stock_pipe(arena: Arena, broken: bool) -> None:
    """An ipykernel without the private pipe methods keeps its own pipe, and says so."""
    code = (
        "import ipykernel.iostream as iostream\n"
        + ("del iostream.IOPubThread._setup_pipe_out\n" if broken else "")
        + "stock = iostream.IOPubThread._setup_pipe_in\n"
        "from coderunner_guest import kernel_boot\n"
        "print(kernel_boot.install_ipc_pipe('/tmp/nowhere'), iostream.IOPubThread._setup_pipe_in is stock)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(arena.root / "lib")}
    done = subprocess.run([str(arena.python), "-c", code], capture_output=True, text=True, env=env, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["False", "True"] if broken else ["True", "False"])
    assert ("IOPub's fork pipe stays on TCP" in done.stderr) is broken


def test_kernel_boot_reads_shell_on_the_main_thread_and_publishes_by_callback(
    arena: Arena, relays: list[subprocess.Popen[bytes]]
) -> None:
    """Behind the relay the kernel has no shell channel thread (so no subshells) and its IOPub thread
    takes work by callback; what a user sees is the same: an async cell, a thread's print, stderr."""
    relays.append(arena.start())
    arena.wait_state("open 1\n")
    arena.claim()
    client = arena.client()
    names = value(client, "import threading\nprint(sorted(t.name for t in threading.enumerate()))")
    assert "'Control'" in names and "'IOPub'" in names and "Shell channel" not in names, names
    info = client.kernel_info(reply=True, timeout=WAIT_S)["content"]
    assert "kernel subshells" not in info.get("supported_features", []), info
    assert value(client, "import asyncio\nawait asyncio.sleep(0.01)\nprint('awaited')") == "awaited\n"
    said = value(client, "t = threading.Thread(target=print, args=('from a thread',))\nt.start()\nt.join()")
    assert said == "from a thread\n"
    content, out = run(client, "import sys\nprint('to stderr', file=sys.stderr)\n1 / 0")
    assert content["status"] == "error" and content["ename"] == "ZeroDivisionError" and "to stderr\n" in out
    assert "kept" not in arena.stderr()  # neither change fell back to ipykernel's stock
    client.stop_channels()


@pytest.mark.parametrize("broken", [False, True])
def test_kernel_boot_keeps_stock_shell_and_iopub_for_an_unknown_ipykernel(arena: Arena, broken: bool) -> None:
    code = (
        "import ipykernel.iostream as iostream, ipykernel.kernelbase as kernelbase\n"
        + (
            "del iostream.IOPubThread._handle_event\ndel kernelbase.Kernel._supports_kernel_subshells\n"
            if broken
            else ""
        )
        + "stock = iostream.IOPubThread.schedule\n"
        "from coderunner_guest import kernel_boot\n"
        "print(kernel_boot.drop_shell_channel_thread(), kernel_boot.schedule_by_callback(),"
        " iostream.IOPubThread.schedule is stock)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(arena.root / "lib")}
    done = subprocess.run([str(arena.python), "-c", code], capture_output=True, text=True, env=env, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["False", "False", "True"] if broken else ["True", "True", "False"])
    assert ("kept" in done.stderr) is broken
