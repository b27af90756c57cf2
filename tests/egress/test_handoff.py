"""A client socket handed over the proxy's unix socket (SCM_RIGHTS): served like a plain client when
it is a connected TCP socket, refused otherwise, and never a way to wear the proxy down.

The test process plays the sandbox (it sends the fds) and is the host too (the proxy runs here), so
"no fd leaks" is checked on this process's own fd table. The real forwarder runs as a process,
straight and behind a relay that carries bytes but not fds (as a VM's socket relay does).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from coderunner.egress import EgressPolicy, ProxyLimits, relay
from coderunner.egress import handoff as host_side

from .harness import (
    Upstream,
    exchange,
    loopback_only,
    peak_connections,
    piping_to,
    resolver_for,
    running_proxy,
    status_of,
)

pytestmark = pytest.mark.anyio

FORWARDER = Path(__file__).parents[2] / "src" / "coderunner" / "guest" / "egress_forwarder.py"


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = await Upstream().start()
    yield up
    await up.stop()


def proxy_for(up: Upstream, **kw: object) -> contextlib.AbstractAsyncContextManager:  # type: ignore[type-arg]
    policy = EgressPolicy.parse(["ok.test"], ports=[up.port])
    return running_proxy(policy, resolver=resolver_for({"ok.test": ["127.0.0.1"]}), address_check=loopback_only, **kw)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(the client's end, the accepted end) of a fresh loopback TCP connection: what the forwarder has."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    return client, accepted


async def hand_over(path: str, fds: list[int], first: bytes = host_side.HANDOFF) -> bytes:
    """Send `first` with `fds` attached on a new connection to the proxy; its answer ('' if it closed)."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.setblocking(False)
        await loop.sock_connect(conn, path)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        conn.sendmsg([first], ancillary)
        try:
            return await asyncio.wait_for(loop.sock_recv(conn, 1), 10)
        except ConnectionResetError:
            return b""


def open_fds() -> dict[int, str]:
    """This process's open fds and what each is (the listing's own fd, closed by then, left out)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


async def leaked_fds(before: dict[int, str]) -> dict[int, str]:
    """Fds open now that were not before, once the proxy has closed what it got (bounded wait)."""
    for _ in range(200):
        extra = {fd: what for fd, what in open_fds().items() if before.get(fd) != what}
        if not extra:
            break
        await asyncio.sleep(0.02)
    return extra


CONNECT = b"CONNECT ok.test:%d HTTP/1.1\r\nHost: ok.test\r\n\r\n"


async def tunnel_through(client: socket.socket, port: int, payload: bytes) -> bytes:
    """CONNECT on the client's end, then echo `payload` through the upstream; the bytes echoed back."""
    loop = asyncio.get_running_loop()
    client.setblocking(False)
    await loop.sock_sendall(client, CONNECT % port)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await asyncio.wait_for(loop.sock_recv(client, 4096), 10)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200 "), head
    echoed = bytearray(head.split(b"\r\n\r\n", 1)[1])

    async def send() -> None:
        await loop.sock_sendall(client, payload)
        client.shutdown(socket.SHUT_WR)

    sender = asyncio.ensure_future(send())
    while len(echoed) < len(payload):
        chunk = await asyncio.wait_for(loop.sock_recv(client, 1 << 16), 10)
        if not chunk:
            break
        echoed += chunk
    await sender
    return bytes(echoed)


async def test_a_handed_over_socket_is_served_and_recorded_like_a_plain_client(upstream: Upstream) -> None:
    before = open_fds()
    async with proxy_for(upstream) as run:
        client, accepted = tcp_pair()
        assert await hand_over(run.path, [accepted.fileno()]) == host_side.TAKEN
        accepted.close()  # the forwarder's copy goes; the host's is the only one left
        payload = os.urandom(3 * 2**20)  # past what a relay moves on the event loop: a worker thread too
        assert await tunnel_through(client, upstream.port, payload) == payload
        client.close()
        for _ in range(200):
            if run.log.totals()["allowed"]:
                break
            await asyncio.sleep(0.02)
        (decision,) = run.log.recent()
        assert (decision.host, decision.allowed, decision.sent, decision.received) == (
            "ok.test", True, len(payload), len(payload)
        )  # fmt: skip
        assert (run.proxy.handoffs, run.proxy.refused_handoffs) == (1, 0)
    assert not await leaked_fds(before)


