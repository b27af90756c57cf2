"""The host never acts by path on anything the sandbox can write.

Sandboxed code replaces every entry it can write (its runtime dir, its workspace, the spill
folder) with links to canaries this test made: a file, a folder, a listening unix socket and a
FIFO. It plants the names the host used to write (etc/, connection files, host.lock, sockets)
and a 1,500-level deep tree. Then the kernel is killed, restarted, reset, the session closed, and
a server is SIGKILLed with a trapped session and a new one started on the same dirs. No canary
may be touched, the server must still serve, a bystander session keeps its state, and nothing
of the dead server is left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..conftest import (
    ServerDirs,
    _passable,
    json_of,
    raw_stdio_server,
    run,
    server_env,
    stdio_client,
    text_of,
    wait_until,
)
from ..test_e2e_podman import OCI_RUNTIME, podman_image  # noqa: F401  (the session's image fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Canaries:
    root: Path
    listener: socket.socket
    fifo_fd: int

    @property
    def targets(self) -> dict[str, str]:
        return {kind: str(self.root / kind) for kind in ("file", "dir", "sock", "fifo")}

    def snapshot(self) -> dict[str, object]:
        """Everything a host write, chown, chmod, create or delete through a link would change."""
        seen: dict[str, object] = {}
        for path in sorted(self.root.rglob("*")):
            info = path.lstat()
            seen[str(path)] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid,
                               info.st_size, info.st_mtime_ns)  # fmt: skip
        seen["file-content"] = (self.root / "file").read_bytes()
        return seen

    def connections(self) -> int:
        """Connections the host (or anyone) made to the canary socket."""
        count = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    def fifo_data(self) -> bytes:
        try:
            return os.read(self.fifo_fd, 4096)
        except BlockingIOError:
            return b""


@pytest.fixture
def canaries() -> Iterator[Canaries]:
    root = Path(tempfile.mkdtemp(prefix="crc-", dir="/tmp"))
    root.chmod(0o755)
    (root / "file").write_text("canary: must stay exactly like this\n")
    (root / "file").chmod(0o600)
    (root / "dir").mkdir(mode=0o700)
    (root / "dir" / "inside").write_text("inside the canary dir\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(root / "sock"))
    listener.listen(256)
    listener.setblocking(False)
    os.mkfifo(root / "fifo", 0o600)
    fifo_fd = os.open(root / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    yield Canaries(root, listener, fifo_fd)
    listener.close()
    os.close(fifo_fd)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["bwrap", "podman", "gvisor"])
def backend_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The same traps on every backend that shares the host's file systems (gvisor through its gofer)."""
    if request.param == "podman":
        request.getfixturevalue("podman_image")  # built once per test session
        return {"CODERUNNER_BACKEND": "podman", "CODERUNNER_OCI_RUNTIME": OCI_RUNTIME}
    if request.param == "gvisor":
        request.getfixturevalue("podman_image")
        if shutil.which("runsc") is None:
            pytest.fail("runsc is not installed: run ./install.sh (it installs runsc for the gvisor backend)")
        return {"CODERUNNER_BACKEND": "gvisor"}
    return {"CODERUNNER_BACKEND": "bwrap"}


@pytest.fixture
def trap_dirs() -> Iterator[ServerDirs]:
    root = _passable(Path(tempfile.mkdtemp(prefix="crp-", dir="/tmp")))
    yield ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    # A failed run may leave loop mounts behind: never let rmtree walk into them.
    for mount in root.glob("w/*"):
        if os.path.ismount(mount):
            os.system(f"umount -l {mount} 2>/dev/null")
    shutil.rmtree(root, ignore_errors=True)


#: Runs in the sandbox: every writable entry becomes a link to a canary, plus the names the host
#: once wrote by, plus a deep tree. Prints what it replaced, so a failure shows the ground covered.
TRAP = r"""
import json, os, sys, glob, itertools
TARGETS = json.loads(CANARIES)
cycle = itertools.cycle(list(TARGETS.values()))
writable = []
for line in open('/proc/self/mountinfo'):
    fields = line.split()
    point, options = fields[4].replace('\\040', ' '), fields[5].split(',')
    if 'rw' in options and point not in ('/', '/tmp', '/dev', '/dev/shm', '/proc', '/sys') \
            and not point.startswith(('/proc/', '/dev/', '/sys/')) and os.access(point, os.W_OK):
        writable.append(point)
if os.access('/workspace/.coderunner', os.W_OK):
    writable.append('/workspace/.coderunner')
argv = open('/proc/self/cmdline', 'rb').read().decode().split('\0')
info = json.load(open(argv[argv.index('-f') + 1])) if '-f' in argv else {}
replaced = []
def plant(folder, name):
    path = os.path.join(folder, name)
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rename(path, path + '.moved')
        elif os.path.lexists(path):
            os.unlink(path)
        os.symlink(next(cycle), path)
        replaced.append(path)
    except OSError as exc:
        replaced.append(f'{path}: {exc.strerror}')
def deep_tree(folder):
    # 1,500 nested folders, each with a link: recursion-based cleanup breaks on it.
    if os.path.lexists(os.path.join(folder, 'deep')):
        return
    os.mkdir(os.path.join(folder, 'deep'))
    here = os.open(os.path.join(folder, 'deep'), os.O_RDONLY)
    for _ in range(1500):
        os.mkdir('d', dir_fd=here)
        following = os.open('d', os.O_RDONLY, dir_fd=here)
        os.symlink(next(cycle), 'link', dir_fd=following)
        os.close(here)
        here = following
    os.close(here)
for folder in writable:
    try:
        names = os.listdir(folder)
    except OSError:
        continue
    for name in names:
        if name != 'deep':
            plant(folder, name)
    deep_tree(folder)
    for name in ['etc', 'host.lock', 'lock', 'run', 'host', 'sock', 'variables.json', 'main.py', 'main.js', 'main.sh',
                 '.coderunner', 'site-packages', 'output.txt', 'passwd', 'resolv.conf']:
        plant(folder, name)
    for generation in range(0, 8):
        plant(folder, f'kernel-{generation}.json')
        plant(folder, f'kernel-{generation}.guest.json')
    prefix = os.path.basename(info.get('ip', 'k0')).rstrip('0123456789')
    for generation in range(0, 8):
        for port in (info.get('shell_port'), info.get('iopub_port'), info.get('control_port'), info.get('hb_port'),
                     info.get('stdin_port')):
            plant(folder, f'{prefix}{generation}-{port}')
print(json.dumps({'writable': sorted(writable), 'replaced': len(replaced)}))
"""


