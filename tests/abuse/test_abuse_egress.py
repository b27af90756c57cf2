"""Network 'allowlist' under attack: its one way out is the session's own policy proxy, and nothing
a sandbox does reaches past it, into the host, into another session's proxy, or wears it down.

One server for the module. Its ceiling allowlists, on purpose, names and addresses the proxy must
refuse anyway (localhost, 127.0.0.1, a private 10.x server, the host's own address on the test's
veth pair), with the port of a listener on the host's loopback among the allowed ports. After
each attack: the server still serves, and a bystander session (made before any attack) still
reaches the allowed server and keeps its state.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from ..conftest import ServerDirs, _passable, run, server_env, stdio_client, text_of
from ..netns_servers import BODY, NetnsServers
from .conftest import BYSTANDER_VALUE

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

BLOCKED = "blocked by CodeRunner's network policy"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def loopback_listener() -> Iterator[socket.socket]:
    """A service on the host's 127.0.0.1 that no sandbox may reach (it must never accept)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield listener
    listener.close()


@dataclass
class Net:
    client: Client
    servers: NetnsServers
    dirs: ServerDirs
    bystander: str
    loopback_port: int


@pytest.fixture(scope="module")
async def net(servers: NetnsServers, loopback_listener: socket.socket) -> AsyncIterator[Net]:
    root = _passable(Path(tempfile.mkdtemp(prefix="crg-", dir="/tmp")))
    dirs = ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    port = loopback_listener.getsockname()[1]
    ceiling = [servers.public_ip, servers.private_ip, servers.host_ip, "localhost", "127.0.0.1", "::1"]
    env = server_env(
        dirs,
        CODERUNNER_ALLOWED_DOMAINS=json.dumps(ceiling),
        CODERUNNER_ALLOWED_PORTS=json.dumps([80, 443, port]),
        CODERUNNER_EGRESS_AUDIT_LOG=str(root / "egress.jsonl"),
        CODERUNNER_TIMEOUT_S="60",
        CODERUNNER_MAX_SESSIONS="6",
    )
    try:
        async with stdio_client(env) as client:
            bystander = await create(client, network="allowlist")
            await ok(client, f"guarded = {BYSTANDER_VALUE!r}", bystander)
            yield Net(client, servers, dirs, bystander, port)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def create(client: Client, **arguments: object) -> str:
    created = await client.call_tool("create_session", arguments)
    assert not created.is_error, text_of(created)
    return json.loads(text_of(created))["session_id"]


async def ok(client: Client, code: str, session_id: str) -> str:
    result = await run(client, code, session_id=session_id)
    assert not result.is_error, text_of(result)
    return text_of(result)


def last_json(text: str) -> Any:
    """The last JSON value a probe printed (the reply ends with a status line of its own)."""
    for line in reversed(text.splitlines()):
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AssertionError(f"no JSON in: {text[-2000:]}")


def get_code(url: str) -> str:
    return f"""
import urllib.request, urllib.error
try:
    print(urllib.request.urlopen({url!r}, timeout=20).read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code, exc.read().decode())
"""


async def assert_unharmed(net: Net) -> None:
    """The server serves, and the bystander still has its state and its network."""
    text = await ok(net.client, f"print(guarded)\n{get_code(f'http://{net.servers.public_ip}/')}", net.bystander)
    assert BYSTANDER_VALUE in text and BODY in text, text


def loopback_untouched(listener: socket.socket) -> bool:
    try:
        connection, _ = listener.accept()
    except BlockingIOError:
        return True
    connection.close()
    return False


# A CONNECT straight at the proxy (past NO_PROXY), and the first line of its answer.
CONNECT = """
import socket
def tunnel(target):
    with socket.create_connection(('127.0.0.1', 3128), timeout=20) as s:
        s.sendall(f'CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n'.encode())
        return s.recv(4096).decode('latin-1')
"""


async def test_host_loopback_and_own_addresses_stay_unreachable(net: Net, loopback_listener: socket.socket) -> None:
    port = net.loopback_port
    targets = [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"{net.servers.host_ip}:80",
               f"{net.servers.private_ip}:80", "169.254.169.254:80"]  # fmt: skip
    code = (
        CONNECT
        + f"""
import json
answers = {{t: tunnel(t).split('\\r\\n')[0] for t in {targets!r}}}
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=5)
    direct = 'CONNECTED'
except OSError as exc:
    direct = f'refused {{exc.errno}}'
print(json.dumps({{'answers': answers, 'direct': direct}}))
"""
    )
    session = await create(net.client, network="allowlist")
    found = last_json(await ok(net.client, code, session))
    for target, answer in found["answers"].items():
        assert answer.startswith("HTTP/1.1 403"), (target, answer)
    assert found["direct"].startswith("refused"), found
    assert loopback_untouched(loopback_listener), "a sandbox reached the host's loopback service"
    await assert_unharmed(net)