def ask(client: socket.socket, request: bytes) -> bytes:
    """Send a request and read the answer to EOF (in a thread: the proxy shares the test's loop)."""
    client.settimeout(10)
    client.sendall(request)
    answer = b""
    while chunk := client.recv(4096):
        answer += chunk
    return answer


async def test_a_handed_over_client_gets_the_policys_refusal(upstream: Upstream) -> None:
    async with proxy_for(upstream) as run:
        client, accepted = tcp_pair()
        with client, accepted:
            assert await hand_over(run.path, [accepted.fileno()]) == host_side.TAKEN
            accepted.close()
            answer = await asyncio.to_thread(ask, client, b"CONNECT evil.test:443 HTTP/1.1\r\n\r\n")
    assert status_of(answer) == 403 and b"blocked by CodeRunner's network policy" in answer
    assert upstream.connects == 0


@contextlib.contextmanager
def bad_fds() -> Iterator[dict[str, int]]:
    """One of each fd a sandbox might send instead of its client's socket."""
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryFile())
        read_end, write_end = os.pipe()
        stack.callback(os.close, read_end)
        stack.callback(os.close, write_end)
        unix_a, unix_b = socket.socketpair()
        listening = socket.create_server(("127.0.0.1", 0))
        unconnected = socket.socket()
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.connect(("127.0.0.1", 9))
        for sock in (unix_a, unix_b, listening, unconnected, udp):
            stack.enter_context(sock)
        yield {
            "a file": tmp.fileno(),
            "a pipe": read_end,
            "a unix socket": unix_a.fileno(),
            "a listening socket": listening.fileno(),
            "an unconnected socket": unconnected.fileno(),
            "a UDP socket": udp.fileno(),
        }


async def test_every_fd_but_a_connected_tcp_socket_is_refused_and_closed(upstream: Upstream) -> None:
    good = CONNECT % upstream.port + b"x"
    with bad_fds() as fds:
        async with proxy_for(upstream) as run:
            assert status_of(await exchange(run.path, good)) == 200  # serving: its own fds are open
            before = open_fds()
            for kind, fd in fds.items():
                assert await hand_over(run.path, [fd]) == b"", kind
                assert status_of(await exchange(run.path, good)) == 200, f"the proxy stopped serving after {kind}"
            assert run.proxy.refused_handoffs == len(fds) and run.proxy.handoffs == 0
            assert not await leaked_fds(before), "the proxy kept an fd it refused"
        # Each is still the sender's, unharmed (the host only closed its own copy).
        os.fstat(fds["a file"])


async def test_several_fds_in_one_message_are_all_refused_and_none_kept(upstream: Upstream) -> None:
    client, accepted = tcp_pair()
    with client, accepted:
        async with proxy_for(upstream) as run:
            assert status_of(await exchange(run.path, CONNECT % upstream.port + b"x")) == 200
            before = open_fds()
            for count in (2, 64, 250):  # 250: about the kernel's most per message (SCM_MAX_FD, 253)
                assert await hand_over(run.path, [accepted.fileno()] * count) == b"", count
            assert run.proxy.refused_handoffs == 3 and run.proxy.handoffs == 0
            assert not await leaked_fds(before)
            # The good socket was never taken: handed over alone, it is served.
            assert await hand_over(run.path, [accepted.fileno()]) == host_side.TAKEN
            accepted.close()
            assert await tunnel_through(client, upstream.port, b"ping") == b"ping"


async def test_garbage_without_fds_is_refused_and_the_proxy_keeps_serving(upstream: Upstream) -> None:
    good = CONNECT % upstream.port + b"x"
    async with proxy_for(upstream) as run:
        # The handoff byte with no fd: NO_FD (what tells a forwarder behind a byte relay to relay).
        assert await hand_over(run.path, []) == host_side.NO_FD
        for junk in (host_side.TAKEN + b"junk", b"\x00\x00\x00", os.urandom(4096), b"\xff" * 100):
            answer = await exchange(run.path, junk)
            assert status_of(answer) in (0, 400), (junk[:20], answer[:100])
        # An fd riding on request bytes instead of the handoff byte is closed, never used: the
        # connection is served as the plain client it says it is.
        client, accepted = tcp_pair()
        with client, accepted:
            answer = await asyncio.to_thread(fd_on_request_bytes, run.path, accepted.fileno(), upstream.port)
            assert status_of(answer) == 200, answer[:200]
            accepted.close()
            client.settimeout(10)
            assert await asyncio.to_thread(client.recv, 100) == b"", "the host kept the fd"
        assert status_of(await exchange(run.path, good)) == 200
    assert upstream.connects == 2


