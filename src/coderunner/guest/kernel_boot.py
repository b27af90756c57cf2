"""`python -m coderunner_guest.kernel_boot ARGS`: ipykernel's launcher, without the shell channel
thread and its IOPub event pipe, and (under the gVisor channel relay) with IOPub's fork pipe on ipc.

Every sandbox's kernel starts through it (kernel/process.py), whatever the backend: each change
below takes a thread hop off a call's path, and on a loaded machine every hop is a wait for a time
slice (bench/wakeups.py: on bwrap the kernel's run-queue wait per warm `1+1` fell from 23-31 ms to
about 18 ms beside six CPU burners on two cores, its CPU from 4.3-4.7 ms to 3.7-3.9 ms).

ipykernel's IOPubThread binds a PULL socket on tcp://127.0.0.1:<random> that forked children
(os.fork, multiprocessing's fork) push their output to. gVisor (this runsc) cannot save a sandbox
with an epoll-watched TCP socket, so under the channel relay the pipe binds an ipc socket at the
path the relay gives in CODERUNNER_IOPUB_PIPE (in its private /tmp dir) instead: forked output
still reaches iopub and the kernel holds no TCP socket. Without that variable (no relay: nothing
is checkpointed) the stock pipe is kept; with an ipykernel whose private methods are not the ones
this was written against (7.4.0), it is kept too and a warning goes to stderr.

ipykernel 7 reads the shell channel on a thread of its own and hands each message to the main
thread (and the reply back) over inproc ZMQ sockets, for kernel subshells, which the host never
asks for. Under gVisor's ptrace platform each syscall costs tens of µs and that hop about 60 of
them per `1+1` (of about 400, counted with runsc --strace). Here the main thread reads the shell
channel itself, as in ipykernel 6 (the path ipykernel 7 keeps for a kernel without the thread).
And the IOPub thread is handed its work (each message published) by its event loop's own
thread-safe callback, not by a ZMQ inproc "event pipe" whose every wake-up its ZMQStream follows
with a dozen socket polls.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from typing import Any

#: Set by channel_relay.py: the ipc path prefix for IOPub's fork pipe.
PIPE_ENV = "CODERUNNER_IOPUB_PIPE"
#: ipykernel major versions whose IOPubThread has the pipe methods overridden here.
KNOWN_MAJORS = ("7",)


def warn(line: str) -> None:
    print(f"coderunner kernel_boot: {line}", file=sys.stderr, flush=True)


def install_ipc_pipe(prefix: str) -> bool:
    """Bind IOPub's fork pipe at ipc://PREFIX-<random> rather than on TCP; False if not applied."""
    import ipykernel
    import zmq
    from ipykernel import iostream
    from zmq.eventloop.zmqstream import ZMQStream

    thread = iostream.IOPubThread
    major = str(ipykernel.__version__).split(".")[0]
    if major not in KNOWN_MAJORS or not all(
        callable(getattr(thread, name, None)) for name in ("_setup_pipe_in", "_setup_pipe_out", "_handle_pipe_msg")
    ):
        warn(
            f"ipykernel {ipykernel.__version__} is not one this was written for: IOPub's fork pipe stays on "
            "TCP (a gVisor checkpoint of this kernel will fail)"
        )
        return False

    def setup_pipe_in(self: Any) -> None:
        self._pipe_uuid = os.urandom(16)  # authenticates the children's messages, as stock does
        pipe_in = self.socket.context.socket(zmq.PULL)
        pipe_in.linger = 0
        self._coderunner_pipe = f"ipc://{prefix}-{uuid.uuid4().hex[:8]}"
        try:
            pipe_in.bind(self._coderunner_pipe)
        except zmq.ZMQError as error:
            warn(f"cannot bind IOPub's fork pipe at {self._coderunner_pipe}: {error}; forked output is lost")
            self._pipe_flag = False
            pipe_in.close()
            return
        self._pipe_in = ZMQStream(pipe_in, self.io_loop)
        self._pipe_in.on_recv(self._handle_pipe_msg)

    def setup_pipe_out(self: Any) -> tuple[Any, Any]:
        ctx = zmq.Context()  # a new context after the fork, as stock does
        pipe_out = ctx.socket(zmq.PUSH)
        pipe_out.linger = 3000
        pipe_out.connect(self._coderunner_pipe)
        return ctx, pipe_out

    thread._setup_pipe_in = setup_pipe_in
    thread._setup_pipe_out = setup_pipe_out
    return True


class NoShellChannelThread:
    """Stands for ipykernel's shell channel thread, never started: falsy, so ipykernel takes its
    path without one; `parent_thread` answers the one question asked of it regardless (an async
    cell's SIGINT handling: is this the main thread?)."""

    parent_thread = threading.main_thread()

    def __bool__(self) -> bool:
        return False

    def is_alive(self) -> bool:
        return False


def drop_shell_channel_thread() -> bool:
    """The main thread reads the shell channel (no subshells); False (stock kept) for an ipykernel
    whose structure is not the one this was written against (7.4)."""
    from ipykernel import kernelapp, kernelbase

    app, kernel = kernelapp.IPKernelApp, kernelbase.Kernel
    if not (
        callable(getattr(app, "init_sockets", None))
        and "shell_channel_thread" in app.class_trait_names()
        and isinstance(getattr(kernel, "_supports_kernel_subshells", None), property)
    ):
        warn("this ipykernel has no shell channel thread this knows how to drop: kept")
        return False
    stock = app.init_sockets

    def init_sockets(self: Any, *args: Any, **kwargs: Any) -> Any:
        done = stock(self, *args, **kwargs)
        self.shell_channel_thread = NoShellChannelThread()
        return done

    app.init_sockets = init_sockets
    kernel._supports_kernel_subshells = property(lambda self: bool(self.shell_channel_thread))
    if callable(getattr(kernelapp, "ShellChannelThread", None)):
        # Not even built: its event loop (an epoll fd and a socket pair, which no one would close) and its lock
        # were a fork's first use of each. init_sockets above stays the guarantee where this name is not used.
        kernelapp.ShellChannelThread = lambda *args, **kwargs: NoShellChannelThread()
    return True


def schedule_by_callback() -> bool:
    """IOPubThread.schedule through io_loop.add_callback (call_soon_threadsafe: one write to the
    loop's self-pipe); False (stock kept) for an ipykernel whose IOPubThread is not as in 7.4."""
    from ipykernel import iostream

    thread = iostream.IOPubThread
    if not all(callable(getattr(thread, name, None)) for name in ("schedule", "_handle_event", "_really_send")):
        warn("this ipykernel's IOPub thread is not one this was written for: its event pipe is kept")
        return False

    def schedule(self: Any, f: Any) -> None:
        if self.thread.is_alive():
            try:
                self.io_loop.add_callback(f)
                return
            except RuntimeError:  # its loop closed meanwhile (shutdown): as stock with the thread gone
                pass
        f()

    thread.schedule = schedule
    return True


def main() -> None:
    prefix = os.environ.get(PIPE_ENV)
    if prefix:  # set by the channel relay only: elsewhere the stock TCP pipe is the right one
        install_ipc_pipe(prefix)
    if sys.path and sys.path[0] in ("", os.getcwd()):  # as ipykernel_launcher; the kernel adds it back
        del sys.path[0]
    drop_shell_channel_thread()
    schedule_by_callback()
    from ipykernel import kernelapp

    from .kernel_ahead import install

    install(kernelapp.IPKernelApp.instance(), sys.argv[1:])  # a kernel template's fork: what it did ahead
    kernelapp.launch_new_instance()


if __name__ == "__main__":
    main()
