"""Keep each IOPub stream message small, however much one write() carries.

ipykernel sends whatever a stream buffered since its last flush as one message, so
`print("x" * 10**8)` becomes a single 100 MB message. The host refuses messages over its
size limit, so an honest program would lose its output; split large writes instead. Many small
writes add up the same way when ipykernel's timed flush (every 0.2 s, on its IO thread) falls
behind on a busy machine, so a stream is also flushed after every FLUSH_CHARS written.
"""

import functools
import sys

#: Characters per message at most.
CHUNK_CHARS = 256 * 1024
#: Characters written between two flushes at most, whatever the sizes of the writes (at most 4 MiB).
FLUSH_CHARS = 1 << 20


def _chunked(stream):
    write = stream.write

    unflushed = [0]  # characters written since this wrapper last flushed

    @functools.wraps(write)
    def chunked_write(text):
        if not isinstance(text, str) or len(text) <= CHUNK_CHARS:
            written = write(text)
            unflushed[0] += len(text) if isinstance(text, str) else 0
            if unflushed[0] >= FLUSH_CHARS:
                unflushed[0] = 0
                stream.flush()
            return written
        for start in range(0, len(text), CHUNK_CHARS):
            write(text[start : start + CHUNK_CHARS])
            stream.flush()
        unflushed[0] = 0
        return len(text)

    chunked_write.coderunner_chunked = True  # type: ignore[attr-defined]  # the mark of a patched stream
    return chunked_write


def install():
    """Patch the kernel's own stdout/stderr objects (not replace them: ipykernel checks their type)."""
    for stream in (sys.stdout, sys.stderr):
        if not getattr(stream.write, "coderunner_chunked", False):
            stream.write = _chunked(stream)  # type: ignore[method-assign]  # patched in place, on purpose
    _wait_rather_than_drop()


def _wait_rather_than_drop():
    """IOPub is an XPUB socket, which drops messages past its high-water mark (1,000) while the host
    reads slower than code prints; and the host stops reading on purpose while a run's bounded queue
    is full (kernel/channels.py), so on a busy machine output was lost, its last lines too. With
    XPUB_NODROP the IO thread's send waits instead: the backlog stays inside the sandbox, bounded by
    the high-water mark, and the writer waits at its next flush."""
    try:
        import zmq
        from ipykernel.kernelapp import IPKernelApp

        if not IPKernelApp.initialized():
            return
        thread = IPKernelApp.instance().iopub_thread
        socket = thread.socket
        if socket.socket_type == zmq.XPUB:
            thread.schedule(lambda: socket.setsockopt(zmq.XPUB_NODROP, 1))  # the socket's own thread sets it
    except Exception as error:  # an ipykernel this was not written for: output may drop under load, as before
        print(f"coderunner: IOPub keeps dropping under load ({error!r})", file=sys.__stderr__)
