"""EgressProxy for real: a unix socket, a real upstream on loopback, real clients (raw bytes)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import pytest

from coderunner.egress import EgressPolicy, EgressPolicyError, IPAddress, ProxyLimits
from coderunner.policy.egress import CEILING_SETTING

from .harness import Upstream, body_of, exchange, loopback_only, resolver_for, running_proxy, status_of

pytestmark = pytest.mark.anyio

BLOCKED = "blocked by CodeRunner's network policy: "


@pytest.fixture
async def upstream():
    up = await Upstream().start()
    yield up
    await up.stop()


def policy_for(up: Upstream, *entries: str) -> EgressPolicy:
    return EgressPolicy.parse(list(entries) or ["ok.test", "*.ok.test"], ports=[up.port])


async def test_connect_tunnels_bytes_both_ways_and_records_them(upstream: Upstream) -> None:
    async with running_proxy(
        policy_for(upstream), resolver=resolver_for({"ok.test": ["127.0.0.1"]}), address_check=loopback_only
    ) as run:
        reader, writer = await asyncio.open_unix_connection(run.path)
        writer.write(f"CONNECT OK.test:{upstream.port} HTTP/1.1\r\nHost: ok.test\r\n\r\nearly".encode())
        await writer.drain()
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 200 Connection established\r\n\r\n"
        assert await reader.readexactly(5) == b"early"  # bytes sent right behind the head are not lost
        writer.write(b"x" * 100_000)
        await writer.drain()
        assert await reader.readexactly(100_000) == b"x" * 100_000
        (open_now,) = run.proxy.open_connections()
        assert (open_now.host, open_now.reason, open_now.received) == ("ok.test", "open", 100_005)
        assert run.log.recent() == []  # recorded when it closes, with its final counts
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        for _ in range(100):
            if run.log.totals()["allowed"]:
                break
            await asyncio.sleep(0.05)
        (decision,) = run.log.recent()
        assert (decision.host, decision.port, decision.allowed) == ("ok.test", upstream.port, True)
        assert decision.sent == 100_005 and decision.received == 100_005
    assert upstream.connects == 1


async def test_absolute_form_is_forwarded_in_origin_form_with_hop_headers_stripped(upstream: Upstream) -> None:
    async with running_proxy(
        policy_for(upstream), resolver=resolver_for({"a.ok.test": ["127.0.0.1"]}), address_check=loopback_only
    ) as run:
        answer = await exchange(
            run.path,
            f"GET http://a.ok.test:{upstream.port}/p?q=1 HTTP/1.1\r\nHost: evil.test\r\n"
            "Proxy-Connection: keep-alive\r\nProxy-Authorization: Basic eDp5\r\nConnection: keep-alive\r\n"
            "User-Agent: t\r\n\r\n".encode(),
        )
    assert status_of(answer) == 200
    (head,) = upstream.heads
    assert head.decode() == (
        f"GET /p?q=1 HTTP/1.1\r\nHost: a.ok.test:{upstream.port}\r\nUser-Agent: t\r\nConnection: close"
    )
    assert body_of(answer) == head.decode()


async def test_a_host_outside_the_policy_is_refused_with_the_message(upstream: Upstream) -> None:
    ceiling = policy_for(upstream, "ok.test", "*.ok.test", "other.test")
    async with running_proxy(
        policy_for(upstream, "ok.test"),
        ceiling,
        resolver=resolver_for({}, default=["127.0.0.1"]),
        address_check=loopback_only,
    ) as run:
        mark = run.log.mark()
        for target in (f"evil.test:{upstream.port}", f"127.0.0.1:{upstream.port}", f"other.test:{upstream.port}"):
            answer = await exchange(run.path, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            assert status_of(answer) == 403, answer
            assert b"Content-Type: text/plain" in answer and b"Proxy-Status: coderunner" in answer
            host = target.rsplit(":", 1)[0]
            first, hint = body_of(answer).splitlines()
            assert first == (
                f"{BLOCKED}{host} is not in this session's allowlist (allowed: ok.test on port {upstream.port})"
            )
            assert ('allow=["other.test"]' in hint) if host == "other.test" else (CEILING_SETTING in hint)
        answer = await exchange(run.path, f"GET http://evil.test:{upstream.port}/ HTTP/1.1\r\nHost: e\r\n\r\n".encode())
        assert status_of(answer) == 403 and BLOCKED + "evil.test is not" in body_of(answer)
        port_answer = await exchange(run.path, b"CONNECT ok.test:22 HTTP/1.1\r\n\r\n")
        assert status_of(port_answer) == 403 and "port 22 of ok.test" in body_of(port_answer)
        assert run.log.denied_since(mark) == [
            f"evil.test:{upstream.port}",
            f"127.0.0.1:{upstream.port}",
            f"other.test:{upstream.port}",
            "ok.test:22",
        ]
        assert run.log.totals()["denied"] == 5
    assert upstream.connects == 0


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET / HTTP/1.1\r\nHost: ok.test",
        b"garbage",
        b"CONNECT ok.test:0 HTTP/1.1",
        b"CONNECT ok.test:65536 HTTP/1.1",
        b"CONNECT ok.test:http HTTP/1.1",
        b"CONNECT ::1:443 HTTP/1.1",
        b"CONNECT [::1:443 HTTP/1.1",
        b"GET http://ok.test/ HTTP/1.1",
        b"CONNECT ok.test:443 HTTP/1.1\r\nX: \x00",
        b"CONNECT ok.test:443 HTTP/1.1\r\nX: " + b"a" * 20_000,
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # TLS straight at the proxy
    ],
)
async def test_malformed_requests_get_400(upstream: Upstream, request_head: bytes) -> None:
    async with running_proxy(
        policy_for(upstream), resolver=resolver_for({}, default=["127.0.0.1"]), address_check=loopback_only
    ) as run:
        answer = await exchange(run.path, request_head + b"\r\n\r\n")
        assert status_of(answer) == 400, answer
        assert body_of(answer).startswith("bad proxy request: ")
    assert upstream.connects == 0


@pytest.mark.parametrize(
    ("host", "resolves_to"),
    [
        ("localhost", None),  # the real resolver: /etc/hosts says loopback
        ("127.0.0.1", None),
        ("[::1]", None),
        ("10.1.2.3", None),
        ("169.254.169.254", None),
        ("[::ffff:127.0.0.1]", None),
        ("rebound.test", ["127.0.0.1"]),
        ("rebound.test", ["10.0.0.7", "::ffff:10.0.0.7"]),
        ("rebound.test", ["169.254.169.254"]),
        ("rebound.test", ["fd00:ec2::254"]),
        ("own.test", "OWN"),
    ],
)
async def test_private_addresses_are_refused_even_when_allowlisted(
    upstream: Upstream, host: str, resolves_to: list[str] | str | None
) -> None:
    from coderunner.egress.addresses import host_addresses

    entry = host.strip("[]")
    resolver = None
    if resolves_to == "OWN":
        from coderunner.egress.addresses import forbidden_reason

        public_own = [str(ip) for ip in host_addresses() if forbidden_reason(ip, frozenset()) is None]
        if not public_own:
            pytest.skip("this host has no address outside the always-refused ranges")
        resolver = resolver_for({entry: public_own})
    elif resolves_to is not None:
        resolver = resolver_for({entry: resolves_to})
    policy = EgressPolicy.parse([entry], ports=[upstream.port])
    async with running_proxy(policy, resolver=resolver) as run:
        answer = await exchange(run.path, f"CONNECT {host}:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert status_of(answer) == 403, answer
        assert "resolves to a private/loopback address" in body_of(answer)
        assert b"destination_ip_prohibited" in answer
        (decision,) = run.log.recent()
        assert not decision.allowed and "private/loopback" in decision.reason
    assert upstream.connects == 0


async def test_only_checked_addresses_are_connected(upstream: Upstream) -> None:
    """A name resolving to a refused address and a good one: the proxy uses the good one only."""
    seen: list[IPAddress] = []

    def check(ip: IPAddress) -> str | None:
        seen.append(ip)
        return loopback_only(ip)

    resolver = resolver_for({"ok.test": ["10.9.9.9", "127.0.0.1"]})
    async with running_proxy(policy_for(upstream), resolver=resolver, address_check=check) as run:
        answer = await exchange(run.path, f"GET http://ok.test:{upstream.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status_of(answer) == 200
    assert seen == [ipaddress.ip_address("10.9.9.9"), ipaddress.ip_address("127.0.0.1")]
    assert upstream.connects == 1


async def test_ipv6_literal_upstream(upstream: Upstream) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    up6 = Upstream()
    try:
        await up6.start("::1")
    except OSError:
        pytest.skip("::1 cannot be bound here")
    try:
        policy = EgressPolicy.parse(["[::1]"], ports=[up6.port])
        async with running_proxy(policy, address_check=loopback_only) as run:
            answer = await exchange(run.path, f"GET http://[::1]:{up6.port}/x HTTP/1.1\r\nHost: y\r\n\r\n".encode())
        assert status_of(answer) == 200
        assert up6.heads[0].startswith(f"GET /x HTTP/1.1\r\nHost: [::1]:{up6.port}".encode())
    finally:
        await up6.stop()


async def test_unresolvable_and_unreachable_hosts_get_502(upstream: Upstream) -> None:
    closed_port = upstream.port
    await upstream.stop()
    policy = EgressPolicy.parse(["gone.test", "down.test"], ports=[closed_port])
    resolver = resolver_for({"down.test": ["127.0.0.1"]})
    async with running_proxy(policy, resolver=resolver, address_check=loopback_only) as run:
        answer = await exchange(run.path, f"CONNECT gone.test:{closed_port} HTTP/1.1\r\n\r\n".encode())
        assert status_of(answer) == 502 and "could not be resolved" in body_of(answer)
        answer = await exchange(run.path, f"CONNECT down.test:{closed_port} HTTP/1.1\r\n\r\n".encode())
        assert status_of(answer) == 502 and "could not connect" in body_of(answer)
        assert run.log.denied_since(0) == []  # failures are not policy denials


async def test_asker_widens_within_the_ceiling_once_and_never_beyond(upstream: Upstream) -> None:
    asked: list[tuple[str, int]] = []
    answer_gate = asyncio.Event()

    async def asker(host: str, port: int) -> bool:
        asked.append((host, port))
        await answer_gate.wait()
        return host == "yes.test"

    policy = policy_for(upstream, "ok.test")
    ceiling = policy_for(upstream, "ok.test", "yes.test", "no.test")
    async with running_proxy(
        policy,
        ceiling,
        asker=asker,
        resolver=resolver_for({}, default=["127.0.0.1"]),
        address_check=loopback_only,
    ) as run:
        head = f"GET http://yes.test:{upstream.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        three = [asyncio.ensure_future(exchange(run.path, head)) for _ in range(3)]
        await asyncio.sleep(0.2)
        answer_gate.set()
        assert [status_of(a) for a in await asyncio.gather(*three)] == [200, 200, 200]
        assert asked == [("yes.test", upstream.port)]  # concurrent connections share one question
        assert run.proxy.policy.allows("yes.test", upstream.port)
        for _ in range(2):
            no = await exchange(run.path, f"CONNECT no.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
            assert status_of(no) == 403 and "declined" in body_of(no)
        assert asked.count(("no.test", upstream.port)) == 1  # a refusal is remembered
        beyond = await exchange(run.path, f"CONNECT far.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert status_of(beyond) == 403 and CEILING_SETTING in body_of(beyond)
        assert ("far.test", upstream.port) not in asked
        with pytest.raises(EgressPolicyError, match="allowed_domains"):
            run.proxy.allow("far.test")
        run.proxy.allow("no.test")  # the user changed their mind through another path
        assert status_of(await exchange(run.path, f"CONNECT no.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())) == 200


async def test_a_failing_or_silent_asker_denies(upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    import coderunner.egress.policy_proxy as proxy_module

    monkeypatch.setattr(proxy_module, "ASK_TIMEOUT_S", 0.2)

    async def silent(host: str, port: int) -> bool:
        await asyncio.sleep(3600)
        return True

    async def broken(host: str, port: int) -> bool:
        raise RuntimeError("client went away")

    ceiling = policy_for(upstream, "ok.test", "maybe.test")
    async with running_proxy(policy_for(upstream, "ok.test"), ceiling) as run:
        assert run.proxy.asker is None
        no_one = await exchange(run.path, f"CONNECT maybe.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert status_of(no_one) == 403 and 'allow=["maybe.test"]' in body_of(no_one)
        run.proxy.asker = broken  # set later, as the wiring does per call
        assert run.proxy.asker is broken
        answer = await exchange(run.path, f"CONNECT maybe.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert status_of(answer) == 403 and "declined" in body_of(answer)
    for asker in (silent, broken):
        async with running_proxy(policy_for(upstream, "ok.test"), ceiling, asker=asker) as run:
            answer = await exchange(run.path, f"CONNECT maybe.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
            assert status_of(answer) == 403
    assert upstream.connects == 0


async def test_over_the_connection_cap_answers_503_at_once(upstream: Upstream) -> None:
    # The subject is the cap, not connect timing: one clean-clone run saw a loopback connect time out at
    # the default 10 s on a loaded machine, which freed a slot this test holds.
    limits = ProxyLimits(max_connections=2, connect_timeout_s=60)
    resolver = resolver_for({"ok.test": ["127.0.0.1"]})
    async with running_proxy(
        policy_for(upstream), limits=limits, resolver=resolver, address_check=loopback_only
    ) as run:
        held = []
        for _ in range(2):
            reader, writer = await asyncio.open_unix_connection(run.path)
            writer.write(f"CONNECT ok.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            assert status_of(head) == 200, f"a held tunnel was not opened: {head[:200]!r}"
            held.append(writer)
        answer = await exchange(run.path, f"CONNECT ok.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert status_of(answer) == 503 and "at most 2" in body_of(answer)
        assert run.proxy.refused_busy == 1
        for writer in held:
            writer.close()
        for _ in range(200):
            if run.proxy.active_connections == 0:
                break
            await asyncio.sleep(0.05)
        answer = await exchange(run.path, f"GET http://ok.test:{upstream.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status_of(answer) == 200


async def test_a_slow_head_is_answered_408_and_closed(upstream: Upstream) -> None:
    limits = ProxyLimits(head_timeout_s=0.3)
    async with running_proxy(policy_for(upstream), limits=limits) as run:
        reader, writer = await asyncio.open_unix_connection(run.path)
        writer.write(b"CONNECT ok.test:443 HTTP/1.1\r\nX-Slow: ")
        answer = await asyncio.wait_for(reader.read(), 20)
        writer.close()
    assert status_of(answer) == 408


async def test_stalled_heads_give_way_to_a_new_client_when_full(upstream: Upstream) -> None:
    limits = ProxyLimits(max_connections=3, head_timeout_s=600)
    resolver = resolver_for({"ok.test": ["127.0.0.1"]})
    async with running_proxy(
        policy_for(upstream), limits=limits, resolver=resolver, address_check=loopback_only
    ) as run:
        slow = []
        for _ in range(3):
            _, writer = await asyncio.open_unix_connection(run.path)
            writer.write(b"CONNECT ok.test:")
            slow.append(writer)
        await asyncio.sleep(1.2)  # past the age at which a head counts as stalled
        answer = await exchange(run.path, f"GET http://ok.test:{upstream.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status_of(answer) == 200
        for writer in slow:
            writer.close()


async def test_an_idle_tunnel_is_closed(upstream: Upstream) -> None:
    limits = ProxyLimits(idle_s=0.3)
    resolver = resolver_for({"ok.test": ["127.0.0.1"]})
    async with running_proxy(
        policy_for(upstream), limits=limits, resolver=resolver, address_check=loopback_only
    ) as run:
        reader, writer = await asyncio.open_unix_connection(run.path)
        writer.write(f"CONNECT ok.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        await reader.readuntil(b"\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 20) == b""  # the proxy hung up; we never did
        writer.close()


async def test_aclose_and_cancel_end_every_connection(upstream: Upstream) -> None:
    resolver = resolver_for({"ok.test": ["127.0.0.1"]})
    async with running_proxy(policy_for(upstream), resolver=resolver, address_check=loopback_only) as run:
        readers = []
        for _ in range(5):
            reader, writer = await asyncio.open_unix_connection(run.path)
            writer.write(f"CONNECT ok.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
            await reader.readuntil(b"\r\n\r\n")
            readers.append((reader, writer))
        assert run.proxy.active_connections == 5
        await run.proxy.aclose()
        for reader, writer in readers:
            assert await asyncio.wait_for(reader.read(), 20) == b""
            writer.close()
        assert run.proxy.active_connections == 0
        assert run.log.totals()["allowed"] == 5


async def test_questions_are_one_at_a_time_and_bounded_per_session(upstream: Upstream) -> None:
    """Code in the sandbox picks the names: it must not be able to bury the user in prompts."""
    from coderunner.egress.policy_proxy import MAX_ASKS

    asked: list[str] = []
    in_flight = 0
    most = 0

    async def asker(host: str, port: int) -> bool:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        asked.append(host)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return False

    ceiling = policy_for(upstream, "ok.test", "*.ok.test")
    async with running_proxy(policy_for(upstream, "ok.test"), ceiling, asker=asker) as run:
        heads = [f"CONNECT h{i}.ok.test:{upstream.port} HTTP/1.1\r\n\r\n".encode() for i in range(MAX_ASKS + 5)]
        answers = await asyncio.gather(*(exchange(run.path, head) for head in heads))
        assert [status_of(a) for a in answers] == [403] * len(heads)
        assert len(asked) == MAX_ASKS and most == 1
        later = await exchange(run.path, f"CONNECT late.ok.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert (
            status_of(later) == 403 and "was not asked" in body_of(later) and 'allow=["late.ok.test"]' in body_of(later)
        )
    assert upstream.connects == 0


def test_a_policy_beyond_its_ceiling_and_bad_limits_are_refused_at_construction() -> None:
    from coderunner.egress import DecisionLog, EgressProxy

    ceiling = EgressPolicy.parse(["*.ok.test"], ports=[443])
    with pytest.raises(EgressPolicyError, match="allowed_domains"):
        EgressProxy(EgressPolicy.parse(["evil.test"], ports=[443]), ceiling, session_id="s", log=DecisionLog("s"))
    with pytest.raises(EgressPolicyError):
        EgressProxy(EgressPolicy.parse(["a.ok.test"], ports=[22]), ceiling, session_id="s", log=DecisionLog("s"))
    EgressProxy(EgressPolicy.parse(["a.ok.test"], ports=[443]), ceiling, session_id="s", log=DecisionLog("s"))
    for bad in ({"max_connections": 0}, {"idle_s": -1.0}, {"max_head_bytes": 0}):
        with pytest.raises(ValueError):
            ProxyLimits(**bad)  # type: ignore[arg-type]


async def test_no_descriptor_is_left_behind(upstream: Upstream) -> None:
    """Every path (relay, denial, 400, 503, timeout, reset) closes both sides: fds return to baseline."""
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    limits = ProxyLimits(max_connections=4, head_timeout_s=0.5, idle_s=0.5)
    resolver = resolver_for({"ok.test": ["127.0.0.1"], "priv.ok.test": ["10.0.0.1"]})
    async with running_proxy(
        policy_for(upstream), limits=limits, resolver=resolver, address_check=loopback_only
    ) as run:
        good = f"GET http://ok.test:{upstream.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        await exchange(run.path, good)
        baseline = fds()
        for _ in range(5):
            heads = [
                good,
                f"CONNECT ok.test:{upstream.port} HTTP/1.1\r\n\r\nping".encode(),
                f"CONNECT evil.test:{upstream.port} HTTP/1.1\r\n\r\n".encode(),
                f"CONNECT priv.ok.test:{upstream.port} HTTP/1.1\r\n\r\n".encode(),
                b"garbage\r\n\r\n",
                b"CONNECT ok.test:",  # half a head, then EOF
            ]
            await asyncio.gather(*(exchange(run.path, h) for h in heads * 3))
            _, writer = await asyncio.open_unix_connection(run.path)
            writer.write(b"CONNECT ok.")  # slowloris, timed out by the proxy
            await asyncio.sleep(0.8)
            writer.transport.abort()
        for _ in range(200):
            if run.proxy.active_connections == 0 and fds() <= baseline:
                break
            await asyncio.sleep(0.05)
        assert run.proxy.active_connections == 0
        assert fds() <= baseline
