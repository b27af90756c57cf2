"""The host-side egress policy proxy for `network="allowlist"` sessions (issue 15).

A session in allowlist mode has no network interface but loopback; its only way out is one
EgressProxy per session, served on a unix socket the session's sandbox gets bound in. The proxy
decides on the host NAME the client asked for (policy.py), resolves it itself, refuses any address
that points back at the host or a private network (addresses.py), connects only to the address it
checked, and records every decision (audit.py). It never intercepts TLS.

This package is pure: no settings, no sessions, no sandboxes. The wiring lives elsewhere.
"""

from __future__ import annotations

from .addresses import IPAddress, forbidden_reason, host_addresses
from .audit import AuditFile, Decision, DecisionLog
from .policy import PRESETS, EgressPolicy, EgressPolicyError
from .proxy import AddressCheck, Asker, EgressProxy, ProxyLimits, Resolver

__all__ = [
    "PRESETS",
    "AddressCheck",
    "Asker",
    "AuditFile",
    "Decision",
    "DecisionLog",
    "EgressPolicy",
    "EgressPolicyError",
    "EgressProxy",
    "IPAddress",
    "ProxyLimits",
    "Resolver",
    "forbidden_reason",
    "host_addresses",
]
