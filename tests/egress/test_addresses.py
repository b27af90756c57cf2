"""forbidden_reason: every refused range, IPv4 carried inside IPv6, documentation ranges allowed."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys

import pytest

from coderunner.egress.addresses import forbidden_reason, host_addresses

OWN = frozenset({ipaddress.ip_address("192.0.2.2"), ipaddress.ip_address("2001:db8::2")})

REFUSED = [
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "unspecified"),
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("10.0.0.1", "private"),
    ("10.255.255.255", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.254", "private"),
    ("192.168.0.1", "private"),
    ("100.64.0.1", "carrier-grade"),
    ("100.127.255.254", "carrier-grade"),
    ("100.100.100.200", "carrier-grade"),  # a cloud metadata address in the shared range
    ("169.254.169.254", "link-local"),
    ("169.254.0.1", "link-local"),
    ("192.0.0.170", "IETF"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "broadcast"),
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("fe80::1", "link-local"),
    ("febf::1", "link-local"),
    ("fec0::1", "site-local"),
    ("fc00::1", "unique local"),
    ("fd00:ec2::254", "unique local"),  # a cloud metadata address over IPv6
    ("ff02::1", "multicast"),
    ("100::1", "discard"),
    ("::1:0:0:1", "reserved"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
    ("64:ff9b:1::1", "NAT64"),
    # IPv4 carried inside IPv6: judged by what they carry.
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.1.2.3", "private"),
    ("::ffff:169.254.169.254", "link-local"),
    ("::127.0.0.1", "loopback"),
    ("::10.0.0.1", "private"),
    ("64:ff9b::127.0.0.1", "loopback"),
    ("64:ff9b::192.168.1.1", "private"),
    ("2002:7f00:1::", "loopback"),
    ("2002:a9fe:a9fe::1", "link-local"),
    ("::ffff:0:10.0.0.1", "private"),
    # The host's own addresses, however spelled.
    ("192.0.2.2", "own"),
    ("::ffff:192.0.2.2", "own"),
    ("2001:db8::2", "own"),
]

ALLOWED = [
    "8.8.8.8",
    "1.1.1.1",
    "203.0.113.80",  # documentation ranges serve public names on this machine
    "192.0.2.9",
    "198.51.100.7",
    "198.18.0.1",  # benchmark range
    "172.32.0.1",  # just outside 172.16/12
    "100.128.0.1",  # just outside 100.64/10
    "2606:4700::1111",
    "2001:db8::1",
    "::ffff:8.8.8.8",
    "64:ff9b::8.8.8.8",
    "2002:0808:0808::1",
]


@pytest.mark.parametrize(("address", "says"), REFUSED)
def test_refused(address: str, says: str) -> None:
    reason = forbidden_reason(ipaddress.ip_address(address), OWN)
    assert reason is not None and says.lower() in reason.lower(), reason


@pytest.mark.parametrize("address", ALLOWED)
def test_allowed(address: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(address), OWN) is None


def test_zone_indexes_are_refused() -> None:
    assert forbidden_reason(ipaddress.IPv6Address("2606:4700::1%eth0"), OWN) is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux); other systems use ifconfig")
def test_host_addresses_match_what_ip_lists() -> None:
    own = host_addresses()
    assert ipaddress.ip_address("127.0.0.1") in own
    listed = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10, check=True).stdout
    for line in listed.splitlines():
        parts = line.split()
        family, cidr = parts[2], parts[3]
        if family in ("inet", "inet6"):
            assert ipaddress.ip_interface(cidr).ip in own, cidr
    # A socket bound to each is on this host: the property the check stands for.
    for ip in own:
        if ip.version == 4 and not ip.is_loopback and str(ip).endswith(".255"):
            continue  # directed broadcast addresses are listed too, and cannot be bound
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            if ip.version == 6 and ip.is_link_local:
                continue
            sock.bind((str(ip), 0))
