"""The in-sandbox end of network 'allowlist': 127.0.0.1:PORT relayed to the host's policy proxy.

    python -I -S .../coderunner_guest/egress_forwarder.py SOCKET PORT -- PROGRAM ARGS...

Binds 127.0.0.1:PORT first (so the program never starts before the proxy port exists), leaves a
detached child serving it, then execs PROGRAM in its own place: the program keeps the pid, stdin,
stdout and stderr the sandbox gave it. The sandbox has no other network, so if code kills this
child the network just stops. Stdlib only; one thread; bounded connections and buffers; no asyncio
unless it must relay (its import alone cost about 60 ms of CPU in every 'allowlist' sandbox).

Each accepted connection is handed to the host's proxy (the unix socket SOCKET, bound read-only into
the sandbox) whole: its socket goes over SCM_RIGHTS on one HANDOFF byte, the host answers TAKEN, and
this process closes its copy; the host then talks to the client itself, so no byte of it passes
through here. Where the fd cannot cross (gVisor's netstack sockets, a VM's relayed socket) the
sendmsg fails or the host answers NO_FD: from then on every connection is relayed byte by byte over
its own unix connection, as the proxy also serves plain clients (egress/handoff.py on the host).
"""

import array
import contextlib
import os
import selectors
import socket
import sys
import time

#: Client connections relayed at once; more are closed at once (the host's proxy has its own cap).
MAX_CONNECTIONS = 256
#: How long accepting pauses after accept failed for want of fds (or a handoff's socket could not be made).
ACCEPT_PAUSE_S = 0.1
#: Bytes read per chunk; a relay holds at most about two of these per direction (drain backpressure).
CHUNK = 64 * 1024
#: A connection with no bytes either way for this long is closed (the proxy's own idle bound is shorter).
IDLE_S = 300.0
#: Bound on connecting to the host's socket, and on its answer to a handoff.
CONNECT_S = 10.0
#: The handoff's byte and the host's answers (egress/handoff.py: HANDOFF, TAKEN, NO_FD).
HANDOFF, TAKEN, NO_FD = b"\x00", b"\x01", b"\x02"


def _listen(port):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    listener.setblocking(False)
    return listener


async def _pump(aio, reader, writer, activity):
    """Copy one direction until EOF, then pass the EOF on (half-close), never buffering without bound."""
    try:
        while True:
            data = await aio.wait_for(reader.read(CHUNK), IDLE_S)
            if not data:
                break
            activity[0] = True
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, aio.TimeoutError, ConnectionError):
        writer.transport.abort()


def _accepted(listener):
    """The connections waiting, a bounded batch per wake. accept's other errors (out of fds, say) reach the
    caller, which pauses accepting for ACCEPT_PAUSE_S rather than spin."""
    for _ in range(MAX_CONNECTIONS):
        try:
            client, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        yield client


class _Handoffs:
    """Hands each accepted connection to the host: a selector and a deadline per answer, no asyncio (whose
    import alone cost about 60 ms of CPU in every 'allowlist' sandbox). `run` returns once fds proved not
    to cross (gVisor's netstack sockets, a VM's relayed socket), with the connections left to relay.

    Accept, connect and sendmsg happen in the one wake the connection causes, which is most of what
    opening a connection costs here.
    """

    def __init__(self, listener, socket_path):
        self.listener = listener
        self.socket_path = socket_path
        self.selector = selectors.DefaultSelector()
        #: Each handoff waiting for the host's answer: its host socket -> (deadline, client).
        self.waiting = {}
        #: None until the first handoff says whether fds cross to the host; then True or False.
        self.handoff = None
        self.to_relay = []
        self.paused_until = None

    def run(self):
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept_ready)
        while self.handoff is not False or self.waiting:
            now = time.monotonic()
            deadlines = [deadline for deadline, _ in self.waiting.values()]
            if self.paused_until is not None:
                deadlines.append(self.paused_until)
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            for key, _ in self.selector.select(timeout):
                key.data(key.fileobj)
            now = time.monotonic()
            for host, (deadline, _) in list(self.waiting.items()):
                if deadline <= now:
                    self._answered(host, timed_out=True)  # no answer in time: fail closed
            if self.paused_until is not None and self.paused_until <= now:
                self.paused_until = None
                if self.handoff is not False:  # else the relay accepts what queued meanwhile
                    self.selector.register(self.listener, selectors.EVENT_READ, self._accept_ready)
        return self.to_relay

    def _active(self):
        return len(self.waiting) + len(self.to_relay)

    def _accept_ready(self, listener):
        try:
            for client in _accepted(listener):
                if self._active() >= MAX_CONNECTIONS:
                    client.close()
                elif self.handoff is False:
                    self.to_relay.append(client)
                else:
                    self._hand_over(client)
        except OSError:  # out of fds, say: pause accepting a little, never spin
            if self.handoff is not False:  # else the relay accepts what queues
                self._stop_accepting()
                self.paused_until = time.monotonic() + ACCEPT_PAUSE_S

    def _stop_accepting(self):
        if self.paused_until is None:  # else unregistered already
            self.selector.unregister(self.listener)

    def _hand_over(self, client):
        try:
            host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            client.close()  # out of fds: fail closed, and accepting pauses
            raise
        host.setblocking(False)
        try:
            host.connect(self.socket_path)
            host.sendmsg([HANDOFF], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [client.fileno()]))])
        except (BlockingIOError, InterruptedError, FileNotFoundError, ConnectionRefusedError):
            host.close()
            client.close()  # the proxy is gone or flooded: fail closed
            return
        except OSError:
            host.close()
            self._relay_from_now(client)  # this kernel (gVisor's netstack) does not pass the socket
            return
        self.waiting[host] = (time.monotonic() + CONNECT_S, client)
        self.selector.register(host, selectors.EVENT_READ, self._answered)

    def _answered(self, host, timed_out=False):
        self.selector.unregister(host)
        _, client = self.waiting.pop(host)
        answer = b""
        if not timed_out:
            with contextlib.suppress(OSError):
                answer = host.recv(1)
        host.close()
        if answer == TAKEN:
            self.handoff = True
            client.close()  # the host has it; our copy goes
        elif answer == NO_FD:
            self._relay_from_now(client)  # the fd was lost on the way (a relayed socket)
        else:
            client.close()  # refused: fail closed

    def _relay_from_now(self, client):
        """Every connection is relayed from now on: stop accepting here (the relay accepts what queues)."""
        if self.handoff is not False:
            self._stop_accepting()
        self.handoff = False
        self.to_relay.append(client)


