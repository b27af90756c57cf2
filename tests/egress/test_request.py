"""parse_request: the two forms a proxy serves, and a short 400 reason for everything else."""

from __future__ import annotations

import pytest

from coderunner.egress.request import BadRequest, parse_request


def test_connect_authority_forms() -> None:
    r = parse_request(b"CONNECT Example.COM:443 HTTP/1.1\r\nHost: example.com:443\r\nUser-Agent: x")
    assert (r.kind, r.host, r.port) == ("connect", "example.com", 443)
    r = parse_request(b"CONNECT [2001:DB8::1]:8443 HTTP/1.0")
    assert (r.host, r.port) == ("2001:db8::1", 8443)
    r = parse_request(b"CONNECT xn--bcher-kva.de:443 HTTP/1.1")
    assert r.host == "xn--bcher-kva.de"


def test_absolute_form_is_rebuilt_for_the_origin() -> None:
    r = parse_request(
        b"POST http://Example.com:8080/a/b?q=1#frag HTTP/1.1\r\n"
        b"Host: evil.example.org\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"Proxy-Authorization: Basic eA==\r\n"
        b"Connection: keep-alive, X-Secret, Content-Length\r\n"
        b"X-Secret: 1\r\n"
        b"Keep-Alive: 5\r\n"
        b"Content-Length: 3\r\n"
        b"Accept:  */*  "
    )
    assert (r.kind, r.host, r.port, r.path) == ("forward", "example.com", 8080, "/a/b?q=1")
    head = r.forward_head().decode()
    assert head == (
        "POST /a/b?q=1 HTTP/1.1\r\nHost: example.com:8080\r\nContent-Length: 3\r\nAccept: */*\r\n"
        "Connection: close\r\n\r\n"
    )
    r = parse_request(b"GET http://[::1]/ HTTP/1.1\r\nHost: x")
    assert (r.host, r.port, r.authority) == ("::1", 80, "[::1]")
    r = parse_request(b"GET http://example.com?x HTTP/1.0")
    assert r.path == "/?x"


@pytest.mark.parametrize(
    ("head", "says"),
    [
        (b"", "request line"),
        (b"GET / HTTP/1.1\r\nHost: example.com", "this is a proxy"),
        (b"OPTIONS * HTTP/1.1\r\nHost: example.com", "this is a proxy"),
        (b"GET https://example.com/ HTTP/1.1\r\nHost: example.com", "use CONNECT"),
        (b"GET ftp://example.com/ HTTP/1.1\r\nHost: example.com", "only http"),
        (b"GET example.com HTTP/1.1\r\nHost: example.com", "absolute"),
        (b"GET http://example.com/ HTTP/1.1", "Host header"),
        (b"GET http://example.com/ HTTP/1.1\r\nHost: a\r\nHost: b", "more than one Host"),
        (b"GET http://user:pw@example.com/ HTTP/1.1\r\nHost: a", "user information"),
        (b"GET http:///x HTTP/1.1\r\nHost: a", "no host"),
        (b"CONNECT example.com HTTP/1.1", "host:port"),
        (b"CONNECT example.com:0 HTTP/1.1", "port"),
        (b"CONNECT example.com:65536 HTTP/1.1", "port"),
        (b"CONNECT example.com:99999999999 HTTP/1.1", "port"),
        (b"CONNECT example.com:-1 HTTP/1.1", "port"),
        (b"CONNECT example.com:https HTTP/1.1", "port"),
        (b"CONNECT example.com:\xd9\xa4\xd9\xa4\xd9\xa3 HTTP/1.1", "non-ASCII"),
        (b"CONNECT example.com: HTTP/1.1", "port"),
        (b"CONNECT 2001:db8::1:443 HTTP/1.1", "brackets"),
        (b"CONNECT [2001:db8::1 HTTP/1.1", "closing bracket"),
        (b"CONNECT [2001:db8::1]x:443 HTTP/1.1", "not a port"),
        (b"CONNECT [example.com]:443 HTTP/1.1", "IPv6"),
        (b"CONNECT [::1%25eth0]:443 HTTP/1.1", "zone index"),
        (b"CONNECT b\xc3\xbccher.de:443 HTTP/1.1", "punycode"),
        (b"CONNECT a..b:443 HTTP/1.1", "empty label"),
        (b"CONNECT *.example.com:443 HTTP/1.1", "invalid label"),
        (b"CONNECT example.com:443 HTTP/2.0", "HTTP/1.0 and HTTP/1.1"),
        (b"CONNECT  example.com:443 HTTP/1.1", "single spaces"),
        (b"CONNECT example.com:443 HTTP/1.1 extra", "single spaces"),
        (b"connect example.com:443 HTTP/1.1", "method"),
        (b"CONNECT example.com:443\x00 HTTP/1.1", "NUL"),
        (b"CONNECT example.com:443 HTTP/1.1\nHost: x", "bare CR or LF"),
        (b"CONNECT example.com:443 HTTP/1.1\r\nX: a\rb", "bare CR or LF"),
        (b"CONNECT example.com:443 HTTP/1.1\r\n folded", "folded"),
        (b"CONNECT example.com:443 HTTP/1.1\r\nX : y", "Name: value"),
        (b"CONNECT example.com:443 HTTP/1.1\r\nnocolon", "Name: value"),
        (b"CONNECT example.com:443 HTTP/1.1\r\nX: a\x01b", "control"),
        (b"CONNECT example.com:443 HTTP/1.1\r\n\r\nX: y", "empty line"),
        (b"POST http://e.com/ HTTP/1.1\r\nHost: e.com\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", "both"),
        (b"POST http://e.com/ HTTP/1.1\r\nHost: e.com\r\nContent-Length: 1\r\nContent-Length: 2", "Content-Length"),
        (b"POST http://e.com/ HTTP/1.1\r\nHost: e.com\r\nContent-Length: -1", "Content-Length"),
        (b"CONNECT example.com:443 HTTP/1.1" + b"\r\nX: y" * 101, "header lines"),
    ],
)
def test_refused_with_a_reason(head: bytes, says: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(head)
    assert says.lower() in str(info.value).lower()
