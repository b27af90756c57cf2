"""The init of a checkpointable gVisor sandbox: relays the kernel's five channels from host-visible
unix sockets in the run dir to the kernel's own ipc sockets in the sandbox's /tmp.

    python -I -S channel_relay.py --run-dir RUN_DIR -- KERNEL_ARGV...

Why: runsc cannot save a sandbox that holds a host unix socket or an epoll-watched TCP socket. A
kernel bound in the run dir holds five host sockets; here the kernel binds ZMQ ipc sockets in a
private dir of /tmp (Sentry sockets, which gVisor saves) and only this process holds host sockets,
which it drops on demand:

    SIGUSR1  close every host listener and every relayed connection, both ends (the kernel's
             ROUTER sees its peer go, so it accepts the same identity again later)
    SIGUSR2  bind the host listeners again (after a checkpoint, or in a restored sandbox)

Each change is announced in RUN_DIR/relay-state, replaced atomically: "<open|closed|failed> <n>\\n".
n counts every announcement from 1: the first bind writes "open 1", then e.g. USR1 "closed 2",
USR2 "open 3". "failed <n>" means a bind failed (a path still there: the host has not claimed or
removed it); no listener is open then. gVisor refuses to unlink a host socket file from inside, so
this never unlinks one: the host claims (renames away) each socket right after it appears, and the
listener keeps working.

KERNEL_ARGV is the host's kernel command (`... -m coderunner_guest.kernel_boot -f FILE ...`, perhaps behind
a prlimit prefix). Its connection file is copied with transport "ipc" and ip /tmp/<private>/k, and a stock
ipykernel_launcher becomes coderunner_guest.kernel_boot (it keeps the kernel free of TCP sockets).
The host-visible names follow the original ip: RUN_DIR/<basename of ip>-<port>.

It is also init: it reaps every child, forwards SIGTERM/SIGINT/SIGHUP to the kernel and exits with
the kernel's status (128+signal if a signal ended it). Stdlib only, one thread, bounded.

One idea: the sandbox's relaying init, one self-contained script (run with -I -S, importing nothing of the
guest), so its socket pairing, bounds and shutdown read as one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import tempfile
from typing import Any

# This script runs with -I -S, so its folder is not on sys.path: load its init duties from there. Appended,
# so no module of the folder can stand in for one of the standard library's.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from relay_init import Init, become_subreaper, remove_private, spawn  # type: ignore[import-not-found]

#: The sandbox's copy of common.RELAY_STATE (this script runs with -I -S: no coderunner imports).
RELAY_STATE = "relay-state"
#: Most bytes of a connection file this reads (it is the host's, but bounded all the same).
CONNECTION_MAX_BYTES = 64 * 1024
#: Connections relayed at once per channel (the host opens one per channel).
MAX_CONNECTIONS = 16
#: Bytes read per chunk; drain() bounds what one direction holds in memory.
CHUNK = 64 * 1024
#: Bound on reaching the kernel's channel (it binds while it starts).
DIAL_S = 60.0
#: Signals queued for the relay's worker before further ones are dropped (with a line on stderr).
MAX_PENDING = 32
#: Environment variable telling kernel_boot where to bind IOPub's fork pipe (an ipc path).
PIPE_ENV = "CODERUNNER_IOPUB_PIPE"
CHANNELS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class RelayError(Exception):
    """A problem the relay cannot start with; its message is the line on stderr."""


def say(line: str) -> None:
    print(f"channel relay: {line}", file=sys.stderr, flush=True)


# --- the kernel's command ------------------------------------------------------------------------


def parse_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(run dir, kernel argv) from `--run-dir DIR -- KERNEL_ARGV...`."""
    if len(argv) < 4 or argv[0] != "--run-dir" or argv[2] != "--":
        raise RelayError("usage: channel_relay.py --run-dir RUN_DIR -- KERNEL_ARGV...")
    return argv[1], argv[3:]


def read_connection(path: str) -> dict[str, object]:
    """The host's connection file, bounded; only the fields the relay relies on are checked."""
    try:
        with open(path, "rb") as source:
            raw = source.read(CONNECTION_MAX_BYTES + 1)
    except OSError as error:
        raise RelayError(f"cannot read the connection file {path}: {error.strerror}") from None
    if len(raw) > CONNECTION_MAX_BYTES:
        raise RelayError(f"the connection file {path} is larger than {CONNECTION_MAX_BYTES} bytes")
    try:
        info = json.loads(raw)
    except ValueError as error:
        raise RelayError(f"the connection file {path} is not JSON: {error}") from None
    if not isinstance(info, dict):
        raise RelayError(f"the connection file {path} is not a JSON object")
    for name in CHANNELS:
        port = info.get(name)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise RelayError(f"the connection file {path} has no valid {name}")
    if len({info[name] for name in CHANNELS}) != len(CHANNELS):
        raise RelayError(f"the connection file {path} repeats a port")
    ip = info.get("ip")
    if info.get("transport") != "ipc" or not isinstance(ip, str) or not ip:
        raise RelayError(f"the connection file {path} is not for transport 'ipc'")
    prefix = os.path.basename(ip)
    if prefix in ("", ".", "..") or len(prefix) > 64:
        raise RelayError(f"the connection file {path} has an unusable ip {ip!r}")
    return info


