"""Which resolved addresses the proxy must never connect to, whatever name led there.

Deciding on the name alone is not enough: an allowlisted name can resolve (or be made to resolve,
by DNS rebinding) to the host itself, a private network or a cloud metadata service. Every address
a name resolves to is checked here, and the proxy connects only to an address that passed.

The table is written out rather than taken from ipaddress's is_private/is_global: those also call
the documentation and benchmark ranges private, and real deployments (this project's test machine
included) serve public names from them.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network

#: (network, reason), first match wins. Reasons are phrases for "resolves to ...".
_V4_REFUSED: tuple[tuple[ipaddress.IPv4Network, str], ...] = (
    (_V4("0.0.0.0/8"), "an unspecified address"),
    (_V4("127.0.0.0/8"), "a loopback address"),
    (_V4("10.0.0.0/8"), "a private network address"),
    (_V4("172.16.0.0/12"), "a private network address"),
    (_V4("192.168.0.0/16"), "a private network address"),
    (_V4("100.64.0.0/10"), "a carrier-grade NAT (shared) address"),
    (_V4("169.254.0.0/16"), "a link-local address (where cloud metadata services live)"),
    (_V4("192.0.0.0/24"), "an IETF protocol address"),
    (_V4("224.0.0.0/4"), "a multicast address"),
    (_V4("255.255.255.255/32"), "the broadcast address"),
    (_V4("240.0.0.0/4"), "a reserved address"),
)
_V6_REFUSED: tuple[tuple[ipaddress.IPv6Network, str], ...] = (
    (_V6("::/128"), "an unspecified address"),
    (_V6("::1/128"), "a loopback address"),
    (_V6("fe80::/10"), "a link-local address"),
    (_V6("fec0::/10"), "a site-local address"),
    (_V6("fc00::/7"), "a unique local (private) address"),
    (_V6("ff00::/8"), "a multicast address"),
    (_V6("100::/64"), "a discard-only address"),
    (_V6("2001::/32"), "a Teredo tunnel address"),
    (_V6("64:ff9b:1::/48"), "a local-use NAT64 address"),
    (_V6("::/8"), "a reserved address"),  # last: the forms above and the IPv4-carrying ones lie in it
)
#: IPv6 forms that carry an IPv4 address in their low 32 bits; judged by the address they carry.
_V4_IN_V6: tuple[ipaddress.IPv6Network, ...] = (
    _V6("::ffff:0:0/96"),  # IPv4-mapped
    _V6("::/96"),  # IPv4-compatible (deprecated, still routed by some stacks)
    _V6("64:ff9b::/96"),  # NAT64 well-known prefix
    _V6("::ffff:0:0:0/96"),  # IPv4-translated (SIIT)
)

OWN_TTL_S = 5.0
_IFCONFIG_TIMEOUT_S = 2.0


def forbidden_reason(ip: IPAddress, own: frozenset[IPAddress]) -> str | None:
    """Why the proxy must not connect to ip (a short phrase), or None if it may.

    Refused: loopback, RFC 1918, CGNAT, link-local (cloud metadata included), ULA, multicast,
    unspecified, broadcast, reserved, and `own` (the host's interface addresses). IPv6 forms that
    carry an IPv4 address (mapped, compatible, 6to4, NAT64 well-known prefix) are judged by the
    address they carry. Documentation and benchmark ranges are NOT refused: real deployments
    (this test machine included) use them for public services.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return "an address with a zone index"
        carried = _carried_v4(ip)
        if carried is not None:
            reason = forbidden_reason(carried, own)
            return None if reason is None else f"{reason} (inside an IPv6 address)"
        table: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = _V6_REFUSED
    else:
        table = _V4_REFUSED
    for net, reason in table:
        if ip in net:
            return reason
    if ip in own:
        return "this host's own address"
    return None


def _carried_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, NAT64, 6to4), if it is one."""
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _V6("::/127"):
        return None  # :: and ::1 are themselves, not IPv4-compatible 0.0.0.0 and 0.0.0.1
    for net in _V4_IN_V6:
        if ip in net:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


_cache_lock = threading.Lock()
_cache: tuple[float, frozenset[IPAddress]] | None = None


def host_addresses() -> frozenset[IPAddress]:
    """The host's own interface addresses (all families), cached for a few seconds.

    Blocking (reads the kernel's tables): call it from a worker thread, never on the event loop.
    Raises OSError if they cannot be read: a caller must then refuse, not assume there are none.
    """
    global _cache
    with _cache_lock:
        now = time.monotonic()
        if _cache is not None and now - _cache[0] < OWN_TTL_S:
            return _cache[1]
        found = _read_linux() if sys.platform.startswith("linux") else _read_ifconfig()
        _cache = (now, found)
        return found


def cached_host_addresses() -> frozenset[IPAddress] | None:
    """The cached own addresses if still fresh, else None; never blocks (safe on the event loop)."""
    cached = _cache
    if cached is not None and time.monotonic() - cached[0] < OWN_TTL_S:
        return cached[1]
    return None


def _read_linux() -> frozenset[IPAddress]:
    """Every local IPv4 (/proc/net/fib_trie: primary and secondary) and IPv6 (/proc/net/if_inet6)."""
    found: set[IPAddress] = set()
    last: str | None = None
    for line in Path("/proc/net/fib_trie").read_text().splitlines():
        text = line.strip()
        if text.startswith("|-- "):
            last = text[4:]
        elif last is not None and (text.startswith("/32 host LOCAL") or text.endswith(" BROADCAST")):
            found.add(ipaddress.IPv4Address(last))
    v6 = Path("/proc/net/if_inet6")
    if v6.exists():  # absent when IPv6 is disabled
        for line in v6.read_text().splitlines():
            hexaddr = line.split()[0] if line.strip() else ""
            if len(hexaddr) == 32:
                found.add(ipaddress.IPv6Address(int(hexaddr, 16)))
    return frozenset(found)


_IFCONFIG_ADDR = re.compile(r"^\s*inet6?\s+(?:addr:)?([0-9A-Fa-f:.]+)", re.MULTILINE)


def _read_ifconfig() -> frozenset[IPAddress]:
    """Elsewhere (macOS, BSD): the addresses `ifconfig -a` lists, zone indexes dropped."""
    out = subprocess.run(
        ["ifconfig", "-a"], capture_output=True, text=True, timeout=_IFCONFIG_TIMEOUT_S, check=True
    ).stdout
    found: set[IPAddress] = set()
    for match in _IFCONFIG_ADDR.finditer(out):
        try:
            found.add(ipaddress.ip_address(match.group(1)))
        except ValueError:
            continue
    if not found:
        raise OSError("ifconfig -a listed no addresses")
    return frozenset(found)
