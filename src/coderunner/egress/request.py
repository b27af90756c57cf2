"""Parsing one proxy request head, strictly: what the proxy acts on, or BadRequest with a short reason.

Written here rather than taken from a library because the proxy needs exactly two request forms and
a parser that refuses everything ambiguous (obs-fold, bare LF, whitespace before a colon, duplicate
Host or Content-Length, both Content-Length and Transfer-Encoding): an ambiguity is where a proxy and
the server behind it disagree about what was asked. tests/egress fuzz it.

    CONNECT host:port HTTP/1.1            -> ProxyRequest(kind="connect")
    GET http://host[:port]/path HTTP/1.1  -> ProxyRequest(kind="forward"), any method but CONNECT
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from coderunner.policy.egress import EgressPolicyError, normalize_host

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSIONS = frozenset({"HTTP/1.0", "HTTP/1.1"})
#: Control characters a header value may not hold (HTAB is allowed; obs-text bytes >= 0x80 are).
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
MAX_HEADERS = 100
#: Headers that describe this hop only, never forwarded (plus any the Connection header names).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "host",
    }
)


class BadRequest(Exception):
    """A request head the proxy refuses with 400; the message is a short reason, safe to show."""


@dataclass(frozen=True)
class ProxyRequest:
    """One parsed request: where to go (canonical host, port) and, to forward, what to send."""

    kind: Literal["connect", "forward"]
    method: str
    host: str
    port: int
    version: str
    #: The authority as it goes into the forwarded Host header (brackets kept for IPv6).
    authority: str = ""
    #: Origin-form target (path and query) for a forwarded request.
    path: str = ""
    #: Header lines to forward, in order, hop-by-hop ones already removed.
    headers: tuple[tuple[str, str], ...] = ()

    def forward_head(self) -> bytes:
        """The head to send upstream for a forwarded request: origin form, our Host, Connection: close."""
        lines = [f"{self.method} {self.path} {self.version}", f"Host: {self.authority}"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_request(head: bytes) -> ProxyRequest:
    """Parse a request head (without the final CRLFCRLF). Raises BadRequest."""
    text = head.decode("latin-1")
    if "\x00" in text:
        raise BadRequest("the request holds a NUL byte")
    lines = text.split("\r\n")
    if any("\r" in line or "\n" in line for line in lines):
        raise BadRequest("lines must end with CRLF (a bare CR or LF was found)")
    method, target, version = _request_line(lines[0])
    headers = _headers(lines[1:])
    names = [n.lower() for n, _ in headers]
    if names.count("host") > 1:
        raise BadRequest("more than one Host header")
    if "transfer-encoding" in names and "content-length" in names:
        raise BadRequest("both Content-Length and Transfer-Encoding")
    lengths = {v.strip() for n, v in headers if n.lower() == "content-length"}
    if len(lengths) > 1 or any(not v.isdigit() for v in lengths):
        raise BadRequest("an invalid or repeated Content-Length")
    if method == "CONNECT":
        host, port, _ = _authority(target, default_port=None)
        return ProxyRequest(kind="connect", method=method, host=host, port=port, version=version)
    if target.startswith("/") or target == "*":
        raise BadRequest(
            "this is a proxy: send `CONNECT host:port` for HTTPS, or an absolute URL (GET http://host/path) for HTTP"
        )
    scheme, sep, rest = target.partition("://")
    if not sep or not scheme.isascii() or not scheme.isalpha():
        raise BadRequest("the request target is not an absolute http:// URL")
    if scheme.lower() != "http":
        raise BadRequest(f"only http:// can be forwarded; use CONNECT for {scheme.lower()}://")
    if version == "HTTP/1.1" and "host" not in names:
        raise BadRequest("an HTTP/1.1 request without a Host header")
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority_text, path = rest[:cut], rest[cut:]
    if "@" in authority_text:
        raise BadRequest("user information in the URL is not forwarded; send credentials in a header")
    host, port, authority = _authority(authority_text, default_port=80)
    path = path.split("#", 1)[0]
    if not path.startswith("/"):
        path = "/" + path
    listed = [v for n, v in headers if n.lower() == "connection"]
    connection_listed = {token.strip().lower() for v in listed for token in v.split(",") if token.strip()}
    # The body is relayed as sent, so the headers that frame it stay whatever Connection lists.
    connection_listed -= {"content-length", "transfer-encoding"}
    kept = tuple((n, v.strip()) for n, v in headers if n.lower() not in HOP_BY_HOP | connection_listed)
    return ProxyRequest(
        kind="forward",
        method=method,
        host=host,
        port=port,
        version=version,
        authority=authority,
        path=path,
        headers=kept,
    )


def _request_line(line: str) -> tuple[str, str, str]:
    parts = line.split(" ")
    if len(parts) != 3 or not all(parts):
        raise BadRequest("the request line must be `METHOD TARGET HTTP/1.1`, single spaces")
    method, target, version = parts
    if not _TOKEN.fullmatch(method) or method != method.upper():
        raise BadRequest("the method is not an HTTP method")
    if version not in _VERSIONS:
        raise BadRequest("only HTTP/1.0 and HTTP/1.1 are spoken here")
    if any(ord(ch) >= 0x7F for ch in target):
        raise BadRequest("the request target holds non-ASCII bytes; send international names in punycode (xn--)")
    if any(ord(ch) < 0x20 for ch in target):
        raise BadRequest("the request target holds a control character")
    return method, target, version


def _headers(lines: list[str]) -> list[tuple[str, str]]:
    if len(lines) > MAX_HEADERS:
        raise BadRequest(f"more than {MAX_HEADERS} header lines")
    out: list[tuple[str, str]] = []
    for line in lines:
        if not line:
            raise BadRequest("an empty line inside the head")
        if line[0] in " \t":
            raise BadRequest("folded header lines are not accepted")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise BadRequest("a header line is not `Name: value`")
        if _BAD_VALUE.search(value):
            raise BadRequest(f"the {name} header holds a control character")
        out.append((name, value.strip(" \t")))
    return out


def _authority(text: str, default_port: int | None) -> tuple[str, int, str]:
    """(canonical host, port, authority for a Host header) from `host[:port]` or `[v6][:port]`."""
    if not text:
        raise BadRequest("the request names no host")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise BadRequest("an IPv6 address without its closing bracket")
        host_text, rest = text[: end + 1], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise BadRequest("text after the IPv6 address that is not a port")
        port_text = rest[1:] if rest else None
    else:
        if text.count(":") > 1:
            raise BadRequest("an IPv6 address must be in brackets ([2001:db8::1]:443)")
        host_text, sep, port_text_ = text.partition(":")
        port_text = port_text_ if sep else None
    if port_text is None:
        if default_port is None:
            raise BadRequest("CONNECT needs host:port")
        port = default_port
    else:
        if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
            raise BadRequest("the port is not a number from 1 to 65535")
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise BadRequest("the port is not a number from 1 to 65535")
    try:
        host = normalize_host(host_text)
    except EgressPolicyError as exc:
        raise BadRequest(str(exc)) from None
    shown = f"[{host}]" if ":" in host else host
    authority = shown if port_text is None else f"{shown}:{port}"
    return host, port, authority
