"""Keep each IOPub stream message small, however much one write() carries.

ipykernel sends whatever a stream buffered since its last flush as one message, so
`print("x" * 10**8)` becomes a single 100 MB message. The host refuses messages over its
size limit, so an honest program would lose its output; split large writes instead.
"""

import functools
import sys

#: Characters per message at most.
CHUNK_CHARS = 256 * 1024


def _chunked(stream):
    write = stream.write

    @functools.wraps(write)
    def chunked_write(text):
        if not isinstance(text, str) or len(text) <= CHUNK_CHARS:
            return write(text)
        for start in range(0, len(text), CHUNK_CHARS):
            write(text[start : start + CHUNK_CHARS])
            stream.flush()
        return len(text)

    chunked_write.coderunner_chunked = True  # type: ignore[attr-defined]  # the mark of a patched stream
    return chunked_write


def install():
    """Patch the kernel's own stdout/stderr objects (not replace them: ipykernel checks their type)."""
    for stream in (sys.stdout, sys.stderr):
        if not getattr(stream.write, "coderunner_chunked", False):
            stream.write = _chunked(stream)  # type: ignore[method-assign]  # patched in place, on purpose