def fd_on_request_bytes(path: str, fd: int, port: int) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendmsg([b"G"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        conn.sendall(b"ET http://ok.test:%d/ HTTP/1.1\r\nHost: ok.test\r\n\r\n" % port)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    return answer


async def test_a_flood_of_handoffs_is_bounded_and_a_bystander_is_untouched(upstream: Upstream) -> None:
    limits = ProxyLimits(head_timeout_s=600)  # only the cap and eviction bound the flood here
    good = CONNECT % upstream.port + b"x"
    pairs = [tcp_pair() for _ in range(150)]
    try:
        async with proxy_for(upstream, limits=limits) as run, proxy_for(upstream) as bystander:
            async with peak_connections(run.proxy) as peak:
                # Handed over, then silent: each holds a slot until a newer client evicts it.
                answers = await asyncio.gather(*(hand_over(run.path, [accepted.fileno()]) for _, accepted in pairs))
                assert set(answers) <= {host_side.TAKEN, b""} and host_side.TAKEN in answers
                junk = await asyncio.gather(*(hand_over(run.path, [pairs[0][1].fileno()] * 3) for _ in range(100)))
                assert set(junk) == {b""}
                assert status_of(await exchange(bystander.path, good)) == 200
                await asyncio.sleep(1.2)  # the silent ones are now old enough to be evicted
                assert status_of(await exchange(run.path, good)) == 200
            assert peak[0] <= limits.max_connections
    finally:
        for client, accepted in pairs:
            client.close()
            accepted.close()


# --- the forwarder itself ----------------------------------------------------------------------


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def forwarder(socket_path: str) -> Iterator[int]:
    """The real forwarder on a free loopback port in front of `socket_path`; its detached server
    process (found by the unique socket path in its argv) is killed on the way out."""
    port = free_port()
    argv = [sys.executable, "-I", "-S", str(FORWARDER), socket_path, str(port), "--", "/bin/sleep", "600"]
    program = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        for _ in range(500):  # it execs the program once its port listens and its server runs
            if Path(f"/proc/{program.pid}/cmdline").read_bytes().startswith(b"/bin/sleep"):
                break
            time.sleep(0.02)
        yield port
    finally:
        program.kill()
        program.wait(10)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if socket_path.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)


@contextlib.asynccontextmanager
async def byte_relay(target: str) -> AsyncIterator[str]:
    """A unix socket that carries bytes to `target` but no fds (as a VM's socket relay does)."""
    tmp = tempfile.mkdtemp(prefix="relay-", dir="/tmp")
    path = str(Path(tmp) / "relay.sock")

    server = await asyncio.start_unix_server(piping_to(target), path)
    try:
        yield path
    finally:
        server.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.rmdir(tmp)


def fetch(port: int, up_port: int) -> bytes:
    """An absolute-form GET through the forwarder, as urllib sends it; the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(b"GET http://ok.test:%d/p HTTP/1.1\r\nHost: ok.test\r\n\r\n" % up_port)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


async def test_the_forwarder_hands_connections_over(upstream: Upstream) -> None:
    async with proxy_for(upstream) as run:
        with forwarder(run.path) as port:
            for _ in range(3):
                answer = await asyncio.to_thread(fetch, port, upstream.port)
                assert status_of(answer) == 200, answer[:200]
        assert run.proxy.handoffs == 3 and run.proxy.refused_handoffs == 0


async def test_where_fds_cannot_cross_the_forwarder_relays_bytes_instead(upstream: Upstream) -> None:
    async with proxy_for(upstream) as run, byte_relay(run.path) as relayed:
        with forwarder(relayed) as port:
            for _ in range(3):
                answer = await asyncio.to_thread(fetch, port, upstream.port)
                assert status_of(answer) == 200, answer[:200]
                denied = await asyncio.to_thread(fetch, port, upstream.port + 1)
                assert status_of(denied) == 403, denied[:200]
        # One handoff tried (its byte arrived without the fd), then bytes only: detected once.
        assert run.proxy.handoffs == 0 and run.proxy.refused_handoffs == 1
    assert upstream.connects == 3


def serving_process(socket_path: str) -> int:
    """The forwarder's detached server: the process whose argv names `socket_path`, other than the program."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            if socket_path.encode() in argv and not argv.startswith(b"/bin/sleep"):
                return int(pid)
    raise AssertionError("the forwarder's server is not running")


async def test_the_forwarder_out_of_fds_refuses_a_connection_and_serves_once_it_has_them(upstream: Upstream) -> None:
    """With room for an accepted connection but not for its handoff's socket, the connection is closed (fail
    closed), accepting pauses and the forwarder lives on; given fds again, it serves. (Before, the handoff's
    socket failing ended the forwarder, and the sandbox's network with it.)"""
    async with proxy_for(upstream) as run:
        with forwarder(run.path) as port:
            server = serving_process(run.path)
            held = len(os.listdir(f"/proc/{server}/fd"))
            limit = f"--nofile={held + 1}:"  # (soft only) fds 0..held: one accepted client, no socket to the host
            subprocess.run(["prlimit", f"--pid={server}", limit], check=True, timeout=10)
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                    sock.sendall(b"GET http://ok.test:%d/p HTTP/1.1\r\nHost: ok.test\r\n\r\n" % upstream.port)
                    try:
                        answer = sock.recv(65536)
                    except ConnectionResetError:  # closed with the request unread
                        answer = b""
                    assert answer == b"", answer  # closed, nothing sent on
                await asyncio.sleep(0.15)  # past the accept pause
            assert Path(f"/proc/{server}").exists(), "the forwarder ended when it ran out of fds"
            subprocess.run(["prlimit", f"--pid={server}", "--nofile=256:"], check=True, timeout=10)
            answer = await asyncio.to_thread(fetch, port, upstream.port)
            assert status_of(answer) == 200, answer[:200]
        assert run.proxy.handoffs == 1


def test_the_forwarder_speaks_the_hosts_handoff_bytes() -> None:
    """The forwarder is stdlib-only (it runs inside the sandbox), so it spells the bytes itself."""
    spec = importlib.util.spec_from_file_location("egress_forwarder_under_test", FORWARDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (module.HANDOFF, module.TAKEN, module.NO_FD) == (host_side.HANDOFF, host_side.TAKEN, host_side.NO_FD)


async def test_a_relay_in_worker_threads_ends_when_idle_even_if_the_sandbox_makes_it_blocking(
    upstream: Upstream,
) -> None:
    """The sandbox keeps a copy of the socket it handed over and flips it to blocking (the file's
    flags are shared): the relay's workers still end at the idle bound and give their threads back."""
    free_before = relay.slots.free
    async with proxy_for(upstream, limits=ProxyLimits(idle_s=0.5)) as run:
        client, accepted = tcp_pair()
        with client, accepted:
            assert await hand_over(run.path, [accepted.fileno()]) == host_side.TAKEN
            payload = os.urandom(2 * relay.ON_LOOP_BYTES)  # both directions go on in worker threads
            loop = asyncio.get_running_loop()
            client.setblocking(False)
            await loop.sock_sendall(client, CONNECT % upstream.port)
            await loop.sock_sendall(client, payload)
            echoed = bytearray()
            while len(echoed) < len(payload) + len(b"HTTP/1.1 200 Connection established\r\n\r\n"):
                chunk = await asyncio.wait_for(loop.sock_recv(client, 1 << 16), 10)
                assert chunk
                echoed += chunk
            assert relay.slots.free < free_before, "the relay never went to worker threads"
            accepted.setblocking(True)  # the sandbox's move; the host's calls must not depend on it
            # Silence both ways: the proxy ends the tunnel (the client sees EOF) and the workers end.
            assert await asyncio.wait_for(loop.sock_recv(client, 1), 10) == b""
            for _ in range(200):
                if relay.slots.free == free_before:
                    break
                await asyncio.sleep(0.05)
            assert relay.slots.free == free_before
        (decision,) = run.log.recent()
        assert decision.sent == decision.received == len(payload)
