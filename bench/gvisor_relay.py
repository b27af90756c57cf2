"""The in-sandbox end of a checkpointable kernel on gVisor: host-visible unix sockets relayed to
the kernel's ZMQ channels on TCP 127.0.0.1 (gVisor's own netstack).

    python -I -S channel_relay.py DIR PREFIX STATE INNER PORT... -- PROGRAM ARGS...

INNER says where the kernel's channels are: "tcp" (127.0.0.1:PORT) or an absolute path prefix
(the unix socket INNER-PORT, in a dir of the sandbox's own, e.g. its tmpfs).

Why: runsc cannot save a sandbox holding a host socket bound from inside (host-uds=create), and
a kernel bound on ipc paths in the run dir holds five. Here the kernel binds TCP on loopback,
which gVisor saves, and only this relay holds host sockets: DIR/PREFIX-PORT for each PORT
(jupyter's ipc naming, so the host connects with transport 'ipc', ip DIR/PREFIX). It can drop
every one of them on demand:

    SIGUSR1  close: every listener and every relayed connection, both ends
    SIGUSR2  open: bind the listeners again (after a checkpoint, or in a restored sandbox)

gVisor refuses to unlink a host socket file from inside (EPERM), so the host removes the closed
paths (unlinkat on its dir fd) before it asks for "open"; bind fails while a path is there.

and writes "<open|closed|failed> <generation>" to DIR/STATE (replaced atomically) once done, so the
host knows when the sandbox is quiet and can be checkpointed. This process is the sandbox's
init (runsc signals it by container id); it starts PROGRAM (the kernel) as its child and exits
with it. ZMQ on the host reconnects by itself when a path comes back. Stdlib only, one thread,
bounded connections and buffers.
"""

import asyncio
import os
import signal
import sys

#: Connections relayed at once per channel (the host opens one per channel).
MAX_CONNECTIONS = 16
#: Bytes read per chunk; drain() bounds what a direction holds.
CHUNK = 64 * 1024
#: Bound on reaching the kernel's channel (it binds it while it starts).
CONNECT_S = 60.0


class Relay:
    def __init__(self, directory, prefix, state, inner, ports):
        self.directory = directory
        self.prefix = prefix
        self.state = state
        self.inner = inner
        self.ports = ports
        self.servers = []
        self.links = {}  # task -> its writers, for each relayed connection
        self.generation = 0
        self.lock = asyncio.Lock()

    def path(self, port):
        return os.path.join(self.directory, f"{self.prefix}-{port}")

    def report(self, word):
        self.generation += 1
        temporary = os.path.join(self.directory, f".{self.state}.tmp")
        with open(temporary, "w") as out:
            out.write(f"{word} {self.generation}\n")
        os.replace(temporary, os.path.join(self.directory, self.state))

    async def open(self):
        async with self.lock:
            if not self.servers:
                try:
                    for port in self.ports:
                        path = self.path(port)
                        server = await asyncio.start_unix_server(lambda r, w, p=port: self.accept(r, w, p), path)
                        self.servers.append(server)
                except OSError as error:  # e.g. a path still there: the host has not removed it
                    for server in self.servers:
                        server.close()
                    self.servers = []
                    self.report("failed")
                    print(f"channel relay: cannot bind {path}: {error.strerror}", file=sys.stderr, flush=True)
                    return
            self.report("open")

    async def close(self):
        async with self.lock:
            for server in self.servers:
                server.close()
            for task, writers in list(self.links.items()):
                for writer in writers:
                    writer.close()
                task.cancel()
            if self.links:
                await asyncio.wait(list(self.links), timeout=5)
            for server in self.servers:
                await asyncio.wait_for(server.wait_closed(), 5)
            self.servers = []
            self.report("closed")

    async def accept(self, reader, writer, port):
        if len(self.links) >= MAX_CONNECTIONS * len(self.ports):
            writer.close()
            return
        task = asyncio.current_task()
        writers = self.links[task] = [writer]
        try:
            inner_reader, inner_writer = await self.dial(port)
            writers.append(inner_writer)
            await asyncio.gather(pump(reader, inner_writer), pump(inner_reader, writer))
        except (TimeoutError, OSError):
            pass
        finally:
            self.links.pop(task, None)
            for each in writers:
                each.close()

    async def dial(self, port):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_S
        while True:
            try:
                if self.inner == "tcp":
                    dialing = asyncio.open_connection("127.0.0.1", port)
                else:
                    dialing = asyncio.open_unix_connection(f"{self.inner}-{port}")
                return await asyncio.wait_for(dialing, 5)
            except OSError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.05)


async def pump(reader, writer):
    """Copy one direction until EOF, then pass the EOF on; drain() bounds the buffer."""
    while True:
        data = await reader.read(CHUNK)
        if not data:
            break
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def main(argv):
    split = argv.index("--")
    directory, prefix, state, inner, *ports = argv[:split]
    program = argv[split + 1 :]
    relay = Relay(directory, prefix, state, inner, [int(port) for port in ports])
    loop = asyncio.get_running_loop()
    jobs = set()

    def later(make):
        job = loop.create_task(make())
        jobs.add(job)
        job.add_done_callback(jobs.discard)

    loop.add_signal_handler(signal.SIGUSR1, later, relay.close)
    loop.add_signal_handler(signal.SIGUSR2, later, relay.open)
    kernel = await asyncio.create_subprocess_exec(*program, stdin=asyncio.subprocess.DEVNULL)
    loop.add_signal_handler(signal.SIGTERM, kernel.terminate)
    await relay.open()
    code = await kernel.wait()
    await relay.close()
    return code


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
