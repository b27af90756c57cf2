"""The in-sandbox end of network 'allowlist': 127.0.0.1:PORT relayed to the host's policy proxy.

    python -I -S .../coderunner_guest/egress_forwarder.py SOCKET PORT -- PROGRAM ARGS...

Binds 127.0.0.1:PORT first (so the program never starts before the proxy port exists), leaves a
detached child relaying each connection to the unix socket SOCKET (the host's proxy, bound
read-only into the sandbox), then execs PROGRAM in its own place: the program keeps the pid,
stdin, stdout and stderr the sandbox gave it. The sandbox has no other network, so if code kills
this relay the network just stops. Stdlib only; one thread; bounded connections and buffers.
"""

import asyncio
import os
import socket
import sys

#: Client connections relayed at once; more are closed at once (the host's proxy has its own cap).
MAX_CONNECTIONS = 256
#: Bytes read per chunk; a relay holds at most about two of these per direction (drain backpressure).
CHUNK = 64 * 1024
#: A connection with no bytes either way for this long is closed (the proxy's own idle bound is shorter).
IDLE_S = 300.0
#: Bound on connecting to the host's socket.
CONNECT_S = 10.0


def _listen(port):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    listener.setblocking(False)
    return listener


async def _pump(reader, writer, activity):
    """Copy one direction until EOF, then pass the EOF on (half-close), never buffering without bound."""
    try:
        while True:
            data = await asyncio.wait_for(reader.read(CHUNK), IDLE_S)
            if not data:
                break
            activity[0] = True
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, asyncio.TimeoutError, ConnectionError):
        writer.transport.abort()


class _Relay:
    def __init__(self, socket_path):
        self.socket_path = socket_path
        self.active = 0

    async def handle(self, client_reader, client_writer):
        if self.active >= MAX_CONNECTIONS:
            client_writer.transport.abort()
            return
        self.active += 1
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(self.socket_path, limit=CHUNK), CONNECT_S
                )
            except (OSError, asyncio.TimeoutError):
                client_writer.transport.abort()  # no proxy, no network: fail closed
                return
            activity = [False]
            try:
                await asyncio.gather(
                    _pump(client_reader, upstream_writer, activity),
                    _pump(upstream_reader, client_writer, activity),
                )
            finally:
                upstream_writer.transport.abort()
        finally:
            self.active -= 1
            client_writer.transport.abort()


async def _serve(listener, socket_path):
    relay = _Relay(socket_path)
    server = await asyncio.start_server(relay.handle, sock=listener, limit=CHUNK)
    async with server:
        await server.serve_forever()


def _detach_and_serve(listener, socket_path):
    """In a grandchild (reparented to the sandbox's init, so nothing waits on it): serve forever."""
    if os.fork() != 0:
        os._exit(0)
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # never hold the program's pipes open
        asyncio.run(_serve(listener, socket_path))
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