def trap(canaries: Canaries) -> str:
    return f"CANARIES = {json.dumps(json.dumps(canaries.targets))}\n" + TRAP


def assert_untouched(canaries: Canaries, before: dict[str, object]) -> None:
    assert canaries.snapshot() == before, "a canary changed: the host acted through a planted link"
    assert canaries.connections() == 0, "the host connected to the canary socket through a planted link"
    assert canaries.fifo_data() == b"", "the host wrote into the canary FIFO through a planted link"


async def test_planted_links_never_lead_the_host_anywhere(
    canaries: Canaries, trap_dirs: ServerDirs, backend_env: dict[str, str]
) -> None:
    before = canaries.snapshot()
    env = server_env(trap_dirs, CODERUNNER_DISK_MB="64", CODERUNNER_OUTPUT_LIMIT_CHARS="2000", **backend_env)
    async with stdio_client(env) as client:
        bystander = json.loads(text_of(await client.call_tool("create_session", {})))["session_id"]
        assert not (await run(client, "kept = 'bystander-9c1'", session_id=bystander)).is_error

        victim = json.loads(text_of(await client.call_tool("create_session", {})))["session_id"]
        planted = await run(client, trap(canaries), session_id=victim)
        assert not planted.is_error, text_of(planted)
        report = json.loads(text_of(planted).splitlines()[0])
        assert report["replaced"] > 20 and "/workspace" in report["writable"], report
        # Output past the inline limit spills to a file in the (trapped) workspace; images too.
        spilled = await run(client, "print('x' * 50_000)", session_id=victim)
        assert "characters omitted" in text_of(spilled)
        # Kill the kernel from inside: the automatic restart re-creates everything host-side.
        died = await run(client, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", session_id=victim)
        assert "kernel died" in text_of(died), text_of(died)
        assert not (await run(client, trap(canaries), session_id=victim)).is_error
        reset = await client.call_tool("kernel_reset", {"session_id": victim})
        assert not reset.is_error, text_of(reset)
        assert not (await run(client, trap(canaries), session_id=victim)).is_error
        assert not (await client.call_tool("manage_sessions", {"action": "close", "session_id": victim})).is_error
        assert_untouched(canaries, before)

        # One-shot runs share the layout: trap their dirs too.
        oneshot = await client.call_tool(
            "execute_code",
            {"language": "python", "code": trap(canaries)},
        )
        assert json_of(oneshot) is not None

        again = await run(client, "kept", session_id=bystander)
        assert "bystander-9c1" in text_of(again), text_of(again)
        assert text_of(await run(client, "6 * 7")).startswith("42")
    assert_untouched(canaries, before)
    left = [path.name for path in trap_dirs.runtime.iterdir() if re.fullmatch("[0-9a-f]{8}", path.name)]
    assert left == [], f"closed sessions left their dirs behind: {left}"


async def test_a_sigkilled_server_leaves_traps_that_are_cleared_once_it_is_gone(
    canaries: Canaries, trap_dirs: ServerDirs, backend_env: dict[str, str]
) -> None:
    """Its dirs sweeper (hostfs/dirs_sweeper.py) and the next start's sweep both take the trapped dirs (each
    only with their lock): whichever gets them, they go, and nothing the traps point at is touched."""
    before = canaries.snapshot()
    env = server_env(trap_dirs, CODERUNNER_DISK_MB="64", **backend_env)
    with raw_stdio_server(env, [("run_python", {"code": trap(canaries)})]) as server:
        sessions = [path for path in trap_dirs.runtime.iterdir() if path.is_dir() and len(path.name) == 8]
        assert sessions, "the trapped session's dirs should exist while its server runs"
        server.kill()
        server.wait(timeout=10)
    async with stdio_client(env) as client:
        result = await run(client, "1 + 1")
        assert text_of(result).startswith("2"), text_of(result)
        gone = await wait_until(lambda: not any(path.exists() for path in sessions), timeout_s=60)
        assert gone, f"{[path for path in sessions if path.exists()]} of the SIGKILLed server were not removed"
    leftovers = [path for path in trap_dirs.workspace_entries() if not path.name.startswith("named-")]
    assert leftovers == [], leftovers
    assert_untouched(canaries, before)
