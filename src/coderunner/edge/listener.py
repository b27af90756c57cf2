"""The HTTP server's socket, and the rule for where it may listen, settled before anything else starts.

Left to uvicorn, a busy port was found only after the sessions' host had started and "serving" had
been logged, and ended in a page of traceback. Bound here first, it is one line naming the address
and the flag that changes it, with no sandbox started. The command line opens it before it loads
the server's modules (the MCP SDK alone takes seconds to import on a loaded machine), so a refusal
comes at once: this module imports nothing heavier than the settings.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import TYPE_CHECKING

from coderunner.errors import CodeRunnerError

if TYPE_CHECKING:
    from coderunner.config import Settings

WILDCARD_BINDS = ("0.0.0.0", "::", "")


class ListenError(CodeRunnerError):
    """The HTTP address cannot be listened on (in use, not this machine's, or not allowed)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_unsafe_bind(settings: Settings) -> None:
    """Listening beyond loopback needs a token the user chose (not one made silently) and the host
    names clients will use, so that exposing the sandbox to a network is always a decision."""
    if is_loopback(settings.host):
        return
    if not {"token", "token_file"} & settings.model_fields_set:
        raise ListenError(
            f"listening on {settings.host} (beyond this machine) needs a token you chose: set "
            "CODERUNNER_TOKEN or token_file (`coderunner token --file PATH` makes one)"
        )
    if settings.host in WILDCARD_BINDS and not settings.allowed_hosts:
        raise ListenError(
            f"listening on {settings.host} needs allowed_hosts: the names clients reach this machine by, "
            f'e.g. allowed_hosts = ["myhost:{settings.port}"]'
        )


def open_listener(settings: Settings) -> socket.socket:
    """The HTTP server's socket for `settings`, once its address is allowed (refuse_unsafe_bind)."""
    refuse_unsafe_bind(settings)
    return bind_listener(settings.host, settings.port)


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
