"""What the user and the agent are told about network 'allowlist': denials, status, enforcement.

Pure functions over the egress package's records (policy, decisions), so every reply says the same
thing in the same words: which hosts were denied and why, and the one way out that fits each
(answer the question, ask for the host at create_session, or have the user widen allowed_domains).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coderunner.egress.audit import Decision
from coderunner.policy.egress import CEILING_SETTING, PRESETS, EgressPolicy, EgressPolicyError

#: Hosts named in one denial line; the rest are counted.
MAX_NAMED = 5
#: Decisions manage_sessions status shows.
STATUS_RECENT = 10


@dataclass(frozen=True)
class Denied:
    """One host:port denied during a call, and what the proxy said about it."""

    target: str
    reason: str

    @property
    def host(self) -> str:
        host = self.target.rpartition(":")[0]
        return host[1:-1] if host.startswith("[") else host

    @property
    def port(self) -> int:
        tail = self.target.rpartition(":")[2]
        return int(tail) if tail.isdigit() else 0


def denied_with_reasons(targets: Sequence[str], recent: Iterable[Decision]) -> list[Denied]:
    """Pair each denied "host:port" with the latest reason the log holds for it (if still held)."""
    reasons: dict[str, str] = {}
    for decision in recent:
        if not decision.allowed:
            reasons[_target(decision.host, decision.port)] = decision.reason
    return [Denied(target, reasons.get(target, "")) for target in targets]


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _allows(policy: EgressPolicy, host: str, port: int) -> bool:
    try:
        return policy.allows(host, port)
    except EgressPolicyError:
        return False


def _named(targets: Sequence[str]) -> str:
    shown = ", ".join(targets[:MAX_NAMED])
    return shown if len(targets) <= MAX_NAMED else f"{shown} and {len(targets) - MAX_NAMED} more"


def denial_note(
    denied: Sequence[Denied],
    policy: EgressPolicy,
    ceiling: EgressPolicy,
    *,
    declined: Iterable[str] = (),
) -> str | None:
    """One short line naming the hosts denied during a call, grouped by why, each with its way out.

    `declined`: hosts the user said no to (MCP elicitation) during this call.
    """
    if not denied:
        return None
    said_no = set(declined)
    groups: dict[str, list[Denied]] = {}
    for item in denied:
        if item.port not in ceiling.ports:
            ports = ", ".join(str(port) for port in sorted(ceiling.ports))
            key = f"port not allowed; the user's allowed_ports: {ports}"
        elif _allows(policy, item.host, item.port):
            key = item.reason or "refused by address"
        elif item.host in said_no:
            key = "the user declined"
        elif _allows(ceiling, item.host, item.port):
            key = f"not in this session's allowlist; allowed: {policy.describe()}"
        else:
            key = f"not in the user's allowed_domains; only the user can add it: {CEILING_SETTING}"
        groups.setdefault(key, []).append(item)
    parts = []
    for why, items in groups.items():
        part = f"denied {_named([item.target for item in items])} ({why})"
        if why.startswith("not in this session's"):
            distinct = list(dict.fromkeys(item.host for item in items))
            hosts = ", ".join(repr(host) for host in distinct[:MAX_NAMED])
            hosts += ", ..." if len(distinct) > MAX_NAMED else ""
            part += f"; to reach it: create_session(network='allowlist', allow=[{hosts}])"
        parts.append(part)
    return "network: " + "; ".join(parts)


def _when(at: float) -> str:
    """Wall-clock seconds as UTC ISO time; anything else (a monotonic clock) as it is."""
    if at > 1e9:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return f"{at:.1f}"


def decision_row(decision: Decision) -> dict[str, Any]:
    row: dict[str, Any] = {
        "at": _when(decision.at),
        "host": decision.host,
        "port": decision.port,
        "allowed": decision.allowed,
    }
    if decision.allowed:
        row.update(sent=decision.sent, received=decision.received)
    else:
        row["reason"] = decision.reason
    return row


def egress_status(
    policy: EgressPolicy, recent: Sequence[Decision], totals: Mapping[str, int], open_now: Sequence[Decision] = ()
) -> dict[str, Any]:
    """manage_sessions status's view of an allowlist session: what it may reach, what it did, in total, and the
    connections open now (with their bytes so far: a long download shows before it ends)."""
    status: dict[str, Any] = {
        "allowed_hosts": list(policy.hosts),
        "ports": sorted(policy.ports),
        "recent": [decision_row(decision) for decision in recent],
        "totals": dict(totals),
    }
    if open_now:
        status["open"] = [decision_row(decision) for decision in open_now[:STATUS_RECENT]]
    return status


# --- what is enforced where (get_capabilities, doctor) --------------------------------------------

ENFORCED = (
    "the sandbox has no network interface but loopback; its only way out is a proxy on the host "
    "(one per session, reached through a unix socket) that decides by host name, resolves the name "
    "itself and never connects to loopback, private, link-local or the host's own addresses. "
    "HTTP(S)_PROXY is set for code, pip, git, curl, Node and the browser; a program that ignores "
    "proxies gets no network at all"
)


def presets() -> dict[str, list[str]]:
    """The named presets and the hosts each stands for."""
    return {name: list(PRESETS[name]) for name in PRESETS}


def allowlist_enforcement(backend: str, problem: str | None) -> str:
    """How this backend enforces network 'allowlist', or why it refuses it."""
    if problem:
        return f"refused on {backend}: {problem}"
    return f"enforced on {backend}: {ENFORCED}"


def ceiling_summary(allowed_domains: Sequence[str], allowed_ports: Sequence[int]) -> str:
    """The configured ceiling in one line, or how to set one."""
    if not allowed_domains:
        return f"no hosts allowed yet: the user sets {CEILING_SETTING}; until then 'allowlist' is refused"
    ports = ", ".join(str(port) for port in sorted(allowed_ports))
    return f"{', '.join(allowed_domains)} (ports {ports})"


#: What code prints when a name does not resolve or no route leads out: Python (socket, urllib,
#: requests/urllib3), Node.js, curl, pip. Chosen so that a refused connect to the sandbox's own
#: localhost (a server not started yet) is not taken for the network being off.
OFFLINE_MARKERS = (
    "Temporary failure in name resolution",
    "Name or service not known",
    "No address associated with hostname",
    "NameResolutionError",
    "Failed to resolve",
    "getaddrinfo EAI_AGAIN",
    "getaddrinfo ENOTFOUND",
    "Could not resolve host",
    "Network is unreachable",
    "ENETUNREACH",
)


def offline_note(output: str, way_out: str, where: str = "this session") -> str | None:
    """For a run with network 'none' (`where`: a session, or a one-shot run) whose output shows a lookup
    or connect that failed for want of network: the line that says so and how to get more (`way_out`,
    within the user's ceiling)."""
    if not any(marker in output for marker in OFFLINE_MARKERS):
        return None
    return (
        f"network is off in {where} (network 'none'): names do not resolve and nothing outside the "
        f"sandbox answers; {way_out}"
    )