class _Relay:
    """Relays each connection byte by byte over its own unix connection to the host (asyncio's, imported
    only once fds proved not to cross), bounded as the handoffs are."""

    def __init__(self, aio, loop, listener, socket_path, active):
        self.aio = aio
        self.loop = loop
        self.listener = listener
        self.socket_path = socket_path
        self.active = active
        self.tasks = set()

    def start(self):
        self.loop.add_reader(self.listener.fileno(), self._accept_ready)

    def _accept_ready(self):
        try:
            for client in _accepted(self.listener):
                if self.active >= MAX_CONNECTIONS:
                    client.close()
                    continue
                self.active += 1
                self.relay_later(client)
        except OSError:  # out of fds, say: pause accepting a little, never spin
            self.loop.remove_reader(self.listener.fileno())
            self.loop.call_later(ACCEPT_PAUSE_S, self.start)

    def relay_later(self, client):
        task = self.loop.create_task(self._relay(client))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _relay(self, client):
        try:
            aio = self.aio
            client.setblocking(False)
            client_reader, client_writer = await aio.open_connection(sock=client, limit=CHUNK)
            try:
                upstream_reader, upstream_writer = await aio.wait_for(
                    aio.open_unix_connection(self.socket_path, limit=CHUNK), CONNECT_S
                )
            except (OSError, aio.TimeoutError):
                client_writer.transport.abort()  # no proxy, no network: fail closed
                return
            activity = [False]
            try:
                await aio.gather(
                    _pump(aio, client_reader, upstream_writer, activity),
                    _pump(aio, upstream_reader, client_writer, activity),
                )
            finally:
                upstream_writer.transport.abort()
                client_writer.transport.abort()
        except OSError:
            pass
        finally:
            client.close()
            self.active -= 1


async def _relay_all(aio, listener, socket_path, clients):
    relay = _Relay(aio, aio.get_running_loop(), listener, socket_path, len(clients))
    for client in clients:
        relay.relay_later(client)
    relay.start()
    await relay.loop.create_future()  # forever


def _detach_and_serve(listener, socket_path):
    """In a grandchild (reparented to the sandbox's init, so nothing waits on it): serve forever."""
    if os.fork() != 0:
        os._exit(0)
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # never hold the program's pipes open
        to_relay = _Handoffs(listener, socket_path).run()
        import asyncio  # only where fds cannot cross: a relay needs it, a handoff does not

        asyncio.run(_relay_all(asyncio, listener, socket_path, to_relay))
    finally:
        os._exit(0)


def main(argv):
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: egress_forwarder SOCKET PORT -- PROGRAM ARGS...")
    socket_path, port, program = argv[0], int(argv[1]), argv[3:]
    try:
        listener = _listen(port)
    except OSError as exc:
        # Without the relay there is no network at all, which is the safe way to fail.
        print(f"coderunner: the network relay could not start ({exc}); this sandbox has no network", file=sys.stderr)
        listener = None
    if listener is not None:
        child = os.fork()
        if child == 0:
            _detach_and_serve(listener, socket_path)
        os.waitpid(child, 0)
        listener.close()
    os.execv(program[0], program)


if __name__ == "__main__":
    main(sys.argv[1:])
