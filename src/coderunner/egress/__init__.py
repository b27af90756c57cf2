"""The host-side egress policy proxy for `network="allowlist"` sessions (issue 15).

A session in allowlist mode has no network interface but loopback; its only way out is one
EgressProxy per session, served on a unix socket the session's sandbox gets bound in. The proxy
decides on the host NAME the client asked for (policy/egress.py), resolves it itself, refuses any
address that points back at the host or a private network (addresses.py), connects only to the
address it checked, and records every decision (audit.py). It never intercepts TLS.

The proxy itself is pure: no settings, no sessions, no sandboxes; this package imports nothing above
policy/ and the vocabulary. Beside it: texts.py (what the agent and the user are told) and asker.py
(who asks the user about a host during a call). Elsewhere: the allowlist (policy/egress.py) and the
user's egress settings with the ceiling parsed once (policy/egress_settings.py, `Settings.egress`),
and one sandbox's proxy on its socket with the server-wide hub (sessions/egress_wiring.py). Under
it: handoff.py (a client socket the sandbox's forwarder hands over that socket), wire.py (request
heads, answers) and relay.py (the bytes of an allowed connection, moved off the event loop). The wiring, roughly:

    ceiling = settings.egress.ceiling                                                # parsed once
    policy = ceiling.narrowed(allow) if allow else ceiling                           # per session
    audit = AuditFile(state_dir / "egress.jsonl")                                    # one per server
    log = DecisionLog(session_id, sink=audit)
    proxy = EgressProxy(policy, ceiling, session_id=session_id, log=log, asker=ask)
    listener = socket.socket(AF_UNIX, SOCK_STREAM); listener.bind(host_only_path); listener.listen()
    task = start(proxy.serve(listener))          # cancel it, then `await proxy.aclose()`, on close
    mark = log.mark(); ...run...; log.denied_since(mark)                            # run_python
    log.recent(10), log.totals()                                                    # manage_sessions status
    audit.close()                                                                   # at shutdown

EgressPolicyError messages are for the caller (they name CEILING_SETTING where it applies).
"""

from __future__ import annotations

from coderunner.egress.addresses import IPAddress, forbidden_reason, host_addresses
from coderunner.egress.audit import AuditFile, Decision, DecisionLog
from coderunner.egress.policy_proxy import Asker, EgressProxy, ProxyLimits
from coderunner.egress.upstream import AddressCheck, Resolver
from coderunner.policy.egress import PRESETS, EgressPolicy, EgressPolicyError

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
