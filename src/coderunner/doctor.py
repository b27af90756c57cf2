"""`coderunner doctor`: what would stop the sandbox working here, and the command that fixes it.

What each backend needs is its own probes' business (sandbox/<backend>_doctor.py, named by its
registry entry); this module asks the one in use and every other, and adds what no backend owns.
"""

from __future__ import annotations

import os
import time

import anyio

from coderunner.config import Settings
from coderunner.egress.texts import ceiling_summary
from coderunner.policy.egress import PRESETS
from coderunner.sandbox import SandboxUnavailable, make_backend, registry
from coderunner.sandbox.probes import Check, Readiness
from coderunner.sessions import SessionManager
from coderunner.vocabulary.backends import ENTRIES, entry
from coderunner.vocabulary.network import NetworkMode, modes_within


async def check_sandboxed_run(settings: Settings) -> Check:
    try:
        backend = make_backend(settings)
    except SandboxUnavailable as exc:
        return Check("sandboxed 1+1", False, str(exc), None)
    began = time.monotonic()
    try:
        with anyio.fail_after(settings.startup_timeout_s + 10):
            # One check, one session: no warm pool to start beside it.
            async with SessionManager(settings.model_copy(update={"pool_size": 0}), backend) as manager:
                session = await manager.resolve(None)
                result = await session.run("1+1", 10, None)
    except Exception as exc:
        return Check("sandboxed 1+1", False, f"{type(exc).__name__}: {exc}", None)
    text = result.outcome.output.text().strip()
    if result.is_error or text != "2":
        return Check("sandboxed 1+1", False, f"unexpected answer: {text!r}", None)
    return Check("sandboxed 1+1", True, f"= 2 in a fresh sandbox ({time.monotonic() - began:.2f}s cold)")


def check_network_ceiling(settings: Settings) -> Check:
    """The most network an agent may ask for, and where the user sets it."""
    ceiling = settings.network_ceiling
    why = "max_network" if settings.max_network is not None else "what network and allowed_domains turn on"
    return Check(
        "network ceiling",
        True,
        f"{ceiling} ({why}): agents may ask for {' or '.join(modes_within(ceiling))}, never more; you raise it "
        "with max_network (and name hosts for 'allowlist' in allowed_domains)",
    )


def check_network_allowlist(settings: Settings) -> Check:
    """Whether this backend enforces network 'allowlist', and the hosts the user allows (the ceiling)."""
    name = "network 'allowlist' mode"
    try:
        backend = make_backend(settings)
    except SandboxUnavailable as exc:
        return Check(name, True, f"not checked: {exc}", degraded=True)
    problem = backend.network_problem(NetworkMode.ALLOWLIST)
    if problem:
        return Check(name, True, f"refused on {backend.name}: {problem}", degraded=True)
    where = f"enforced on {backend.name} (loopback only inside; out through a per-session host proxy)"
    ceiling = ceiling_summary(settings.allowed_domains, settings.allowed_ports)
    return Check(name, True, f"{where}; allowed_domains: {ceiling}; presets: {', '.join(PRESETS)}")


def check_backend_choice(settings: Settings) -> Check:
    """Which backend sessions use, and why that one."""
    if "backend" in settings.model_fields_set:
        why = "chosen by the configuration (backend / CODERUNNER_BACKEND / --backend)"
    else:
        why = entry(settings.backend).default_reason
    return Check("backend", True, f"{settings.backend}: {why}")


def _engine_problem(settings: Settings, kind: str) -> Readiness:
    """(what is missing for backend `kind` here, the fix), or (None, None) when it looks ready."""
    return registry.readiness(entry(kind), settings)


def summarize_other_backends(settings: Settings) -> Check:
    """One line on the backends not in use: which are ready here (information, never a warning: a user
    of bwrap need not hear that docker's daemon is down). `doctor --all` has a line each, with fixes."""
    ready: list[str] = []
    unavailable: list[str] = []
    for other in ENTRIES:
        if other.name != settings.backend:
            missing, _ = registry.readiness(other, settings)
            (ready if missing is None else unavailable).append(other.name)
    parts = [f"{', '.join(ready)} ready" if ready else "", f"{', '.join(unavailable)} not here" if unavailable else ""]
    return Check("other backends", True, "; ".join(part for part in parts if part) + " (doctor --all says more)")


def check_other_backends(settings: Settings) -> list[Check]:
    """What each backend not in use would need here (information, never a failure)."""
    checks = []
    for other in ENTRIES:
        if other.name == settings.backend:
            continue
        missing, fix = registry.readiness(other, settings)
        detail = "ready" if missing is None else f"unavailable: {missing}"
        checks.append(
            Check(f"other backend {other.name}", True, detail, fix, degraded=missing is not None and bool(fix))
        )
    return checks


def check_backend(settings: Settings) -> list[Check]:
    """The backend in use, as its own probes see it (vocabulary/backends.py names them)."""
    return registry.checks(entry(settings.backend), settings)


def run_checks(settings: Settings, every_backend: bool = False) -> list[Check]:
    """The backend in use (and its sandboxed 1+1); the others in one line, or each (`every_backend`)."""
    checks = [check_backend_choice(settings), *check_backend(settings)]
    checks.append(check_network_ceiling(settings))
    if NetworkMode.ALLOWLIST in modes_within(settings.network_ceiling):
        checks.append(check_network_allowlist(settings))
    if all(check.ok for check in checks):
        checks.append(anyio.run(check_sandboxed_run, settings))
    others = check_other_backends(settings) if every_backend else [summarize_other_backends(settings)]
    return [*checks, *others]


def report(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        mark = "FAIL" if not check.ok else ("warn" if check.degraded else "ok  ")
        lines.append(f"[{mark}] {check.name}: {check.detail}")
        if (not check.ok or check.degraded) and check.fix:
            lines.append(f"       fix: {check.fix}")
    if os.getuid() == 0:
        lines.append("note: running as root; each sandbox runs as an unprivileged host uid of its own, never as root")
    return "\n".join(lines)
