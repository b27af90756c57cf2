"""get_capabilities: what this server offers, so an agent can plan before it runs anything.

Language versions are read once, inside a throwaway sandbox (what the code will really get);
the rest comes from the settings and the backend's own account of how each limit is enforced.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from coderunner import __version__
from coderunner.egress.texts import allowlist_enforcement, ceiling_summary, presets
from coderunner.sandbox import SandboxUnavailable
from coderunner.sandbox.env import requirements_text
from coderunner.vocabulary.network import install_way_out, modes_within

if TYPE_CHECKING:
    from coderunner.config import Settings
    from coderunner.oneshot.host import OneShotHost
    from coderunner.sessions.seam import SandboxProfile, SessionHost

LANGUAGE_TOOLS = {
    "python": ["run_python (persistent kernel)", "execute_code"],
    "javascript": ["execute_code (Node.js)"],
    "bash": ["execute_code"],
}


def sandbox_packages() -> dict[str, str]:
    """The pinned packages of the sandbox environment (its requirements file)."""
    pins = {}
    for line in requirements_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            pins[name] = version
    return pins


def network_capabilities(settings: Settings, profile: SandboxProfile) -> dict[str, Any]:
    """The network modes an agent may ask for here (never above the user's ceiling), what 'allowlist'
    enforces on this backend, and the hosts the user allows."""
    ceiling = settings.network_ceiling
    modes = modes_within(ceiling)
    network: dict[str, Any] = {
        "default": settings.network,
        "ceiling": f"{ceiling} (set by the user; an agent cannot raise it)",
        "modes": {mode: profile.network_problems[mode] or "available" for mode in modes},
    }
    if "allowlist" in modes:
        network["allowlist"] = {
            "enforcement": allowlist_enforcement(profile.backend, profile.network_problems["allowlist"]),
            "allowed_domains": ceiling_summary(settings.allowed_domains, settings.allowed_ports),
            "presets": presets(),
            "more_hosts": "create_session(network='allowlist', allow=[...]) takes a subset of allowed_domains; "
            "a host beyond it is asked of the user where the client supports elicitation, else denied",
        }
    network["install_packages"] = f"needs a session with network: {install_way_out(ceiling)}"
    return network


@dataclass
class Capabilities:
    _versions: dict[str, Any] | None = None

    async def describe(self, host: SessionHost, oneshots: OneShotHost, tools: list[str]) -> dict[str, Any]:
        settings, profile = host.settings, host.profile()
        defaults = host.options()
        versions = self._versions
        if versions is None:
            try:
                versions = self._versions = await oneshots.language_versions(defaults)
            except SandboxUnavailable:  # no one-shot sandboxes here (the Apple backend, so far): unknown
                versions = {}
        return {
            "server": {"name": "coderunner", "version": __version__, "transport": settings.transport},
            "languages": {
                language: {
                    "version": versions.get(language),
                    "tools": [
                        use
                        for use in used_by
                        if use.split(" ")[0] in tools  # only the tools offered here
                    ],
                }
                for language, used_by in LANGUAGE_TOOLS.items()
            },
            "sandbox": {
                "backend": profile.backend,
                "isolation": profile.isolation,
                "oneshot_ready": oneshots.ready_counts(),
            },
            "limits": {
                "timeout_s": settings.timeout_s,
                "max_timeout_s": settings.max_timeout_s,
                **{name: asdict(report) for name, report in profile.limit_reports.items()},
                "disk_mb": settings.disk_mb,
                "max_sessions": settings.max_sessions,
                "idle_timeout_s": settings.idle_timeout_s,
                "output_limit_chars": settings.output_limit_chars,
            },
            "network": network_capabilities(settings, profile),
            "files": {
                "workspace": profile.workspace_path,
                "mounts": [{"sandbox": path, "mode": "rw" if writable else "ro"} for path, writable in profile.mounts],
                "import_dirs": [str(folder) for folder in settings.import_dirs],  # the user's, to upload from
                "export": (
                    f"save to {settings.export_mount}: copied to your own export folder after each call"
                    if settings.export_dir is not None
                    else None
                ),
            },
            "snapshots": {
                "what": (
                    "workspace files and the whole sandbox's memory (a gVisor checkpoint): every variable, "
                    "running thread, open file and /tmp; restorable on this backend with the same runsc and image"
                    if profile.memory_snapshots
                    else "workspace files and the kernel's variables (pickled inside the sandbox); not running "
                    "threads, open files or sockets, or the browser page"
                ),
                "limit_mb": settings.snapshot_limit_mb,
                "kept": f"{settings.snapshot_keep} per client, at most {settings.snapshot_retention_s / 86400:g} days",
                "keep_state": "create_session(name=..., persistent=true, keep_state=true) saves variables at close",
            },
            "packages": sandbox_packages(),
            "tools": tools,
        }
