"""Fuzzing the hand-written request parsing, alone and through a live proxy (hypothesis).

Properties: the parser only ever returns a well-formed request or raises BadRequest; the proxy
answers 400/403/408/502/503, relays to an allowed upstream, or closes on a client that closed first;
it never crashes (any logged error fails the test), never hangs (every exchange is bounded), and never
connects anywhere its policy refuses: every name resolves to the test upstream here, so a single
policy slip would show as an upstream connection without an allowed decision.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coderunner.egress import EgressPolicy, IPAddress, ProxyLimits
from coderunner.egress.request import BadRequest, parse_request
from coderunner.policy.egress import normalize_host

from .harness import BackgroundLoop, Upstream, exchange, resolver_for, running_proxy, status_of

HOSTS = [
    "ok.test",
    "a.ok.test",
    "OK.TEST.",
    "deep.a.ok.test",
    "evil.test",
    "ok.test.evil.test",
    "evilok.test",
    "xn--ok-test",
    "xn--bcher-kva.ok.test",
    "[::1]",
    "::1",
    "[::ffff:127.0.0.1]",
    "127.0.0.1",
    "127.1",
    "2130706433",
    "0x7f.1",
    "localhost",
    "ok.test\x00.evil.test",
    "ok.test\r\nHost: evil.test",
    "ök.test",
    "ｏｋ.test",
    "ok。test",
    "*.ok.test",
    "ok..test",
    "",
    "[ok.test]",
    "ok.test%00",
    "ok.test@evil.test",
    "evil.test#@ok.test",
    "ok.test\t",
]
FRAGMENTS = [*"aZ09.-_:[]@/?#% *\t\r\n\x00\x7f\x80éöｏ。ß\u200b\ufeff٤", "xn--", "ok.test", "::"]
WEIRD = st.lists(st.sampled_from(FRAGMENTS), max_size=20).map("".join)
HOST = st.one_of(st.sampled_from(HOSTS), WEIRD)
PORT_TEXT = st.one_of(
    st.integers(-5, 70_000).map(str),
    st.sampled_from(["", "0", "65535", "65536", "443", "http", "٤٤٣", "+80", " 80", "0080", "80 ", "1e3", "UP"]),
    st.just("UP"),  # replaced by the upstream's port: the allowed case
)
METHOD = st.one_of(st.sampled_from(["CONNECT", "GET", "POST", "HEAD", "connect", "G ET", ""]), WEIRD)
VERSION = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "http/1.1", "", "HTTP/1.1 "])
HEADER = st.tuples(
    st.one_of(st.sampled_from(["Host", "Content-Length", "Transfer-Encoding", "Connection", "X", " X", "X "]), WEIRD),
    st.one_of(st.sampled_from(["ok.test", "1", "chunked", "close", "a\r\nHost: evil.test", "\x00"]), WEIRD),
)
TERMINATOR = st.sampled_from(["\r\n\r\n"] * 6 + ["\n\n", "", "\r\n", "\r\n\r\nEXTRA"])


@st.composite
def request_heads(draw: st.DrawFn, port: int = 0) -> bytes:
    roll = draw(st.integers(0, 19))
    if roll == 0:
        return draw(st.binary(max_size=3000))
    if roll < 10:
        return draw(near_valid_heads(port))
    method = draw(METHOD)
    host = draw(HOST)
    port_text = draw(PORT_TEXT).replace("UP", str(port or 443))
    form = draw(st.sampled_from(["connect", "absolute", "origin", "raw"]))
    if form == "connect":
        target = f"{host}:{port_text}"
    elif form == "absolute":
        target = f"{draw(st.sampled_from(['http', 'HTTP', 'https', 'ftp']))}://{host}:{port_text}{draw(WEIRD)}"
    elif form == "origin":
        target = "/" + draw(WEIRD)
    else:
        target = draw(WEIRD)
    headers = draw(st.lists(HEADER, max_size=8))
    flood = draw(st.sampled_from([0] * 8 + [101, 400]))
    headers += [("X-Flood", "y")] * flood
    if draw(st.integers(0, 15)) == 0:
        headers.append(("X-Huge", "h" * draw(st.integers(15_000, 40_000))))
    lines = [f"{method} {target} {draw(VERSION)}"] + [f"{n}: {v}" for n, v in headers]
    text = "\r\n".join(lines) + draw(TERMINATOR)
    return text.encode(draw(st.sampled_from(["utf-8", "latin-1"])), "replace")


@st.composite
def near_valid_heads(draw: st.DrawFn, port: int) -> bytes:
    """A well-formed request to a mostly plausible host, with at most one odd part: reaches the policy."""
    host = draw(st.one_of(st.sampled_from(HOSTS), st.sampled_from(HOSTS), WEIRD))
    port_text = str(port or 443) if draw(st.integers(0, 4)) else draw(PORT_TEXT).replace("UP", str(port or 443))
    if draw(st.booleans()):
        line = f"CONNECT {host}:{port_text} HTTP/1.1"
    else:
        method = draw(st.sampled_from(["GET", "POST", "HEAD", "DELETE"]))
        line = f"{method} http://{host}:{port_text}/{draw(WEIRD) if draw(st.integers(0, 3)) == 0 else 'p'} HTTP/1.1"
    headers = [("Host", "x"), ("User-Agent", "fuzz")]
    if draw(st.integers(0, 4)) == 0:
        headers.insert(draw(st.integers(0, 2)), draw(HEADER))
    text = "\r\n".join([line] + [f"{n}: {v}" for n, v in headers]) + "\r\n\r\n"
    return text.encode("utf-8", "replace")


@settings(max_examples=3000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(head=request_heads())
def test_the_parser_returns_a_well_formed_request_or_bad_request(head: bytes) -> None:
    try:
        request = parse_request(head.split(b"\r\n\r\n", 1)[0])
    except BadRequest as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert normalize_host(request.host) == request.host  # canonical already
    assert 1 <= request.port <= 65535
    if request.kind == "forward":
        sent = request.forward_head()
        assert sent.endswith(b"\r\n\r\n") and sent.count(b"\r\n\r\n") == 1 and b"\x00" not in sent
        again = parse_request(sent[:-4].replace(b" /", b" http://" + request.authority.encode() + b"/", 1))
        assert (again.host, again.port, again.path) == (request.host, request.port, request.path)


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[BackgroundLoop, Upstream, dict]]:
    """One proxy for all examples: every name resolves to the loopback upstream; the policy decides."""
    background = BackgroundLoop()
    upstream = background.run(Upstream().start())
    checked: list[IPAddress] = []

    def check(ip: IPAddress) -> str | None:
        checked.append(ip)
        return None if ip == ipaddress.ip_address("127.0.0.1") else "only the upstream in this test"

    policy = EgressPolicy.parse(["ok.test", "*.ok.test"], ports=[upstream.port])
    limits = ProxyLimits(head_timeout_s=3.0, idle_s=3.0, connect_timeout_s=3.0, resolve_timeout_s=3.0)
    cm = running_proxy(policy, resolver=resolver_for({}, default=["127.0.0.1"]), address_check=check, limits=limits)
    run = background.run(cm.__aenter__())
    ctx: dict = {"run": run, "policy": policy, "checked": checked}
    yield background, upstream, ctx
    # The generator must have reached both sides of the property, or the test proved nothing.
    assert {200, 400, 403} <= ctx.get("codes", set()), ctx.get("codes")
    background.run(cm.__aexit__(None, None, None))
    background.run(upstream.stop())
    background.close()


@settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_live_proxy_answers_relays_or_refuses_and_never_connects_where_refused(
    live: tuple[BackgroundLoop, Upstream, dict], data: st.DataObject
) -> None:
    background, upstream, ctx = live
    run = ctx["run"]
    head = data.draw(request_heads(upstream.port))
    before = upstream.connects
    totals_before = run.log.totals()
    answer = background.run(exchange(run.path, head, timeout=30.0), timeout=60.0)
    code = status_of(answer)
    assert code in (0, 200, 400, 403, 408, 502, 503), answer[:200]
    event(f"status {code}")
    ctx.setdefault("codes", set()).add(code)
    # Wait (bounded) for the connection's decision: allowed ones are recorded when they close.
    for _ in range(500):
        if run.proxy.active_connections == 0:
            break
        background.run(asyncio.sleep(0.01))
    totals = run.log.totals()
    decided = totals["allowed"] + totals["denied"] - totals_before["allowed"] - totals_before["denied"]
    new = run.log.recent(decided) if decided else []
    allowed = [d for d in new if d.allowed and d.reason == "allowed"]
    for decision in allowed:
        assert ctx["policy"].allows(decision.host, decision.port), decision
    assert upstream.connects - before == len(allowed), (head[:200], answer[:200])
    assert (code == 200) == bool(allowed), (head[:200], answer[:200])
