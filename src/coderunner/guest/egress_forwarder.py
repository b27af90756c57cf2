"""The in-sandbox end of network 'allowlist': 127.0.0.1:PORT relayed to the host's policy proxy.

    python -I -S .../coderunner_guest/egress_forwarder.py SOCKET PORT -- PROGRAM ARGS...

Binds 127.0.0.1:PORT first (so the program never starts before the proxy port exists), leaves a
detached child serving it, then execs PROGRAM in its own place: the program keeps the pid, stdin,
stdout and stderr the sandbox gave it. The sandbox has no other network, so if code kills this
child the network just stops. Stdlib only; one thread; bounded connections and buffers.

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
import socket
import sys

#: Client connections relayed at once; more are closed at once (the host's proxy has its own cap).
MAX_CONNECTIONS = 256
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


class _Forwarder:
    """Hands each accepted connection to the host, or relays it where fds cannot cross.

    The handoff runs in loop callbacks, not tasks: accept, connect and sendmsg happen in the one wake
    the connection causes, which is most of what opening a connection costs here.
    """

    def __init__(self, aio, loop, listener, socket_path):
        self.aio = aio
        self.loop = loop
        self.listener = listener
        self.socket_path = socket_path
        self.active = 0
        #: None until the first handoff says whether fds cross to the host; then True or False.
        self.handoff = None
        self.tasks = set()

    def start(self):
        self.loop.add_reader(self.listener.fileno(), self._accept_ready)

    def _accept_ready(self):
        for _ in range(MAX_CONNECTIONS):  # a bounded batch per wake
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of fds, say: pause accepting a little, never spin
                self.loop.remove_reader(self.listener.fileno())
                self.loop.call_later(0.1, self.start)
                return
            if self.active >= MAX_CONNECTIONS:
                client.close()
                continue
            self.active += 1
            if self.handoff is False:
                self._relay_later(client)
            else:
                self._hand_over(client)

    def _hand_over(self, client):
        host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        host.setblocking(False)
        try:
            host.connect(self.socket_path)
            host.sendmsg([HANDOFF], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [client.fileno()]))])
        except (BlockingIOError, InterruptedError, FileNotFoundError, ConnectionRefusedError):
            host.close()
            self._finish(client)  # the proxy is gone or flooded: fail closed
            return
        except OSError:
            host.close()
            self.handoff = False  # this kernel (gVisor's netstack) does not pass the socket: relay
            self._relay_later(client)
            return
        timer = self.loop.call_later(CONNECT_S, self._answered, host, client, None)
        self.loop.add_reader(host.fileno(), self._answered, host, client, timer)

    def _answered(self, host, client, timer):
        self.loop.remove_reader(host.fileno())
        answer = b""
        if timer is not None:  # else the answer timed out
            timer.cancel()
            with contextlib.suppress(OSError):
                answer = host.recv(1)
        host.close()
        if answer == TAKEN:
            self.handoff = True
            self._finish(client)  # the host has it; our copy goes
        elif answer == NO_FD:
            self.handoff = False  # the fd was lost on the way (a relayed socket): relay from now on
            self._relay_later(client)
        else:
            self._finish(client)  # refused: fail closed

    def _finish(self, client):
        client.close()
        self.active -= 1

    def _relay_later(self, client):
        task = self.loop.create_task(self._relay(client))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _relay(self, client):
        try:
            client.setblocking(False)
            aio = self.aio
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
            self._finish(client)


async def _serve(aio, listener, socket_path):
    loop = aio.get_running_loop()
    _Forwarder(aio, loop, listener, socket_path).start()
    await loop.create_future()  # forever


def _detach_and_serve(listener, socket_path):
    """In a grandchild (reparented to the sandbox's init, so nothing waits on it): serve forever.

    asyncio is imported here, by the serving process alone, and handed down (`aio`): its import costs about
    60 ms of CPU on this kind of machine, which the program this process execs (the kernel of every
    'allowlist' sandbox) waited for before it could start."""
    if os.fork() != 0:
        os._exit(0)
    try:
        import asyncio

        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # never hold the program's pipes open
        asyncio.run(_serve(asyncio, listener, socket_path))
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
