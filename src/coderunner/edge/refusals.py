"""One log line for each HTTP request the server refuses, with the reason and the client's address.

A client that is refused usually shows its user only "Failed to connect". The server's log (stderr)
is then where the reason is: a missing or wrong token (401), a repeated or malformed request (400),
a body over the SDK's limit (413), a Host or Origin this server does not answer to (421, 403), an MCP
session that ended (404). Refusals made here (auth.RequireToken) give their own reason; those the
MCP transports behind it make are read from the first bytes of the response they send.

The token never reaches the log: of the headers only Host, Origin and the name of an
Authorization scheme are quoted, and whatever is quoted has the credentials the request presented
and the server's own token cut out of it first (a client may paste its token into a URL, or into
a body the SDK quotes back).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from starlette.types import Message, Scope, Send

log = logging.getLogger(__name__)

#: How much of a refusal's body is read for its reason, and how much of any client-sent text is quoted.
REASON_BYTES = 512
QUOTE_CHARS = 120
#: Shorter credentials are not cut out of the log (they would mangle it, and guard nothing).
MIN_SECRET_CHARS = 4


def peer(scope: Scope) -> str:
    """The client's address as the server saw it ("unknown address" when the server was not told)."""
    client = scope.get("client")
    if not client:
        return "unknown address"
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def presented_credentials(scope: Scope) -> list[str]:
    """What the request sent as credentials (each Authorization value, and its token part), longest first."""
    found: set[str] = set()
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            whole = value.decode("latin-1").strip()
            found.update(part for part in (whole, whole.partition(" ")[2].strip()) if len(part) >= MIN_SECRET_CHARS)
    return sorted(found, key=len, reverse=True)


class Quoter:
    """Quotes client-sent text for the log: the request's credentials (and the server's token) cut out
    first, then bounded to one line with control characters escaped."""

    def __init__(self, scope: Scope, secrets: Iterable[str] = ()) -> None:
        extra = [secret for secret in secrets if len(secret) >= MIN_SECRET_CHARS]
        self.secrets = sorted({*presented_credentials(scope), *extra}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "<token>")
        shown = text[:QUOTE_CHARS].encode("unicode_escape").decode("ascii").replace("'", "\\'")
        return f"'{shown}'" + ("..." if len(text) > QUOTE_CHARS else "")


@dataclass
class RefusalLog:
    """One server's refusal lines: `refused POST '/mcp' from 127.0.0.1:50312: 401 ...` on its log (stderr).

    Anyone who can reach the port can send refused requests as fast as they like, so the lines are
    bounded: at most `burst` per `window_s`; the refusals over it are counted, and the count is told
    on the next line written. OAuth discovery probes (`/.well-known/...`) are routine for some
    clients: noted at INFO, the rest are warnings.
    """

    secrets: tuple[str, ...] = ()
    burst: int = 30
    window_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _window_start: float = field(default=float("-inf"), init=False)
    _written: int = field(default=0, init=False)
    _unwritten: int = field(default=0, init=False)

    def quoter(self, scope: Scope) -> Quoter:
        return Quoter(scope, self.secrets)

    def refused(self, scope: Scope, status: int, reason: str) -> None:
        """Log a refusal; `reason` quotes whatever it took from the request with `self.quoter(scope)`."""
        now = self.clock()
        if now - self._window_start >= self.window_s:
            self._window_start, self._written = now, 0
        if self._written >= self.burst:
            self._unwritten += 1
            return
        self._written += 1
        unwritten, self._unwritten = self._unwritten, 0
        more = f" ({unwritten} more refusals before this one were not logged)" if unwritten else ""
        path = str(scope.get("path", "?"))
        level = logging.INFO if path.startswith("/.well-known/") else logging.WARNING
        method = str(scope.get("method", "?"))[:16]  # an HTTP token: h11 admits no other characters
        quote = self.quoter(scope)
        log.log(level, "refused %s %s from %s: %d %s%s", method, quote(path), peer(scope), status, reason, more)

    def watch(self, scope: Scope, send: Send) -> RefusalWatch:
        return RefusalWatch(scope, send, self)


def unauthorized_reason(authorization: str | None, quote: Quoter) -> str:
    """Why a request's Authorization header let nobody in (quoting none of its token)."""
    if authorization is None:
        return "no Authorization header: the client must send 'Authorization: Bearer <token>'"
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return f"Authorization is not 'Bearer <token>' (its scheme: {quote(scheme[:20])})"
    return (
        "the bearer token is not one this server accepts (wrong, revoked, or another server's): "
        "`coderunner token` prints the server's own"
    )


def header_reason(status: int, scope: Scope, quote: Quoter) -> str:
    """Why the Host/Origin check refused (421: Host, 403: Origin), quoting the value it refused."""
    headers = {name.lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}
    if status == 421:
        return (
            f"Host {quote(headers.get(b'host', ''))} is not a name of this server "
            "(the DNS-rebinding check; allowed_hosts adds one)"
        )
    if status == 403:
        return (
            f"Origin {quote(headers.get(b'origin', ''))} is not allowed "
            "(the DNS-rebinding check; allowed_origins adds one)"
        )
    return "its headers were refused"


def body_reason(body: bytes, quote: Quoter) -> str:
    """The reason a refusal's body gives: a JSON-RPC error's message, an OAuth-style description, or its text."""
    text = body[:REASON_BYTES].decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            text = error["message"]
        elif isinstance(parsed.get("error_description"), str):
            text = parsed["error_description"]
        elif isinstance(error, str):
            text = error
    return quote(text) if text else "(no reason given)"


class RefusalWatch:
    """A `send` for the app behind: notes a 4xx response it sends, and logs it once with its body's reason."""

    def __init__(self, scope: Scope, send: Send, refusals: RefusalLog) -> None:
        self.scope = scope
        self.send = send
        self.refusals = refusals
        self.status = 0  # a 4xx status once one started; 0 otherwise
        self.started = False
        self.logged = False

    async def __call__(self, message: Message) -> None:
        if not self.started and message["type"] == "http.response.start":
            self.started = True
            status = int(message.get("status", 0))
            self.status = status if 400 <= status < 500 else 0
        elif self.status and message["type"] == "http.response.body":
            self.done(message.get("body", b""))
        await self.send(message)

    def done(self, body: bytes = b"") -> None:
        """Log the refusal, if this was one not yet logged: at its first body, or when the app returns."""
        if self.status and not self.logged:
            self.logged = True
            self.refusals.refused(self.scope, self.status, body_reason(body, self.refusals.quoter(self.scope)))


class TokenCut(logging.Filter):
    """Cuts the server's token out of a logger's lines (uvicorn's access log quotes request paths as
    sent, and a client may put its token there)."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.token and self.token in message:
            record.msg, record.args = message.replace(self.token, "<token>"), ()
        return True
