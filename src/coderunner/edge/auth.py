"""Who may talk to an HTTP-listening server: a bearer token, and Host/Origin checks.

Anything that listens on a socket can be reached by every local process and, through DNS
rebinding, by web pages in the user's browser. So every HTTP request but the health check
carries `Authorization: Bearer <token>`, and the Host and Origin headers must name this server.
The server's own token is generated on first use and kept in a 0600 file, or given by the user;
it is the client `default`. `coderunner token add NAME` makes more, one client each
(client_tokens.py). The client a token names is put in the request's ASGI scope, where
callers.py reads it: the token, never a header, decides whose sessions a request may touch.
The same client is the request's Starlette user (an SDK AuthenticatedUser), so that the SDK's own
transports, which tie an MCP session to the user that opened it, refuse it to any other token too:
a second line behind session_binding.py.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from starlette.authentication import AuthCredentials
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from coderunner.edge.client_tokens import PRIMARY_CLIENT, ClientTokenError, ClientTokens, new_token, tokens_dir
from coderunner.edge.http_limits import refuse_repeated, repeated_field
from coderunner.edge.listener import WILDCARD_BINDS, is_loopback, refuse_unsafe_bind
from coderunner.edge.refusals import RefusalLog, header_reason, unauthorized_reason
from coderunner.edge.session_binding import BindMcpSessions
from coderunner.errors import CodeRunnerError

if TYPE_CHECKING:
    from coderunner.config import Settings

#: Answers without a token and reveals nothing but that a CodeRunner server is up.
HEALTH_PATH = "/health"
#: OAuth discovery documents (oauth-protected-resource, oauth-authorization-server, openid-configuration):
#: this server has none, and says so without a token.
WELL_KNOWN_PREFIX = "/.well-known/"
_NO_OAUTH = {
    "error": "not_found",
    "error_description": "this server does not use OAuth: send 'Authorization: Bearer <token>' "
    "(`coderunner token` on the server's machine prints it)",
}
TOKEN_BYTES = 32
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
#: The ASGI scope key that carries the client a request's token names (see callers.py).
CLIENT_SCOPE_KEY = "coderunner.client"


class AuthError(CodeRunnerError):
    """The token cannot be read or made; the message says why."""


def read_token(path: Path) -> str:
    """The token in `path`, refusing a file others may read (it would no longer be a secret)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AuthError(f"no token file at {path}: start the server once, or run `coderunner token`") from None
    except OSError as exc:
        raise AuthError(f"cannot read the token file {path}: {exc.strerror}") from None
    with os.fdopen(fd) as handle:
        if os.fstat(handle.fileno()).st_mode & 0o077:
            raise AuthError(f"the token file {path} is readable by other users: chmod 600 {path}")
        token = handle.read(4096).strip()
    if not token:
        raise AuthError(f"the token file {path} is empty: delete it and start the server to make a new one")
    return token


def ensure_token(path: Path, *, rotate: bool = False) -> str:
    """The token in `path`, made (0600, in a 0700 folder) when there is none yet or on `rotate`."""
    if not rotate and path.exists():
        return read_token(path)
    token = new_token(TOKEN_BYTES)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        os.replace(staging, path)
    except OSError as exc:
        raise AuthError(f"cannot write the token file {path}: {exc.strerror}") from None
    return token


@dataclass(frozen=True)
class AccessPolicy:
    """The tokens and the Host/Origin values an HTTP server accepts."""

    token: str
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]
    #: The per-client tokens (`coderunner token add`), if any may be used.
    clients: ClientTokens | None = None

    @classmethod
    def for_bind(
        cls,
        token: str,
        bind_host: str,
        port: int,
        extra_hosts: list[str],
        extra_origins: list[str],
        clients: ClientTokens | None = None,
    ) -> AccessPolicy:
        """Loopback names always; the bound address when it is a specific one; what the user added."""
        names = list(LOOPBACK_NAMES)
        if not is_loopback(bind_host) and bind_host not in WILDCARD_BINDS:
            names.append(bind_host)
        hosts = [f"[{name}]" if ":" in name else name for name in names]
        allowed_hosts = [*hosts, *(f"{host}:{port}" for host in hosts), *extra_hosts]
        origins = [f"{scheme}://{host}" for host in allowed_hosts for scheme in ("http", "https")]
        return cls(token, tuple(allowed_hosts), tuple([*origins, *extra_origins]), clients)

    def security_settings(self) -> TransportSecuritySettings:
        return TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=list(self.allowed_hosts),
            allowed_origins=list(self.allowed_origins),
        )

    async def client_of(self, request: Request) -> str | None:
        """The client the request's bearer token names, or None for a missing or wrong token."""
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            return None
        if secrets.compare_digest(presented.encode(), self.token.encode()):
            return PRIMARY_CLIENT
        return self.clients.match(presented) if self.clients is not None else None