class Plan:
    """What the relay needs from the kernel's command, and the command it runs instead."""

    def __init__(self, run_dir: str, argv: list[str]) -> None:
        try:
            at = argv.index("-f")
        except ValueError:
            raise RelayError("the kernel command has no '-f CONNECTION_FILE'") from None
        if at + 1 >= len(argv):
            raise RelayError("the kernel command ends at '-f'")
        info = read_connection(argv[at + 1])
        self.run_dir = run_dir
        self.prefix = os.path.basename(str(info["ip"]))
        self.ports = [int(info[name]) for name in CHANNELS]  # type: ignore[call-overload]  # JSON ints
        self.private = tempfile.mkdtemp(prefix="relay-", dir="/tmp")  # mode 0700
        self.inner = os.path.join(self.private, "k")
        private_file = os.path.join(self.private, "kernel.json")
        fd = os.open(private_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({**info, "transport": "ipc", "ip": self.inner}, out)
        self.argv = list(argv)
        self.argv[at + 1] = private_file
        if "ipykernel_launcher" in self.argv:
            self.argv[self.argv.index("ipykernel_launcher")] = "coderunner_guest.kernel_boot"
        elif "coderunner_guest.kernel_boot" not in self.argv:  # the host's own command names it already
            say("the kernel command has no 'ipykernel_launcher': starting it as given")
        self.env = {**os.environ, PIPE_ENV: os.path.join(self.private, "pipe")}

    def host_path(self, port: int) -> str:
        return os.path.join(self.run_dir, f"{self.prefix}-{port}")

    def inner_path(self, port: int) -> str:
        return f"{self.inner}-{port}"


# --- the relay -----------------------------------------------------------------------------------


class Side(asyncio.BufferedProtocol):
    """One end of a relayed connection: what it reads is written to the other end's transport.

    Why protocols, not streams: under gVisor's ptrace platform every syscall costs tens of µs. A
    stream's read(CHUNK) allocates (mmap, mremap, munmap for each message) and wakes a task on the
    next loop pass; here each read lands in one buffer kept for the connection and is written on
    at once: epoll_wait, recv_into, send. Flow control as drain() gave it: this end's full write
    buffer pauses reading at the other end."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.peer: Side | None = None
        self.buffer = memoryview(bytearray(CHUNK))
        self.eof = False
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.link.made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        data = bytes(self.buffer[:nbytes])  # a copy: the buffer is read into again
        peer = self.peer.transport if self.peer is not None else None
        if peer is None:
            self.link.early.append(data)  # the kernel's end is being dialled
        else:
            peer.write(data)

    def eof_received(self) -> bool:
        """Pass the EOF on; the connection ends once both directions have ended."""
        self.eof = True
        peer = self.peer
        if peer is not None and peer.transport is not None and peer.transport.can_write_eof():
            peer.transport.write_eof()
        if peer is None or peer.eof:
            self.link.close()
            return False
        return True

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.link.close()


class Link:
    """A host connection to one channel and its connection to the kernel's. Until the kernel's is
    made the host's is paused; what it sent before the pause took hold (one read at most) waits in
    `early`. The pause is a callback of its own: Python 3.11 starts reading after connection_made
    even when paused there."""

    def __init__(self, relay: Relay, port: int) -> None:
        self.relay = relay
        self.port = port
        self.host = Side(self)
        self.inner = Side(self)
        self.host.peer, self.inner.peer = self.inner, self.host
        self.dialing: asyncio.Task[None] | None = None
        self.early: list[bytes] = []
        self.counted = False
        self.closed = False

    def made(self, side: Side) -> None:
        if side is not self.host:
            return
        relay = self.relay
        if self.closed or not relay.servers or relay.per_port[self.port] >= MAX_CONNECTIONS:
            self.close()  # closed meanwhile, or too many
            return
        relay.links.add(self)
        relay.per_port[self.port] += 1
        self.counted = True
        loop = asyncio.get_running_loop()
        loop.call_soon(self.pause_host)
        self.dialing = loop.create_task(self.dial())

    def pause_host(self) -> None:
        if not self.closed and self.inner.transport is None and self.host.transport is not None:
            self.host.transport.pause_reading()

    async def dial(self) -> None:
        try:
            await self.relay.dial(self.port, lambda: self.inner)
        except (OSError, asyncio.TimeoutError):
            self.close()
            return
        if self.closed:
            if self.inner.transport is not None:
                self.inner.transport.abort()
        elif self.host.transport is not None and self.inner.transport is not None:
            for data in self.early:
                self.inner.transport.write(data)
            self.early.clear()
            if self.host.eof:  # it ended before the kernel's end was there: pass its EOF on now
                self.inner.transport.write_eof()
            else:
                self.host.transport.resume_reading()

    def sides(self) -> list[Side]:
        return [side for side in (self.host, self.inner) if side.transport is not None]

    def close(self, abort: bool = False) -> None:
        """End both connections (flushing what is written, unless `abort`); once."""
        if self.closed:
            return
        self.closed = True
        for side in self.sides():
            assert side.transport is not None
            side.transport.abort() if abort else side.transport.close()
        if self.dialing is not None and not self.dialing.done() and self.dialing is not asyncio.current_task():
            self.dialing.cancel()
        if self.counted:
            self.relay.per_port[self.port] -= 1
            self.relay.links.discard(self)


class Relay:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.servers: list[asyncio.AbstractServer] = []
        self.links: set[Link] = set()
        self.per_port: dict[int, int] = dict.fromkeys(plan.ports, 0)
        self.generation = 0

    def report(self, word: str) -> None:
        """Replace the state file atomically (a temp file in the run dir, then rename)."""
        self.generation += 1
        temporary = os.path.join(self.plan.run_dir, f".{RELAY_STATE}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as out:
                out.write(f"{word} {self.generation}\n")
            os.replace(temporary, os.path.join(self.plan.run_dir, RELAY_STATE))
        except OSError as error:
            say(f"cannot write {RELAY_STATE} ({word} {self.generation}): {error.strerror}")

    async def open(self) -> None:
        if not self.servers:
            path = ""
            try:
                for port in self.plan.ports:
                    path = self.plan.host_path(port)
                    self.servers.append(await self.listen(path, port))
            except OSError as error:
                self.drop_servers()
                say(f"cannot bind {path}: {error.strerror} (the host must claim or remove it first)")
                self.report("failed")
                return
        self.report("open")

    async def listen(self, path: str, port: int) -> asyncio.AbstractServer:
        """Bind by hand: asyncio's own bind would unlink a socket file already at the path."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(MAX_CONNECTIONS)
        except OSError:
            listener.close()
            raise
        extra: dict[str, Any] = {"cleanup_socket": False} if sys.version_info >= (3, 13) else {}
        loop = asyncio.get_running_loop()
        return await loop.create_unix_server(lambda: Link(self, port).host, sock=listener, **extra)

    def drop_servers(self) -> None:
        for server in self.servers:
            server.close()
        self.servers = []

    async def close(self, announce: bool = True) -> None:
        """Drop every listener and every relayed connection; "closed" only once their sockets are."""
        self.drop_servers()
        for _ in range(3):  # let connections accepted just before the close reach made(), which drops them
            await asyncio.sleep(0)
        lost = []
        for link in list(self.links):
            lost += [side.lost for side in link.sides()]
            link.close(abort=True)
        if lost:
            await asyncio.wait(lost, timeout=5)
        if announce:
            self.report("closed")

    async def dial(self, port: int, side: Any) -> None:
        """Connect `side` (a protocol factory) to the kernel's channel, retrying while it starts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DIAL_S
        while True:
            try:
                await asyncio.wait_for(loop.create_unix_connection(side, self.plan.inner_path(port)), 5)
                return
            except (OSError, asyncio.TimeoutError):
                if loop.time() > deadline:
                    say(f"the kernel's channel {self.plan.inner_path(port)} did not answer within {DIAL_S:.0f} s")
                    raise
                await asyncio.sleep(0.05)


async def serve(plan: Plan) -> int:
    loop = asyncio.get_running_loop()
    relay = Relay(plan)
    init = Init(loop)
    requests: asyncio.Queue[str] = asyncio.Queue(MAX_PENDING)

    def request(word: str) -> None:
        try:
            requests.put_nowait(word)
        except asyncio.QueueFull:
            say(f"too many pending signals: dropped {word}")

    async def worker() -> None:  # one change at a time, in the order the signals came
        while True:
            word = await requests.get()
            try:
                await (relay.close() if word == "close" else relay.open())
            except Exception as error:  # the relay must keep answering signals
                say(f"could not {word} the channels: {type(error).__name__}: {error}")

    loop.add_signal_handler(signal.SIGCHLD, init.reap)
    loop.add_signal_handler(signal.SIGUSR1, request, "close")
    loop.add_signal_handler(signal.SIGUSR2, request, "open")
    for signum in FORWARDED:
        loop.add_signal_handler(signum, init.forward, signum)
    try:
        kernel = spawn(plan.argv, plan.env)
    except OSError as error:
        raise RelayError(f"cannot start the kernel {plan.argv[0]}: {error.strerror}") from None
    init.started(kernel)
    request("open")
    working = loop.create_task(worker())
    try:
        return await init.ended
    finally:
        working.cancel()
        await relay.close(announce=False)


def main(argv: list[str]) -> int:
    for signum in (signal.SIGUSR1, signal.SIGUSR2):  # their default would end the sandbox: ignore until handled
        signal.signal(signum, signal.SIG_IGN)
    try:
        run_dir, kernel_argv = parse_argv(argv)
        plan = Plan(run_dir, kernel_argv)
    except RelayError as error:
        say(str(error))
        return 2
    become_subreaper()
    try:
        return asyncio.run(serve(plan))
    except RelayError as error:
        say(str(error))
        return 2
    finally:
        remove_private(plan.private)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