async def test_a_session_cannot_use_another_sessions_proxy_or_policy(net: Net) -> None:
    a = await create(net.client, network="allowlist", allow=["localhost"])
    b = await create(net.client, network="allowlist", allow=[net.servers.public_ip])
    sockets = sorted(str(path) for path in net.dirs.runtime.glob("*/host/egress.sock"))
    assert len(sockets) >= 3, sockets  # bystander, a, b
    code = f"""
import json, socket
reached = []
for path in {sockets!r}:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        reached.append(path)
    except OSError:
        pass
    finally:
        s.close()
print(json.dumps(reached))
""" + get_code(f"http://{net.servers.public_ip}/")
    text = await ok(net.client, code, a)
    reached = last_json(text.split("\n", 1)[0])
    assert len(reached) == 1, f"session A reached more than its own proxy socket: {reached}"
    assert "403" in text and BLOCKED in text and BODY not in text, "A used B's policy"
    # Each socket is its sandbox's alone: mode 0600, and on a root server each its own host uid.
    owners = set()
    for path in sockets:
        info = os.stat(path)
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, (path, oct(info.st_mode))
        owners.add(info.st_uid)
    if os.getuid() == 0:
        assert len(owners) == len(sockets), "sandboxes share a host uid: sockets would be connectable by others"
    assert BODY in await ok(net.client, get_code(f"http://{net.servers.public_ip}/"), b)
    for session in (a, b):
        await net.client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    await assert_unharmed(net)


async def test_the_sandbox_cannot_replace_or_remove_its_proxy_socket(net: Net) -> None:
    session = await create(net.client, network="allowlist")
    sockets = sorted(str(path) for path in net.dirs.runtime.glob("*/host/egress.sock"))
    code = (
        f"import json, os, socket\n[path] = [p for p in {sockets!r} if os.path.exists(p)]\n"
        + """
results = {}
for name, action in [('unlink', lambda: os.unlink(path)),
                     ('rename', lambda: os.rename(path, path + '.x')),
                     ('bind-beside', lambda: socket.socket(socket.AF_UNIX).bind(path + '.evil'))]:
    try:
        action()
        results[name] = 'DONE'
    except OSError as exc:
        results[name] = exc.errno
print(json.dumps(results))
"""
    )
    results = last_json(await ok(net.client, code, session))
    assert "DONE" not in results.values(), results
    assert BODY in await ok(net.client, get_code(f"http://{net.servers.public_ip}/"), session)
    await net.client.call_tool("manage_sessions", {"action": "close", "session_id": session})


async def test_killing_the_forwarder_leaves_no_network_not_an_open_one(net: Net) -> None:
    kill = """
import os, signal, time
killed = []
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        cmdline = open(f'/proc/{pid}/cmdline', 'rb').read()
    except OSError:
        continue
    # pid 1 is the sandbox's init, whose own argv names the forwarder; it ignores the signal.
    if b'egress_forwarder' in cmdline and pid != '1':
        os.kill(int(pid), signal.SIGKILL)
        killed.append(pid)
# SIGKILL lands asynchronously: until the process has exited, its listening socket still
# queues a connect, which is then reset rather than refused. Wait (bounded) for the exit.
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    def alive(pid):
        try:
            return 'State:\tZ' not in open(f'/proc/{pid}/status').read()
        except OSError:
            return False
    if killed and not any(alive(pid) for pid in killed):
        print('killed', killed)
        break
    time.sleep(0.05)
"""
    session = await create(net.client, network="allowlist")
    assert "killed" in await ok(net.client, kill, session)
    after = await run(net.client, get_code(f"http://{net.servers.public_ip}/"), session_id=session)
    assert after.is_error and "Connection refused" in text_of(after), text_of(after)
    raw = f"""
import socket
try:
    socket.create_connection(({net.servers.public_ip!r}, 80), timeout=5); print('CONNECTED')
except OSError as exc:
    print('refused', exc.errno)
"""
    assert "refused" in await ok(net.client, raw, session)
    # A fresh kernel comes with a fresh forwarder.
    reset = await net.client.call_tool("kernel_reset", {"session_id": session})
    assert not reset.is_error, text_of(reset)
    assert BODY in await ok(net.client, get_code(f"http://{net.servers.public_ip}/"), session)
    await net.client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    await assert_unharmed(net)


FLOOD = """
import socket, threading, time
held = []
def open_many(n, partial):
    for _ in range(n):
        try:
            s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
        except OSError:
            continue
        if partial:
            s.sendall(b'CONNECT ')  # a head that never ends (slowloris)
        held.append(s)
threads = [threading.Thread(target=open_many, args=(50, i % 2 == 0)) for i in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
def drip():
    for _ in range(30):
        for s in held[:20]:
            try:
                s.sendall(b'x')
            except OSError:
                pass
        time.sleep(1)
threading.Thread(target=drip, daemon=True).start()
print('holding', len(held))
"""


async def test_a_flood_and_a_slowloris_leave_the_proxy_and_a_bystander_serving(net: Net) -> None:
    session = await create(net.client, network="allowlist")
    text = await ok(net.client, FLOOD, session)
    assert "holding 200" in text, text
    # While the flood holds its connections: the server and the bystander serve.
    await assert_unharmed(net)
    release = "for s in held: s.close()\nheld.clear()\nimport time; time.sleep(0.5)\n" + get_code(
        f"http://{net.servers.public_ip}/"
    )
    text = await ok(net.client, release, session)
    assert BODY in text, f"the flooded session's proxy did not recover: {text[-1500:]}"
    await net.client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    await assert_unharmed(net)