class RequireToken:
    """ASGI middleware in front of every route: no repeated identity fields, headers checked, then the bearer token."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        # Behind the token check: an MCP session id works only with the token that opened it.
        self.app = BindMcpSessions(app, scope_client)
        self.policy = policy
        # Each refusal, here or behind, leaves one line with its reason on the log: a client that
        # only says "Failed to connect" has its reason there (refusals.py).
        self.refusals = RefusalLog(secrets=(policy.token,))
        # The SDK's own Host/Origin checker; Content-Type stays the MCP transports' business.
        self.headers = TransportSecurityMiddleware(policy.security_settings())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # First of all: a request naming its token, session or client twice is ambiguous (http_limits.py).
        if (repeated := repeated_field(scope)) is not None:
            self.refusals.refused(scope, 400, f"{repeated} appears more than once")
            await refuse_repeated(repeated, send)
            return
        request = Request(scope)
        refused = await self.headers.validate_request(request, is_post=False)
        if refused is not None:
            self.refusals.refused(
                scope, refused.status_code, header_reason(refused.status_code, scope, self.refusals.quoter(scope))
            )
            await refused(scope, receive, send)
            return
        if scope["path"] == HEALTH_PATH:
            await JSONResponse({"status": "ok"})(scope, receive, send)
            return
        if scope["path"].startswith(WELL_KNOWN_PREFIX):
            # No OAuth here: a 404 (not 401) on discovery makes clients fall back to the bearer token.
            self.refusals.refused(
                scope, 404, "OAuth discovery: this server has no OAuth (the client's token is missing or wrong?)"
            )
            await JSONResponse(_NO_OAUTH, status_code=404)(scope, receive, send)
            return
        client = await self.policy.client_of(request)
        if client is None:
            self.refusals.refused(
                scope, 401, unauthorized_reason(request.headers.get("authorization"), self.refusals.quoter(scope))
            )
            await _unauthorized()(scope, receive, send)
            return
        scope[CLIENT_SCOPE_KEY] = client
        scope["user"] = sdk_user(client)
        scope["auth"] = AuthCredentials([])
        watch = self.refusals.watch(scope, send)
        try:
            await self.app(scope, receive, watch)
        finally:
            watch.done()


def sdk_user(client: str) -> AuthenticatedUser:
    """The request's user as the SDK's transports read it: one principal per token's client.

    The SDK records the principal (client_id, issuer, subject) that opens an MCP session and
    answers 404 to a request from any other. Client names are distinct per token (`default` is
    the server's own), so that check refuses one token another's session. The secret itself is
    not copied here: nothing downstream needs it.
    """
    return AuthenticatedUser(AccessToken(token="", client_id=client, scopes=[]))


def _unauthorized() -> Response:
    body = {
        "error": "unauthorized",
        "error_description": "missing, wrong or revoked bearer token: send 'Authorization: Bearer <token>'; "
        "`coderunner token` on the server's machine prints the server's own token, "
        "`coderunner token add NAME` makes one for another client",
    }
    return Response(
        json.dumps(body),
        status_code=401,
        media_type="application/json",
        headers={"WWW-Authenticate": 'Bearer realm="coderunner"'},
    )


def policy_for(settings: Settings) -> AccessPolicy:
    """The access policy of an HTTP server with these settings; ListenError when it must not start
    (edge/listener.py's rule: beyond loopback, a token the user chose and the names clients use)."""
    refuse_unsafe_bind(settings)
    token = settings.token.get_secret_value() if settings.token else ensure_token(settings.token_file)
    clients = ClientTokens(tokens_dir(settings.token_file))
    try:
        clients.check()
    except (ClientTokenError, OSError) as exc:
        raise AuthError(f"client tokens: {exc}") from None
    return AccessPolicy.for_bind(
        token, settings.host, settings.port, settings.allowed_hosts, settings.allowed_origins, clients
    )


def scope_client(scope: Any) -> str | None:
    """The client RequireToken found for this request's scope (None: not an HTTP request it passed)."""
    value = scope.get(CLIENT_SCOPE_KEY) if isinstance(scope, dict) else None
    return value if isinstance(value, str) else None
