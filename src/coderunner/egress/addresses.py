"""Which resolved addresses the proxy must never connect to, whatever name led there.

Deciding on the name alone is not enough: an allowlisted name can resolve (or be made to resolve,
by DNS rebinding) to the host itself, a private network or a cloud metadata service. Every address
a name resolves to is checked here, and the proxy connects only to an address that passed.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def forbidden_reason(ip: IPAddress, own: frozenset[IPAddress]) -> str | None:
    """Why the proxy must not connect to ip (a short phrase), or None if it may.

    Refused: loopback, RFC 1918, CGNAT, link-local (cloud metadata included), ULA, multicast,
    unspecified, broadcast, reserved, and `own` (the host's interface addresses). IPv6 forms that
    carry an IPv4 address (mapped, compatible, 6to4, NAT64 well-known prefix) are judged by the
    address they carry. Documentation and benchmark ranges are NOT refused: real deployments
    (this test machine included) use them for public services.
    """
    raise NotImplementedError


def host_addresses() -> frozenset[IPAddress]:
    """The host's own interface addresses (all families), cached for a few seconds.

    Blocking (reads the kernel's tables): call it from a worker thread, never on the event loop.
    """
    raise NotImplementedError
