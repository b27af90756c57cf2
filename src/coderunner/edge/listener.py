"""The HTTP server's socket, bound before anything else starts.

Left to uvicorn, a busy port was found only after the sessions' host had started and "serving" had
been logged, and ended in a page of traceback. Bound here first, it is one line naming the address
and the flag that changes it, with no sandbox started.
"""

from __future__ import annotations

import errno
import socket

from coderunner.errors import CodeRunnerError


class ListenError(CodeRunnerError):
    """The HTTP address cannot be listened on (in use, not this machine's, or not allowed)."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not yet listening (uvicorn listens on it once the app is up)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sock: socket.socket | None = None
    try:
        # As uvicorn binds: IPv6 when the host is an IPv6 address; a restart may reuse a port in TIME_WAIT.
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise ListenError(f"cannot listen on {where}: {_reason(exc)}") from None
    return sock


def _reason(exc: OSError) -> str:
    """What went wrong, and the flag that gets past it."""
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use (another server?); choose another with --port"
    if exc.errno == errno.EACCES:
        return "not allowed (ports below 1024 need privileges); choose another with --port"
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return f"{exc.strerror or exc} (not an address of this machine?); choose another with --host"
    return f"{exc.strerror or exc}; choose another address with --host or port with --port"
