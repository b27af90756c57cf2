"""A flood and a slowloris against one session's proxy leave it (and a bystander's) serving."""

from __future__ import annotations

import asyncio

import pytest

from coderunner.egress import EgressPolicy, ProxyLimits

from .harness import Upstream, exchange, loopback_only, peak_connections, resolver_for, running_proxy, status_of

pytestmark = pytest.mark.anyio

FLOOD = 200
SLOWLORIS = 80
#: Over the cap a client gets 503 at once, or a reset if the proxy closed before reading its request
#: (closing a unix socket with unread bytes resets it): never a hang, never anything else.
OVER_CAP = {503, 0}


async def test_flood_and_slowloris_leave_the_proxy_and_a_bystander_serving() -> None:
    upstream = await Upstream().start()
    policy = EgressPolicy.parse(["ok.test"], ports=[upstream.port])
    resolver = resolver_for({"ok.test": ["127.0.0.1"]})
    limits = ProxyLimits(head_timeout_s=600)  # only eviction can free a slowloris slot in this test
    good = f"GET http://ok.test:{upstream.port}/ HTTP/1.1\r\nHost: ok.test\r\n\r\n".encode()
    try:
        async with (
            running_proxy(policy, resolver=resolver, address_check=loopback_only, limits=limits) as run,
            running_proxy(policy, resolver=resolver, address_check=loopback_only) as bystander,
        ):
            async with peak_connections(run.proxy) as peak:
                # 1. 200 at once: each is served or refused at once; none hangs.
                codes = [status_of(a) for a in await asyncio.gather(*(exchange(run.path, good) for _ in range(FLOOD)))]
                assert set(codes) <= {200} | OVER_CAP and 200 in codes, codes
                served = codes.count(200)

                # 2. Slowloris clients take every slot, and another flood comes on top.
                slow = []
                for _ in range(SLOWLORIS):
                    _, writer = await asyncio.open_unix_connection(run.path)
                    writer.write(b"CONNECT ok.test:")  # and never more
                    slow.append(writer)
                codes = [status_of(a) for a in await asyncio.gather(*(exchange(run.path, good) for _ in range(FLOOD)))]
                assert set(codes) <= {200} | OVER_CAP, codes
                served += codes.count(200)
                # The bystander session's proxy is untouched by all of this.
                assert status_of(await exchange(bystander.path, good)) == 200
                await asyncio.sleep(1.2)  # the slowloris heads are now old enough to count as stalled
                assert status_of(await exchange(run.path, good)) == 200
                served += 1
            assert peak[0] <= limits.max_connections
            assert upstream.connects == served + 1  # + the bystander's
            for writer in slow:
                writer.close()
    finally:
        await upstream.stop()
